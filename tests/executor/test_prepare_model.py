"""The default model is prepared once from its GGUF file and answers like the original."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor_service.prepare_model import (
    COMPLETE_MARKER,
    RECOMMENDED_SAMPLING,
    FolderNotOurs,
    _move_into_place,
    check_target,
    is_prepared,
    prepare_model,
)
from scheduler_service.text.generation_config import load_sampling_defaults


@pytest.fixture
def prepared(prepared_model: Path) -> Path:
    """The session's prepared model (tests/conftest.py): its first preparation is the real one."""
    return prepared_model


def test_folder_is_complete(prepared: Path) -> None:
    names = {p.name for p in prepared.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", COMPLETE_MARKER} <= names
    assert "tokenizer.json" in names
    # No temp folder is left beside the result.
    assert [p.name for p in prepared.parent.iterdir()] == [prepared.name]


def test_second_call_returns_at_once(prepared: Path) -> None:
    started = time.monotonic()
    assert prepare_model(prepared) == prepared
    assert time.monotonic() - started < 1.0


def test_generation_config_holds_the_model_cards_sampling(prepared: Path) -> None:
    defaults = load_sampling_defaults(prepared)
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (0.2, 0.9, 1.1)
    assert defaults.top_k == 0 and defaults.max_tokens is None
    config = json.loads((prepared / "generation_config.json").read_text())
    assert config["eos_token_id"] == 2


def test_a_folder_prepared_before_the_sampling_defaults_gets_them(prepared: Path, tmp_path: Path) -> None:
    older = tmp_path / "older"
    shutil.copytree(prepared, older, ignore=shutil.ignore_patterns("*.safetensors"))
    config_path = older / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k not in RECOMMENDED_SAMPLING}))
    assert load_sampling_defaults(older).temperature == 1.0
    assert prepare_model(older) == older
    assert json.loads(config_path.read_text()) == config


def test_incomplete_folder_is_not_taken_as_ready(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not is_prepared(tmp_path)


def test_greedy_chat_answer(prepared: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared)
    model = AutoModelForCausalLM.from_pretrained(prepared)
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
    # Generation ended on <|im_end|> rather than on the token limit.
    assert output[0, -1].item() == 2


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under folder: its bytes and its modification time in ns."""
    return {
        str(path.relative_to(folder)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _plant_checkpoint(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (folder / "notes").mkdir()
    (folder / "notes" / "README.md").write_text("my fine-tune, three weeks of work\n")


def test_a_users_checkpoint_given_as_cache_dir_survives_byte_for_byte(tmp_path: Path) -> None:
    mine = tmp_path / "my-model"
    _plant_checkpoint(mine)
    before = _snapshot(mine)
    command = [str(Path(sys.executable).parent / "splitserve"), "prepare-model", "--cache-dir", str(mine)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "left as it is" in lines[0] and f"splitserve serve {mine}" in lines[0]
    assert _snapshot(mine) == before
    # Nothing was built beside it either.
    assert [p.name for p in tmp_path.iterdir()] == ["my-model"]


@pytest.mark.parametrize("planted", ["a file", "a folder with files"])
def test_a_target_that_fills_during_the_build_is_not_replaced(tmp_path: Path, planted: str) -> None:
    target = tmp_path / "target"
    built = tmp_path / ".target.tmp-1"
    built.mkdir()
    (built / "config.json").write_text("{}")
    if planted == "a file":
        target.write_text("someone's file\n")
    else:
        _plant_checkpoint(target)
    before = _snapshot(target) if target.is_dir() else target.read_bytes()
    with pytest.raises(FolderNotOurs):
        _move_into_place(built, target)
    assert (_snapshot(target) if target.is_dir() else target.read_bytes()) == before


def test_an_empty_or_prepared_folder_may_be_prepared_into(tmp_path: Path, prepared: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    check_target(empty)
    check_target(tmp_path / "absent")
    check_target(prepared)
    built = tmp_path / ".empty.tmp-1"
    built.mkdir()
    (built / COMPLETE_MARKER).write_text("test\n")
    _move_into_place(built, empty)
    assert is_prepared(empty) and not built.exists()
