"""What a user can get wrong starting an executor is refused in one line on stderr that says what
is wrong and what to do, with exit status 2 and no traceback (-v adds it), before the model
loads: every case through the real command, as a user would meet it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.model_factory import build_model
from tests.helpers.service_process import free_port
from tests.helpers.startup_refusal import (
    EXECUTOR,
    EXECUTOR_MODULE,
    listener,
    refused,
    refused_by_argparse,
    run,
)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_missing_model_folder_says_what_a_model_folder_holds(tmp_path: Path) -> None:
    refusal = refused([*EXECUTOR, "--model", str(tmp_path / "nowhere")])
    assert refusal.fields["event"] == "executor_refused"
    assert refusal.reason.startswith(f"--model {tmp_path / 'nowhere'}: no such folder")
    assert "config.json and the weights" in refusal.reason
    assert "splitserve prepare-model" in refusal.reason


def test_a_hub_id_is_told_that_nothing_is_downloaded(tmp_path: Path) -> None:
    refusal = refused([*EXECUTOR_MODULE, "--model", HUB_ID])
    assert "nothing is downloaded" in refusal.reason and "Hugging Face hub id" in refusal.reason
    assert f"hf download {HUB_ID} --local-dir DIR" in refusal.reason
    assert "splitserve prepare-model" in refusal.reason


def test_a_folder_without_config_json_is_no_model(tmp_path: Path) -> None:
    refusal = refused([*EXECUTOR, "--model", str(tmp_path)])
    assert refusal.reason.startswith(f"--model {tmp_path}: holds no config.json")
    assert "config.json and the weights (*.safetensors)" in refusal.reason


def test_a_config_without_weights_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    refusal = refused([*EXECUTOR, "--model", str(tmp_path)])
    assert refusal.reason.startswith(f"--model {tmp_path}: holds config.json but no weights")
    assert "GGUF files are not loaded" in refusal.reason


@pytest.mark.parametrize(
    ("content", "problem"), [("{not json", "not readable as JSON"), ("{}", "names no model_type")]
)
def test_an_unreadable_config_is_no_model(tmp_path: Path, content: str, problem: str) -> None:
    (tmp_path / "config.json").write_text(content)
    refusal = refused([*EXECUTOR, "--model", str(tmp_path)])
    assert refusal.reason.startswith(f"--model {tmp_path / 'config.json'}: {problem}")


def test_a_model_type_transformers_lacks_is_an_unsupported_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    # Exit 1 as every unsupported model (README); still one line.
    refusal = refused([*EXECUTOR, "--model", str(tmp_path)], status=1)
    assert refusal.fields["model_type"] == "no-such-architecture"
    assert "does not know it; upgrade transformers" in refusal.reason


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("model") / "llama")


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--metrics-port"])
def test_a_port_in_use_is_refused_before_the_model_loads(tiny_model: Path, flag: str) -> None:
    with listener() as port:
        others = [] if flag == "--port" else ["--port", "0"]
        refusal = refused([*EXECUTOR, "--model", str(tiny_model), *others, flag, str(port)])
    # The only line: nothing was loaded (event=model_loaded), nothing started.
    assert refusal.reason.startswith(f"127.0.0.1:{port} ({flag}) is already in use")
    assert f"pass another {flag} (0 picks a free port)" in refusal.reason


def test_two_flags_on_one_port_are_refused(tiny_model: Path) -> None:
    port = free_port()
    both = ["--health-port", str(port), "--metrics-port", str(port)]
    refusal = refused([*EXECUTOR, "--model", str(tiny_model), "--port", "0", *both])
    assert refusal.reason == f"--metrics-port {port} is --health-port's port too; give each its own (0 picks a free one)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_asked_of_a_machine_without_it_is_refused(tiny_model: Path) -> None:
    refusal = refused([*EXECUTOR, "--model", str(tiny_model), "--port", "0", "--device", "cuda"])
    assert refusal.reason == "--device cuda: torch sees no CUDA device here; pass --device cpu (or auto)"


def test_a_meaningless_number_is_refused_by_argparse(tmp_path: Path) -> None:
    line = refused_by_argparse([*EXECUTOR, "--model", str(tmp_path), "--block-size", "0"], "--block-size")
    assert line.endswith("must be at least 1, got 0")


def test_verbose_adds_the_traceback(tmp_path: Path) -> None:
    result = run([*EXECUTOR, "--model", str(tmp_path / "nowhere"), "-v"])
    assert result.returncode == 2
    first, *rest = result.stderr.strip().splitlines()
    assert "event=executor_refused" in first and "no such folder" in first
    assert rest[0] == "Traceback (most recent call last):"
