"""The draft model (--draft-model): loaded beside the model on its device and in its dtype, and
refused at start where it could not propose for it."""

from __future__ import annotations

import logging

from executor_service.attention.kv_cache import KVCacheShape
from executor_service.model.model_loader import LoadedModel, dtype_name, load_model
from executor_service.model.model_support import UnsupportedModel
from executor_service.serving.settings import ExecutorSettings

logger = logging.getLogger(__name__)


def load_draft_model(settings: ExecutorSettings, model: LoadedModel) -> LoadedModel:
    """The draft model for this model, or UnsupportedModel saying why it cannot be one."""
    assert settings.draft_model_dir is not None
    if settings.tensor_parallel_size > 1:
        raise UnsupportedModel(model.model_type, "--draft-model under tensor parallelism is not supported yet")
    if model.recurrent is not None:
        raise UnsupportedModel(
            model.model_type, "--draft-model for a model with recurrent layers, whose state cannot go back past a rejected draft"
        )
    draft = load_model(
        settings.draft_model_dir, str(model.device), dtype_name(model.dtype), settings.max_model_len, settings.trust_remote_code
    )
    problem = _draft_problem(draft, model)
    if problem is not None:
        raise UnsupportedModel(draft.model_type, f"as --draft-model: {problem}")
    logger.info(
        "event=draft_model model=%s layers=%d attention_layers=%d", draft.model_id, draft.num_layers, len(draft.attention_layers)
    )
    return draft


def _draft_problem(draft: LoadedModel, model: LoadedModel) -> str | None:
    if draft.vocab_size != model.vocab_size:
        return f"its vocabulary of {draft.vocab_size} tokens is not the model's {model.vocab_size}: its token ids would mean other tokens"
    if draft.recurrent is not None:
        return "it has recurrent layers, whose state cannot go back past a rejected draft"
    if draft.sequence_rope:
        return "its rotary frequencies depend on each sequence's length, which draft steps do not carry"
    if not draft.attention_layers:
        return "it has no attention layers"
    if draft.max_model_len < model.max_model_len:
        return (
            f"it reaches {draft.max_model_len} positions, fewer than the model's {model.max_model_len}: "
            "lower --max-model-len to its length"
        )
    return None


def draft_cache_shape(draft: LoadedModel, block_size: int) -> KVCacheShape:
    return KVCacheShape(
        num_layers=len(draft.attention_layers),
        num_kv_heads=draft.num_kv_heads,
        key_dim=draft.key_dim,
        value_dim=draft.value_dim,
        block_size=block_size,
        dtype=draft.dtype,
    )


def share_blocks(num_blocks: int, shape: KVCacheShape, draft_shape: KVCacheShape) -> int:
    """Blocks for both caches out of the memory decided for the model's alone: a block id holds
    K/V in each, so each block costs both."""
    model_bytes, draft_bytes = shape.bytes_per_block(), draft_shape.bytes_per_block()
    return max(1, num_blocks * model_bytes // (model_bytes + draft_bytes))
