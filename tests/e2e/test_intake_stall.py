"""Intake never blocks a loop (issue 34): one client's huge requests, each read and parsed by the
scheduler, leave a neighbouring stream (a canary in a process of its own) going, against the
all-in-one scheduler and against two front-ends and a planner.

Ten 8 MB texts and ten 64 MB token-id lists, under caps raised so far that none is refused from
its size: each is read, parsed (the lists counted, not decoded: frontend/request_parsing.py) and
refused for the model's length. Half the lists hold 16 Mi ids of four bytes, half 64 Mi of one
byte, the costliest for a parser to decode.

What is left on the event loop is grpc's own: grpc 1.85 copies each message it receives into a
Python bytes object on the loop, holding the GIL, twice over into fresh memory. On this 2-core
test machine (a VM where touching fresh memory costs about 4 ms a MB) that copy takes 0.13-0.3 s
per 64 MB message, however little the handler does with it: a bare grpc.aio server whose handler
ignores the bytes (no parsing at all) stalled its loop 0.65-2.5 s when the same twenty messages
arrived together, because their copies run back to back. So:

- sent one at a time, the canary's longest gap is one copy and its usual pace: 0.30-0.34 s
  measured (median of 3, all-in-one, machine shared); parsing on the loop made it 0.83-0.97 s with
  four-byte ids and seconds with one-byte ones. The bound, 0.8 s, leaves room for a loaded machine
  doubling the copy and still fails parsing on the loop;
- sent together, the longest gap is however many copies land in one turn of the loop: 1-3.4 s
  measured all-in-one, and the same with two front-ends when the canary's connection lands on the
  sender's front-end (0.12 s on the other one). The bound, 8 s, is what grpc's copies alone reached
  on a loaded machine with room to spare; decoding the one-byte lists on the loop took over ten.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.frontend.wire_fields import varint_bytes
from tests.helpers.canary import CanaryProcess, CanaryStats
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

torch.set_num_threads(1)

# Qwen3's tokenizer: the random model's vocabulary must hold every id it makes.
VOCAB_SIZE = 151_936
MAX_MODEL_LEN = 512
GENERATE = "/splitserve.v1.Generation/Generate"
MiB = 1 << 20
TEXT_BYTES = 8 * MiB
LIST_BYTES = 64 * MiB
# 2**21 takes four bytes as a varint, 7 one.
WIDE_ID = b"\x80\x80\x80\x01"
NARROW_ID = b"\x07"
# Caps raised so far that no request here is refused from its size: each is read and parsed.
CAPS: dict[str, object] = {"max_prompt_bytes": 16 * MiB, "max_prompt_tokens": 1 << 24}
ONE_AT_A_TIME_BOUND_S = 0.8
TOGETHER_BOUND_S = 8.0


def id_list_body(token_id: bytes) -> bytes:
    """A GenerateRequest of LIST_BYTES of ids, written by hand: building it through the message
    class would take this test minutes of Python."""
    payload = token_id * (LIST_BYTES // len(token_id))
    token_ids = b"\x0a" + varint_bytes(len(payload)) + payload
    rest = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)).SerializeToString()
    return b"\x1a" + varint_bytes(len(token_ids)) + token_ids + rest


def burst_bodies() -> list[bytes]:
    text = pb.GenerateRequest(text="x" * TEXT_BYTES, sampling=pb.SamplingParams(max_tokens=4)).SerializeToString()
    return [text] * 10 + [id_list_body(WIDE_ID)] * 5 + [id_list_body(NARROW_ID)] * 5


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = build_model("llama", tmp_path_factory.mktemp("stall") / "llama", seed=3, vocab_size=VOCAB_SIZE)
    with start_executor(model_dir, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN) as (address, _):
        yield address


@pytest.fixture(scope="module", params=[1, 2], ids=["all-in-one", "two-frontends"])
def scheduler(executor: str, request: pytest.FixtureRequest) -> Iterator[str]:
    with start_scheduler(executor, tokenizer=qwen3_tokenizer_dir(), frontends=request.param, **CAPS) as address:
        yield address


@pytest.fixture(scope="module")
def bodies() -> list[bytes]:
    return burst_bodies()


def generate_raw(address: str, body: bytes) -> grpc.RpcError | None:
    # A connection of its own (channels to one address share one unless told not to): behind two
    # front-ends the requests spread over both, so the canary's gets its share whichever it is.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
        try:
            for _ in call(body, timeout=300):
                pass
        except grpc.RpcError as error:
            return error
    return None


def send(address: str, bodies: list[bytes], together: bool) -> tuple[list[grpc.RpcError | None], CanaryStats]:
    """The bodies from one client, with a canary streaming beside them."""
    with CanaryProcess(address) as canary:
        canary.wait_for_tokens(3)
        canary.reset_gap()
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(bodies) if together else 1) as pool:
            errors = list(pool.map(lambda body: generate_raw(address, body), bodies))
        stats = canary.wait_for_tokens(3)
    print(f"together={together} longest_gap_s={stats.longest_gap_s:.3f} sent_s={time.monotonic() - started:.1f}")
    return errors, stats


def check_refusals(errors: list[grpc.RpcError | None]) -> None:
    details = [error.details() if isinstance(error, grpc.RpcError) else "served" for error in errors]
    assert all(isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT for error in errors), details
    assert all(f"leaves no room to generate under the maximum model length of {MAX_MODEL_LEN}" in d for d in details[:10]), details
    assert all(f"the prompt has {16 << 20} token ids; at most {MAX_MODEL_LEN} are allowed" in d for d in details[10:15]), details
    assert all(f"the prompt has {64 << 20} token ids; at most {MAX_MODEL_LEN} are allowed" in d for d in details[15:]), details


def test_huge_requests_one_at_a_time_never_stall_a_neighbouring_stream(scheduler: str, bodies: list[bytes]) -> None:
    errors, stats = send(scheduler, bodies, together=False)
    check_refusals(errors)
    assert not stats.errors and stats.mismatches == 0
    assert stats.longest_gap_s < ONE_AT_A_TIME_BOUND_S, stats


def test_huge_requests_together_stall_a_neighbouring_stream_only_for_grpcs_copies(scheduler: str, bodies: list[bytes]) -> None:
    errors, stats = send(scheduler, bodies, together=True)
    check_refusals(errors)
    assert not stats.errors and stats.mismatches == 0
    assert stats.longest_gap_s < TOGETHER_BOUND_S, stats
