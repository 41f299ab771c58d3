"""One forward pass of the flattened step, with logits only at the positions that are sampled."""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch

from executor_service.attention.paged_attention import STEP_KWARG, active_step
from executor_service.cpu_forward.greedy_head import ScreenedHead
from executor_service.model.model_loader import LoadedModel
from executor_service.model.sequence_rope import sequence_lengths
from executor_service.recurrent.recurrent_step import active_recurrent
from executor_service.runner.plan_inputs import StepInputs


def accepts_logits_to_keep(loaded: LoadedModel) -> bool:
    return "logits_to_keep" in inspect.signature(loaded.model.forward).parameters


@torch.inference_mode()
def compute_logits(
    loaded: LoadedModel, inputs: StepInputs, use_logits_to_keep: bool
) -> torch.Tensor:
    """[sampled rows, vocab] logits; [0, vocab] when the step samples nothing.

    Logits always come from the model's own head, so model-specific scaling or final-logit
    soft-capping stays intact; a model without logits_to_keep pays for the head over every token.
    Where the head is a ScreenedHead (greedy_head.py), the rows of requests that read only the
    argmax hold -inf outside the tokens that could be it.
    """
    if loaded.lean is not None:
        with active_step(inputs.attention), sequence_lengths(inputs.rope_lengths), _argmax_only_rows(loaded, inputs):
            return loaded.lean.logits(inputs.input_ids, inputs.position_ids, inputs.attention, inputs.logits_indices)[0]
    common = {
        "input_ids": inputs.input_ids,
        "position_ids": inputs.position_ids,
        "use_cache": False,
        STEP_KWARG: inputs.attention,
    }
    with active_step(inputs.attention), sequence_lengths(inputs.rope_lengths), active_recurrent(inputs.recurrent):
        if use_logits_to_keep:
            with _argmax_only_rows(loaded, inputs):
                return loaded.model(**common, logits_to_keep=inputs.logits_indices).logits[0]
        return loaded.model(**common).logits[0, inputs.logits_indices]


def _argmax_only_rows(loaded: LoadedModel, inputs: StepInputs) -> ScreenedHead | nullcontext[None]:
    head = loaded.model.get_output_embeddings()
    if not isinstance(head, ScreenedHead):
        return nullcontext()
    return head.argmax_only_rows(inputs.argmax_only)
