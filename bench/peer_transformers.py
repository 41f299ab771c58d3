"""One measured run of a transformers peer, in a process of its own (so its peak RSS is its own):

    python -m bench.peer_transformers {static,batch} --model DIR --prompts requests.json \
        --out result.json [--warmup requests.json] [--threads 2] [--device cpu] [--dtype float32]
        [--page-size 16] [--max-batch-tokens 2048]

static: batched `generate` (bench.throughput_peer); batch: continuous batching
(bench.peer_transformers_batch). Files as in bench.peer_io. --warmup: requests run the same way
first, untimed, in the same process (bench.compare passes its workload's warm-up).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from bench.compare_records import run_result_of
from bench.peer_io import (
    PEER_DTYPES,
    PeerRequest,
    RunResult,
    load_requests,
    write_result,
)
from bench.peer_transformers_batch import run_transformers_batch
from bench.throughput_peer import run_transformers


def run_static(
    model_dir: Path,
    requests: list[PeerRequest],
    threads: int,
    device: str,
    dtype: torch.dtype,
    warm_up: list[PeerRequest] | None = None,
) -> RunResult:
    warm = None if warm_up is None else ([r.prompt_token_ids for r in warm_up], [r.max_tokens for r in warm_up])
    result = run_transformers(
        model_dir, [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests], threads, device, dtype,
        warm,
    )
    # No prefix cache: every prompt token is computed (left padding besides).
    return run_result_of(result, sum(len(r.prompt_token_ids) for r in requests))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["static", "batch"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="requests file (bench.peer_io)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=Path, help="requests file run first, untimed (default: two short requests)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=PEER_DTYPES)
    parser.add_argument("--page-size", type=int, default=16, help="batch: tokens per KV page")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="batch: tokens per step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    )
    args = parse_args(argv)
    requests = load_requests(args.prompts)
    warm_up = load_requests(args.warmup) if args.warmup else None
    dtype = getattr(torch, args.dtype)
    if args.mode == "static":
        result = run_static(args.model, requests, args.threads, args.device, dtype, warm_up)
    else:
        result = run_transformers_batch(
            args.model, requests, args.threads, args.page_size, args.max_batch_tokens, args.device, dtype, warm_up
        )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
