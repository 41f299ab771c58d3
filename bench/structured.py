"""What a grammar costs: N json_schema streams against N unconstrained streams of the same
lengths, on the default model (SmolLM2-135M), one executor and one scheduler, in one run.

    python -m bench.structured [--model DIR] [--requests 32] [--max-tokens 96] [--rounds 2] [--threads 2]
        [--temperature 0]

Each round runs the constrained batch, then the same prompts unconstrained with max_tokens set
to each constrained answer's length (ignore_eos), so both batches produce the same tokens per
request. A warm-up round runs first; the best round of each is reported, and their ratio, which
issue 37 wants at 0.9 or more. Timings on shared machines are noisy: read the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from clients import AsyncClient
from executor_service.prepare_model import MODEL_NAME, prepare_model
from tests.helpers.executor_process import start_executor
from tests.helpers.scheduler_process import start_scheduler

logger = logging.getLogger("bench.structured")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "integer"},
        "raining": {"type": "boolean"},
    },
    "required": ["city", "unit", "temperature", "raining"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dakar", "Hanoi", "Perth", "Sofia", "Bern"]


@dataclass(slots=True, frozen=True)
class Batch:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def messages(index: int) -> list[dict[str, str]]:
    city = CITIES[index % len(CITIES)]
    return [{"role": "user", "content": f"Request {index}: what is the weather in {city}? Answer in JSON."}]


async def constrained(address: str, requests: int, max_tokens: int, temperature: float) -> tuple[Batch, list[int]]:
    """The json_schema batch, and each answer's length in tokens."""
    async with AsyncClient(address) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate(
                    messages=messages(i), max_tokens=max_tokens, temperature=temperature, seed=i,
                    structured_output={"json": SCHEMA},
                )
                for i in range(requests)
            )
        )
        seconds = time.perf_counter() - started
    for result in results:
        json.loads(result.text)
    lengths = [len(result.token_ids) for result in results]
    return Batch(sum(lengths), seconds), lengths


async def unconstrained(address: str, lengths: list[int], temperature: float) -> Batch:
    """The same prompts without a grammar, each generating exactly its constrained length."""
    async with AsyncClient(address) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate(messages=messages(i), max_tokens=n, temperature=temperature, seed=i, ignore_eos=True)
                for i, n in enumerate(lengths)
            )
        )
        seconds = time.perf_counter() - started
    assert [len(result.token_ids) for result in results] == lengths
    return Batch(sum(lengths), seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a prepared model folder (default: prepare SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="the executor's CPU threads")
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="0: greedy, where sampling costs the same with or without a grammar; above 0 the model's "
        "top_p (0.9 for SmolLM2) sorts each row's logits, which a grammar's -inf make cheaper",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or prepare_model(Path(scratch) / MODEL_NAME)
        with (
            start_executor(model, num_kv_blocks=2048, threads=args.threads) as (executor, _),
            start_scheduler(executor, tokenizer=model, max_num_seqs=args.requests) as address,
        ):
            _, lengths = asyncio.run(constrained(address, args.requests, args.max_tokens, args.temperature))
            asyncio.run(unconstrained(address, lengths, args.temperature))
            best_constrained = best_plain = None
            for _ in range(args.rounds):
                batch, lengths = asyncio.run(constrained(address, args.requests, args.max_tokens, args.temperature))
                plain = asyncio.run(unconstrained(address, lengths, args.temperature))
                logger.info(
                    "round constrained=%.1f tok/s unconstrained=%.1f tok/s tokens=%d",
                    batch.tokens_per_s, plain.tokens_per_s, batch.tokens,
                )
                if best_constrained is None or batch.tokens_per_s > best_constrained.tokens_per_s:
                    best_constrained = batch
                if best_plain is None or plain.tokens_per_s > best_plain.tokens_per_s:
                    best_plain = plain
    assert best_constrained is not None and best_plain is not None
    ratio = best_constrained.tokens_per_s / best_plain.tokens_per_s
    logger.info(
        "structured requests=%d temperature=%g json_schema=%.1f tok/s unconstrained=%.1f tok/s ratio=%.3f",
        args.requests, args.temperature, best_constrained.tokens_per_s, best_plain.tokens_per_s, ratio,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
