"""What a benchmark system is given and what one measured run of it gives back, as JSON files.

Standard library only: bench.vllm_peer imports it under the vLLM virtualenv, which holds nothing
of splitserve's.

Requests file: a JSON list of {"prompt_token_ids": [...], "max_tokens": N}.
Result file: one RunResult as a JSON object.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from itertools import groupby
from pathlib import Path

# torch dtype names a peer may be asked to run in (--dtype of bench.compare and of the peers).
PEER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(slots=True, frozen=True)
class PeerRequest:
    prompt_token_ids: list[int]
    max_tokens: int


class ItlKind(StrEnum):
    """How a system's inter-token latencies were observed."""

    # One sample per output token after the first: the wait since the previous token.
    PER_TOKEN = "per-token"
    # One sample per request: (last token - first token) / (tokens - 1), from engine timestamps.
    REQUEST_MEAN = "per-request mean"
    UNAVAILABLE = "n/a"


@dataclass(slots=True)
class RunResult:
    """One measured run of one system over a workload. Times are seconds from the moment every
    request had been handed over (the start of the timing)."""

    system: str
    wall_s: float
    # Per request, in the order of the requests file.
    outputs: list[list[int]]
    ttft_s: list[float]
    itl_s: list[float]
    itl_kind: str
    # Prompt tokens the system ran through the model (the rest came from a prefix cache); None
    # where the system does not say.
    prompt_tokens_computed: int | None


def write_requests(path: Path, requests: list[PeerRequest]) -> None:
    path.write_text(json.dumps([asdict(r) for r in requests]))


def load_requests(path: Path) -> list[PeerRequest]:
    raw = json.loads(path.read_text())
    return [PeerRequest([int(t) for t in r["prompt_token_ids"]], int(r["max_tokens"])) for r in raw]


def write_result(path: Path, result: RunResult) -> None:
    path.write_text(json.dumps(asdict(result)))


def read_result(path: Path) -> RunResult:
    return RunResult(**json.loads(path.read_text()))


def token_gaps(token_times: list[float]) -> list[float]:
    """Inter-token latencies from one request's token arrival times (seconds, ascending).

    Every token after the first gives one sample. Tokens that arrive together (one streamed
    delta) split the wait since the previous arrival evenly; those that arrive with the first
    token waited for nothing after it (the first token's own wait is its TTFT).
    """
    gaps: list[float] = []
    previous: float | None = None
    for at, group in groupby(token_times):
        count = len(list(group))
        if previous is None:
            gaps.extend([0.0] * (count - 1))
        else:
            gaps.extend([(at - previous) / count] * count)
        previous = at
    return gaps
