"""Sampling defaults from the model: a field a request leaves unset takes the value in the
model's generation_config.json, else the built-in one; a field set (even to 0) is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.__main__ import sampling_defaults
from scheduler_service.core.sampling_params import SamplingDefaults
from scheduler_service.frontend.request_intake import sampling_from_proto
from scheduler_service.text.generation_config import (
    GenerationConfigError,
    load_sampling_defaults,
)

QWEN_LIKE = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "max_new_tokens": 512,
    "transformers_version": "4.37.0",
}


def model_folder(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_only_the_fields_the_file_sets_replace_the_built_in_ones(tmp_path: Path) -> None:
    defaults = load_sampling_defaults(model_folder(tmp_path, QWEN_LIKE))
    assert defaults == SamplingDefaults(
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        min_p=0.0,
        repetition_penalty=1.05,
        max_tokens=512,
        source=str(tmp_path / "generation_config.json"),
    )


def test_no_file_or_no_sampling_fields_means_the_built_in_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    plain = load_sampling_defaults(model_folder(tmp_path, {"bos_token_id": 1, "eos_token_id": 2}))
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens) == (1.0, 0, 1.0, None)


def test_unset_fields_take_the_defaults_and_set_ones_win_even_at_zero(tmp_path: Path) -> None:
    defaults = load_sampling_defaults(model_folder(tmp_path, QWEN_LIKE))
    unset = sampling_from_proto(pb.SamplingParams(), defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty, unset.max_tokens) == (
        0.7, 20, 0.8, 1.05, 512,
    )
    zeros = sampling_from_proto(pb.SamplingParams(temperature=0, top_k=0, min_p=0, max_tokens=3), defaults)
    assert (zeros.temperature, zeros.top_k, zeros.min_p, zeros.max_tokens) == (0.0, 0, 0.0, 3)
    assert zeros.top_p == 0.8


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 2.5}, "top_k must be a number .whole."),
        ({"max_new_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ([1, 2], "does not hold a JSON object"),
    ],
)
def test_a_file_no_request_could_follow_stops_the_start(tmp_path: Path, config: object, message: str) -> None:
    with pytest.raises(GenerationConfigError, match=message):
        load_sampling_defaults(model_folder(tmp_path, config))


def test_the_flag_chooses_the_source(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, QWEN_LIKE)
    assert sampling_defaults("auto", folder).temperature == 0.7
    assert sampling_defaults("auto", None) == SamplingDefaults()
    assert sampling_defaults("none", folder) == SamplingDefaults()
    assert sampling_defaults(str(folder), None).top_k == 20
    with pytest.raises(ValueError, match="not auto, none or a folder"):
        sampling_defaults(str(tmp_path / "missing"), None)
