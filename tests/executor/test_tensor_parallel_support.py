"""Which models a tensor-parallel executor refuses, said before any rank loads a weight."""

from __future__ import annotations

import pytest

from executor_service.model.model_loader import check_tensor_parallel
from executor_service.model.model_support import UnsupportedModel
from tests.helpers.model_factory import build_config


@pytest.mark.parametrize("arch", ["gpt2", "stablelm", "gpt_bigcode"])
def test_architectures_without_a_plan_are_refused(arch: str) -> None:
    with pytest.raises(UnsupportedModel, match="no tensor-parallel plan"):
        check_tensor_parallel(arch, build_config(arch).get_text_config(), 2)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_architectures_with_a_plan_pass(arch: str) -> None:
    check_tensor_parallel(arch, build_config(arch).get_text_config(), 2)


def test_heads_that_do_not_split_evenly_are_refused() -> None:
    # 4 attention heads, 2 K/V heads: 4 ranks would leave half a K/V head each.
    with pytest.raises(UnsupportedModel, match="do not split evenly over --tensor-parallel-size 4"):
        check_tensor_parallel("llama", build_config("llama").get_text_config(), 4)
