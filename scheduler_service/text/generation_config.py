"""Sampling defaults from a model folder's generation_config.json, read as vLLM's
`--generation-config auto` reads it: only the fields the file itself sets (temperature, top_k,
top_p, min_p, repetition_penalty, max_new_tokens) replace the built-in defaults. transformers'
GenerationConfig is not used to read it, because it fills every absent field with its own
defaults (top_k 50, say), which would then pass for the model's choice.

`do_sample: false` is not read either, as in vLLM: a model that ships a temperature means it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from scheduler_service.core.sampling_params import SamplingDefaults

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingDefaults field, and the type the value must have.
FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


class GenerationConfigError(ValueError):
    """The file cannot give defaults a request could have; the message names it and why."""


def load_sampling_defaults(folder: Path) -> SamplingDefaults:
    """The folder's defaults; the built-in ones when it has no generation_config.json."""
    path = folder / FILE_NAME
    if not path.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GenerationConfigError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path} does not hold a JSON object")
    values: dict[str, float | int] = {}
    for key, (name, kind) in FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise GenerationConfigError(f"{path}: {key} must be a number{' (whole)' if kind is int else ''}, got {value!r}")
        if not math.isfinite(value):
            raise GenerationConfigError(f"{path}: {key} must be finite, got {value!r}")
        values[name] = kind(value)
    defaults = replace(SamplingDefaults(), **values, source=str(path))
    problems = defaults.problems()
    if problems:
        raise GenerationConfigError(f"{path}: " + "; ".join(problems))
    return defaults
