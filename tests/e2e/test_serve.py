"""`splitserve serve MODEL_DIR` and `splitserve run --model DIR`: a model folder of the user's own,
served in one command and answered through the official `openai` package.

Every run binds port 0 for each service, so tests never race for the default ports: the banner
says which ports they bound.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.helpers.launcher_output import LauncherOutput
from tests.helpers.model_factory import build_model
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")
# Qwen3's tokenizer: the random model's vocabulary must hold every id it makes.
VOCAB_SIZE = 151_936
GATEWAY = re.compile(r"gateway\s+(http://127\.0\.0\.1:\d+/v1)")
METRICS = re.compile(r"metrics\s+(http://127\.0\.0\.1:\d+/metrics)")
ANY_PORT = ("--port", "0", "--executor-port", "0", "--metrics-port", "0", "--gateway-port", "0")


@pytest.fixture(scope="module")
def own_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's checkpoint: config, safetensors weights and a tokenizer with a chat template, in
    a folder named for the model."""
    folder = build_model("llama", tmp_path_factory.mktemp("mine") / "my-tiny-llama", seed=3, vocab_size=VOCAB_SIZE)
    for source in qwen3_tokenizer_dir().iterdir():
        if source.is_file():
            shutil.copyfile(source, folder / source.name)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass(slots=True, frozen=True)
class Served:
    """The URLs the banner gave."""

    gateway: str
    metrics: str


@pytest.fixture
def served(own_model: Path, tmp_path: Path) -> Iterator[Served]:
    """`splitserve serve` running on own_model."""
    process = subprocess.Popen(
        [SPLITSERVE, "serve", str(own_model), *ANY_PORT, "--threads", "1", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        stdout = LauncherOutput(process).until_banner(timeout_s=240)
        # serve asks nothing: the banner is the first thing it prints.
        assert "> " not in stdout.split("splitserve is running")[0], stdout
        gateway, metrics = GATEWAY.search(stdout), METRICS.search(stdout)
        assert gateway is not None and metrics is not None, stdout
        yield Served(gateway.group(1), metrics.group(1))
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_answers_through_the_openai_package(own_model: Path, served: Served) -> None:
    before = _snapshot(own_model)
    with openai.OpenAI(base_url=served.gateway, api_key="unused", max_retries=0, timeout=60.0) as client:
        assert [model.id for model in client.models.list()] == ["my-tiny-llama"]
        answer = client.chat.completions.create(
            model="my-tiny-llama",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_completion_tokens=8,
            temperature=0,
        )
        again = client.chat.completions.create(
            model="my-tiny-llama",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_completion_tokens=8,
            temperature=0,
        )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8
    assert isinstance(choice.message.content, str)
    # Greedy: the same question, the same answer.
    assert again.choices[0].message.content == choice.message.content
    # Serving a folder reads it and never writes to it.
    assert _snapshot(own_model) == before
    # --metrics-port 0: the banner names the port the scheduler bound, and it counts the answers.
    with urllib.request.urlopen(served.metrics, timeout=10) as response:
        exposition = response.read().decode()
    generated = re.search(r"^splitserve:generation_tokens_total (\S+)$", exposition, re.MULTILINE)
    assert generated is not None and again.usage is not None
    assert float(generated.group(1)) == answer.usage.completion_tokens + again.usage.completion_tokens, exposition


def test_run_with_model_asks_its_question_of_that_model(own_model: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [SPLITSERVE, "run", "--model", str(own_model), *ANY_PORT, "--threads", "1", "--log-dir",
         str(tmp_path), "--once", "--question", "Hello"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "> Hello" in result.stdout
    # The default model was never prepared: no prepare-model child ran.
    assert "name=prepare-model" not in result.stderr and "event=model_preparing" not in result.stderr
    assert re.search(rf"--tokenizer {re.escape(str(own_model))}", result.stderr), result.stderr[-3000:]


def test_run_refuses_model_and_cache_dir_together(own_model: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [SPLITSERVE, "run", "--model", str(own_model), "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "give one" in result.stderr and "Traceback" not in result.stderr
