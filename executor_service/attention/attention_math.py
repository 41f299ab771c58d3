"""Attention written out, for layers SDPA cannot express: logit soft-capping and attention sinks.

It follows transformers' eager attention (scores in the compute dtype, softmax in float32), so a
model that uses these features computes what its own eager forward computes.
"""

from __future__ import annotations

import torch


def explicit_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """queries [..., heads, rows, dim] over keys [..., kv_heads, context, dim] and values
    [..., kv_heads, context, value_dim] -> [..., heads, rows, value_dim].

    Query heads sharing a KV head are consecutive (transformers' repeat_kv order), so they are
    grouped under it rather than K/V being repeated. `mask` (True = attend) broadcasts against
    [..., kv_heads, group, rows, context]; None means causal with queries and keys both starting
    at position 0. `sinks` holds one logit per query head that joins the softmax and is dropped.
    """
    heads, kv_heads = queries.shape[-3], keys.shape[-3]
    group = heads // kv_heads
    grouped = queries.unflatten(-3, (kv_heads, group))
    scores = torch.matmul(grouped, keys.unsqueeze(-3).transpose(-1, -2))
    scores = scores * (scale if scale is not None else queries.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        rows, context = scores.shape[-2:]
        mask = torch.ones(rows, context, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_logits = sinks.to(scores.dtype).view(kv_heads, group, 1, 1)
        sink_column = sink_logits.expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1, dtype=torch.float32)
        weights = weights[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    attended = torch.matmul(weights.to(values.dtype), values.unsqueeze(-3))
    return attended.flatten(-4, -3)
