"""Text in, text out, with the real default model (SmolLM2-135M-Instruct): chat template,
incremental detokenization, stop strings that are never streamed in part, Tokenize, model info,
and the Prometheus endpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from clients import Client
from tests.helpers.executor_process import start_executor
from tests.helpers.metrics_scrape import scrape
from tests.helpers.scheduler_process import start_scheduler
from tests.helpers.service_process import free_port

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2 answers this in CJK characters of three UTF-8 bytes, split over two tokens each.
GREETING = [
    {"role": "user", "content": 'Translate "good morning" into Chinese, Japanese and Korean.'}
]


@pytest.fixture(scope="module")
def service(prepared_model: Path) -> Iterator[tuple[str, int]]:
    metrics_port = free_port()
    with start_executor(prepared_model, num_kv_blocks=256, block_size=16) as (executor, _):
        with start_scheduler(executor, tokenizer=prepared_model, metrics_port=metrics_port) as address:
            yield address, metrics_port


def test_chat_answer_streams_as_text(service: tuple[str, int]) -> None:
    address, _ = service
    with Client(address) as client:
        result = client.generate(messages=QUESTION, max_tokens=32, temperature=0)
        deltas = list(client.stream(messages=QUESTION, max_tokens=32, temperature=0))
    assert result.text.strip() == "The capital of France is Paris."
    assert result.finish_reason == "stop"  # the model's EOS, <|im_end|>, not shown as text
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert result.usage.completion_tokens == len(result.token_ids)


def test_stop_string_is_never_streamed_even_in_part(service: tuple[str, int]) -> None:
    address, _ = service
    with Client(address) as client:
        deltas = list(client.stream(messages=QUESTION, max_tokens=32, temperature=0, stop=["Paris"]))
    text = "".join(d.text for d in deltas)
    assert text.strip() == "The capital of France is"
    assert not any("P" in d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "Paris"


def test_tokenize_and_model_info_describe_the_served_model(service: tuple[str, int]) -> None:
    address, _ = service
    with Client(address) as client:
        tokens = client.tokenize(messages=QUESTION)
        info = client.model_info()
        client.generate(messages=QUESTION, max_tokens=4, temperature=0)
        shared_prefix = client.generate(messages=QUESTION, max_tokens=4, temperature=0)
    assert "assistant" in "".join(tokens.tokens)
    assert info.has_tokenizer and info.has_chat_template and 2 in info.eos_token_ids
    assert info.vocab_size == 49152
    # The same chat was just answered: its full prompt blocks come from the prefix cache.
    assert shared_prefix.usage.cached_prompt_tokens >= 16


def test_metrics_endpoint_counts_requests_and_tokens(service: tuple[str, int]) -> None:
    address, metrics_port = service
    with Client(address) as client:
        client.generate(prompt="Hello", max_tokens=3, temperature=0, ignore_eos=True)
    samples, _ = scrape(metrics_port)
    assert samples["splitserve:generation_tokens_total"] >= 3
    assert samples['splitserve:request_success_total{finished_reason="length"}'] >= 1
    assert samples["splitserve:executors_up"] == 1


def test_a_character_cut_by_max_tokens_is_dropped_not_replaced(
    service: tuple[str, int], prepared_model: Path
) -> None:
    """max_tokens ends the answer inside a character: the text stops before it, with no U+FFFD,
    whether read whole or streamed (where the deltas add up to the same text)."""
    address, _ = service
    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    with Client(address) as client:
        long = client.generate(messages=GREETING, max_tokens=64, temperature=0)
        cut = next(
            n for n in range(64, 0, -1) if tokenizer.decode(long.token_ids[:n]).endswith("\ufffd")
        )
        result = client.generate(messages=GREETING, max_tokens=cut, temperature=0)
        deltas = list(client.stream(messages=GREETING, max_tokens=cut, temperature=0))
    expected = tokenizer.decode(long.token_ids[:cut]).rstrip("\ufffd")
    assert result.finish_reason == "length" and result.token_ids == long.token_ids[:cut]
    assert "\ufffd" not in result.text and result.text == expected
    assert "".join(d.text for d in deltas) == expected


def test_the_cli_chat_ends_on_its_own_with_the_models_sampling(service: tuple[str, int]) -> None:
    """A first try at the command line: no --max-tokens, no --temperature. The model's
    generation config (temperature 0.2, top_p 0.9, repetition penalty 1.1) applies, and the
    answer ends on the model's EOS within the CLI's default limit."""
    address, _ = service
    with Client(address) as client:
        defaults = client.model_info().sampling_defaults
    assert (defaults.temperature, defaults.top_p) == pytest.approx((0.2, 0.9))
    assert defaults.source.endswith("generation_config.json")
    ends = []
    # Seeded so the test is repeatable; any seed of the 6 tried ends on EOS.
    for seed in range(3):
        result = subprocess.run(
            [sys.executable, "-m", "clients", "-v", "generate", "--server", address, "--seed", str(seed), "--chat", "Write a haiku about the sea"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        ends.append(re.search(r"finish_reason=(\w+)", result.stderr).group(1))  # type: ignore[union-attr]
    assert ends == ["stop"] * 3
