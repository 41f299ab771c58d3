"""Large prompts cannot make small ones wait for the tokenizer (issue 43, item 4), against a real
scheduler with Qwen3's tokenizer and a tiny random model.

Six clients keep sending 1 MiB text prompts, each tokenized in full (a second or more of work)
and then refused for the model's length, while a 600-character prompt's time to first token is
measured. With one tokenizing thread for everyone that prompt queued behind the large ones: 2-5 s
where it takes tens of milliseconds alone.
"""

from __future__ import annotations

import random
import statistics
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from clients import Client
from protos.splitserve.v1 import generation_pb2 as pb
from tests.helpers.executor_process import start_executor
from tests.helpers.model_factory import build_model
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

torch.set_num_threads(1)

# Qwen3's tokenizer: the random model's vocabulary must hold every id it makes.
VOCAB_SIZE = 151_936
# Past what 1 MiB of text is certainly worth (8,192 tokens at Qwen3's 128 bytes a token at most),
# so the large prompts are not refused from their length: each costs the tokenizer its full work
# (about 500,000 tokens) before the model's length refuses it.
MAX_MODEL_LEN = 16_384
MiB = 1 << 20
LARGE_CLIENTS = 6
SMALL_PROMPT_CHARS = 600
TRIES = 7
GENERATE = "/splitserve.v1.Generation/Generate"


def words(rng: random.Random, chars: int) -> str:
    """Made-up words: text the tokenizer's cache of known words cannot shortcut."""
    text = " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(chars // 4))
    return text[:chars]


@dataclass(slots=True)
class Flood:
    """Clients that each keep one 1 MiB prompt in flight until stopped."""

    address: str
    body: bytes
    # How each call ended: OK, or the status code and message.
    outcomes: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)
            while not self.stop.is_set():
                try:
                    for _ in call(self.body, timeout=120):
                        pass
                    outcome = "OK"
                except grpc.RpcError as error:
                    outcome = f"{error.code().name}: {error.details()}"
                with self.lock:
                    self.outcomes.append(outcome)

    def answered(self) -> int:
        with self.lock:
            return len(self.outcomes)


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = build_model(
        "llama", tmp_path_factory.mktemp("fairness") / "llama", seed=5, vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_MODEL_LEN,
    )
    with start_executor(model_dir, num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN) as (executor, _):
        with start_scheduler(executor, tokenizer=qwen3_tokenizer_dir()) as scheduler:
            yield scheduler


def ttft_s(client: Client, prompt: str) -> float:
    started = time.perf_counter()
    for _ in client.stream(prompt=prompt, max_tokens=1, temperature=0, ignore_eos=True):
        return time.perf_counter() - started
    raise AssertionError("the stream ended without a token")


def median_ttft_s(client: Client, rng: random.Random) -> float:
    # A new prompt each time: the prefix cache must not make later tries cheaper.
    return statistics.median(ttft_s(client, words(rng, SMALL_PROMPT_CHARS)) for _ in range(TRIES))


def test_large_prompts_do_not_delay_a_small_ones_first_token(address: str) -> None:
    """A 600-character prompt's TTFT under the flood stays within 3x its TTFT alone.

    Both are measured here, in the same run, as medians of several tries: this machine is shared
    and a single try can be slowed by anything. The bound has a floor of 0.25 s over the unloaded
    value because the flood keeps cores busy (every tokenizer thread but one, and the clients
    sending it), so the small prompt meets delays of the operating system's scheduler even when it
    waits for no other prompt; 3x of ~30 ms alone would fail on those. What the test must catch is
    queueing behind the large prompts, which costs a second or more (each one tokenizes for 1-2 s;
    with one tokenizing thread for everyone the median was 10 s here).
    """
    rng = random.Random(0)
    body = pb.GenerateRequest(
        text=words(rng, MiB), sampling=pb.SamplingParams(max_tokens=1)
    ).SerializeToString()
    with Client(address) as client:
        ttft_s(client, words(rng, SMALL_PROMPT_CHARS))  # warm up
        alone = median_ttft_s(client, rng)
        flood = Flood(address, body)
        threads = [threading.Thread(target=flood.run, daemon=True) for _ in range(LARGE_CLIENTS)]
        for thread in threads:
            thread.start()
        try:
            # Measured once the tokenizer works through the flood's backlog, not before.
            deadline = time.monotonic() + 60
            while flood.answered() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            loaded = median_ttft_s(client, rng)
            answered = flood.answered()
        finally:
            flood.stop.set()
            for thread in threads:
                thread.join(timeout=120)
    bound = max(3 * alone, alone + 0.25)
    # The flood was real: its prompts were tokenized in full (the engine's refusal counts their
    # tokens; the one made from the length alone says "at least") and refused for their length.
    assert answered >= 2
    assert all(
        "maximum model length" in outcome and "at least" not in outcome for outcome in flood.outcomes
    ), flood.outcomes[:3]
    assert loaded <= bound, f"median TTFT {loaded:.3f} s under the flood, {alone:.3f} s alone (bound {bound:.3f} s)"
