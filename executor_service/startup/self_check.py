"""Start-up self-check: the paged path must reproduce the model's own forward before we serve.

The reference is taken first, from the model as transformers built it: its own modules, torch's
linear layers and head, and its own eager attention, over each whole sequence with no cache
(self_check_reference, called before the executor fuses and packs anything). Then two sequences
go through the real step machinery (input building, the fused and packed layers, paged attention,
the head as the executor runs it) over the real KV cache: one prefilled at once, one prefilled in
two chunks beside the first one's decode, then a few decodes of both (run_self_check). A fused
layer, a packed GEMM or an attention kernel that computes the wrong thing fails it, and a model
that passes has run every kind of step the scheduler will send.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.attention.kv_cache import PagedKVCache
from executor_service.attention.paged_attention import ATTENTION_NAME
from executor_service.model.model_loader import LoadedModel
from executor_service.model.model_support import UnsupportedModel
from executor_service.runner.forward import accepts_logits_to_keep, compute_logits
from executor_service.runner.plan_inputs import ScheduledWork, build_step_inputs
from executor_service.runner.request_rows import RequestRows, RequestState
from executor_service.sampling.sampler_settings import SamplerSettings

logger = logging.getLogger(__name__)

# Largest accepted logit error, relative to the row's largest reference logit, by compute dtype.
# float32 kernels agree to ~1e-6 of that; half precision rounds every layer's activations, so
# its bound is looser. A wrong attention path (a missed mask, K/V read from the wrong slots, a
# dropped soft-cap) moves logits by a good fraction of their range.
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
# In half precision rounding noise grows with depth, and in a model whose layers amplify it (a
# deep random one: 30 SmolLM2-sized layers in bfloat16) it passes any fixed bound; there
# transformers' own eager and SDPA attention differ by 40 % of the largest logit. So the bound is
# also this many times what those two differ by on the same sequences: the paged path must agree
# with the model's forward about as well as its own two attention implementations agree.
NOISE_FLOOR_FACTOR = 2.0
DECODE_STEPS = 3
_SEED = 20261130


@dataclass(slots=True)
class _Sequence:
    name: str
    # Every token the check feeds, prompt first: decode inputs are fixed, not sampled, so the
    # comparison does not depend on near-ties.
    token_ids: list[int]
    prompt_len: int
    state: RequestState
    # Positions whose logits the paged path produced, and those logits.
    positions: list[int]
    logits: list[torch.Tensor]


def check_tokens(vocab_size: int, count: int) -> list[int]:
    """The token ids the check feeds (deterministic, so a test can steer clear of them)."""
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (count,), generator=generator).tolist()


def sequence_lengths(
    block_size: int, num_blocks: int, max_len: int, window: int | None
) -> tuple[int, int]:
    """Prompt lengths of the two sequences: past a block boundary, past a short sliding window
    when the model has one, within the cache and the model's length (at least 2 tokens each,
    so one can be chunked)."""
    per_sequence = max(2, min((num_blocks // 2) * block_size, max_len) - DECODE_STEPS - 1)
    longest = 3 * block_size + 5
    if window is not None and window < 1024:
        longest = max(longest, window + block_size + 5)
    return min(2 * block_size + 3, per_sequence), min(longest, per_sequence)


@dataclass(slots=True)
class SelfCheckReference:
    """The two sequences the check feeds and the logits the model as loaded gives for them."""

    # Every token each sequence is fed, prompt first, and its prompt's length.
    token_ids: tuple[list[int], list[int]]
    prompt_lens: tuple[int, int]
    # [len(token_ids[i]), vocab] from the model's own eager attention, one per sequence.
    logits: tuple[torch.Tensor, torch.Tensor]
    # How far the model's own SDPA attention is from its eager one on these sequences (0 in
    # float32, where the fixed bound stands alone).
    noise_floor: float


def self_check_reference(loaded: LoadedModel, block_size: int, num_blocks: int) -> SelfCheckReference:
    """The check's sequences and their reference logits, from the model before anything of it is
    replaced; raises UnsupportedModel when the cache is too small or the forward cannot run."""
    model_type = loaded.model_type
    window = getattr(loaded.model.config.get_text_config(), "sliding_window", None)
    len_a, len_b = sequence_lengths(block_size, num_blocks, loaded.max_model_len, window)
    # Every token each sequence is fed: each sample appends the next one, and the first
    # sequence samples once more than the second.
    total_a, total_b = len_a + DECODE_STEPS + 1, len_b + DECODE_STEPS
    if -(-total_a // block_size) + -(-total_b // block_size) > num_blocks:
        raise UnsupportedModel(model_type, f"a KV cache of {num_blocks} blocks is too small to check it in")
    tokens = check_tokens(loaded.vocab_size, total_a + total_b)
    sequences = (tokens[:total_a], tokens[total_a:])
    try:
        # Over exactly the tokens the paged path is fed: a length-dependent rope type (longrope,
        # dynamic) picks its frequencies from a forward's last position.
        eager = (_reference_logits(loaded, sequences[0], "eager"), _reference_logits(loaded, sequences[1], "eager"))
    except UnsupportedModel:
        raise
    except Exception as error:
        raise UnsupportedModel(model_type, f"the model's own forward raised {error!r}") from error
    floor = 0.0 if loaded.dtype == torch.float32 else _noise_floor(loaded, sequences, (len_a, len_b), eager)
    if loaded.recurrent is not None:
        floor = max(floor, _incremental_floor(loaded, sequences[1], len_b, eager[1]))
    return SelfCheckReference(sequences, (len_a, len_b), eager, floor)


def run_self_check(
    loaded: LoadedModel, kv_cache: PagedKVCache, backend: str, reference: SelfCheckReference
) -> float:
    """Returns the worst relative logit error; raises UnsupportedModel when the model fails."""
    model_type = loaded.model_type
    block_size = kv_cache.block_size
    (tokens_a, tokens_b), (len_a, len_b) = reference.token_ids, reference.prompt_lens
    blocks_a = -(-len(tokens_a) // block_size)
    blocks_b = -(-len(tokens_b) // block_size)
    rows = RequestRows(loaded.vocab_size, loaded.device)
    # A model with recurrent layers keeps each sequence's state in a slot of its own.
    slots = (1, 2) if loaded.recurrent is not None else (0, 0)
    a = _sequence(rows, "a", tokens_a, len_a, list(range(blocks_a)), slots[0])
    b = _sequence(rows, "b", tokens_b, len_b, list(range(blocks_a, blocks_a + blocks_b)), slots[1])
    half = len_b // 2
    steps = [[(a, len_a), (b, half)], [(a, 1), (b, len_b - half)]]
    steps += [[(a, 1), (b, 1)] for _ in range(DECODE_STEPS - 1)]
    try:
        for step in steps:
            _paged_step(loaded, kv_cache, backend, step)
        worst = max(_worst_error(seq, logits) for seq, logits in zip((a, b), reference.logits, strict=True))
    except UnsupportedModel:
        raise
    except Exception as error:
        raise UnsupportedModel(model_type, f"the paged forward raised {error!r}") from error
    floor = reference.noise_floor
    tolerance = max(RELATIVE_TOLERANCE[loaded.dtype], NOISE_FLOOR_FACTOR * floor)
    if worst > tolerance:
        raise UnsupportedModel(
            model_type,
            f"the executor's forward (fused layers, packed GEMMs, paged attention) does not reproduce "
            f"the model's own forward: relative logit "
            f"error {worst:.3g} exceeds {tolerance:.3g}",
        )
    logger.info(
        "event=self_check_passed model_type=%s max_relative_error=%.3g tolerance=%.3g noise_floor=%.3g",
        model_type,
        worst,
        tolerance,
        floor,
    )
    return worst


def _sequence(
    rows: RequestRows, name: str, token_ids: list[int], prompt_len: int, block_ids: list[int], state_slot: int
) -> _Sequence:
    state = rows.admit(
        request_id=f"self-check-{name}",
        token_ids=token_ids[:prompt_len],
        num_prompt_tokens=prompt_len,
        block_ids=block_ids,
        num_computed_tokens=0,
        # Reads every logit, so a ScreenedHead (greedy_head.py) computes them all.
        sampling=SamplerSettings(want_logprobs=True),
        state_slot=state_slot,
    )
    return _Sequence(name, token_ids, prompt_len, state, [], [])


def _paged_step(
    loaded: LoadedModel,
    kv_cache: PagedKVCache,
    backend: str,
    step: list[tuple[_Sequence, int]],
) -> None:
    work = [ScheduledWork(seq.state, count) for seq, count in step]
    inputs = build_step_inputs(work, kv_cache, backend, loaded.device, loaded.sequence_rope, loaded.recurrent is not None)
    logits = compute_logits(loaded, inputs, accepts_logits_to_keep(loaded))
    sampled = {id(state): row for state, row in zip(inputs.sampled, logits, strict=True)}
    for seq, count in step:
        state = seq.state
        state.rows.advance(state, count)
        if id(state) in sampled:
            seq.positions.append(state.num_tokens - 1)
            seq.logits.append(sampled[id(state)].float())
            # Teacher forcing: the next input is the check's own token, not a sample.
            next_token = seq.token_ids[state.num_tokens]
            state.rows.append_tokens(np.array([state.row]), [next_token])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The worst row's largest |got - expected|, over that row's largest |expected|."""
    scale = expected.abs().amax(-1).clamp_min(1e-6)
    return float(((got - expected).abs().amax(-1) / scale).max())


def _worst_error(seq: _Sequence, reference: torch.Tensor) -> float:
    return _relative_error(torch.stack(seq.logits), reference[seq.positions])


def _noise_floor(
    loaded: LoadedModel,
    sequences: tuple[list[int], list[int]],
    prompt_lens: tuple[int, int],
    eager: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """How far the model's SDPA attention is from its eager attention from each sequence's last
    prompt token on (where the paged path's logits are compared); 0 for a model without SDPA
    attention (the fixed bound then stands alone)."""
    try:
        sdpa = [_reference_logits(loaded, token_ids, "sdpa") for token_ids in sequences]
    except (UnsupportedModel, ValueError) as error:
        logger.info("event=self_check_floor available=false reason=%r", str(error))
        return 0.0
    return max(
        _relative_error(other[start - 1 :], own[start - 1 :])
        for other, own, start in zip(sdpa, eager, prompt_lens, strict=True)
    )


@torch.inference_mode()
def _incremental_floor(loaded: LoadedModel, token_ids: list[int], prompt_len: int, whole: torch.Tensor) -> float:
    """How far the model's own cached path (its prompt at once, then one token at a time, as
    generate runs it) is from its forward over the whole sequence. A recurrent layer has two
    forms, a chunked scan and a one-step update, that transformers' code does not always keep
    equal (Nemotron-H's Mamba-2 differs by ~1e-2 of the largest logit on a random model); the
    executor runs both forms too, so it is held to what the model's own two agree to."""
    model = loaded.model
    model.set_attn_implementation("eager")
    try:
        device = loaded.device
        # Positions given, as generate gives them: a hybrid cache's length is not always its
        # first layer's.
        out = model(
            input_ids=torch.tensor([token_ids[:prompt_len]], device=device),
            position_ids=torch.arange(prompt_len, device=device)[None, :],
            use_cache=True,
        )
        rows = [out.logits[0, -1].float()]
        for position in range(prompt_len, len(token_ids)):
            out = model(
                input_ids=torch.tensor([[token_ids[position]]], device=device),
                position_ids=torch.tensor([[position]], device=device),
                cache=out.past_key_values,
                use_cache=True,
            )
            rows.append(out.logits[0, -1].float())
    except Exception as error:
        logger.info("event=self_check_floor available=false reason=%r", repr(error))
        return 0.0
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return _relative_error(torch.stack(rows), whole[prompt_len - 1 :])


@torch.inference_mode()
def _reference_logits(loaded: LoadedModel, token_ids: list[int], attention: str) -> torch.Tensor:
    """[len(token_ids), vocab] from one of the model's own attention implementations (eager or
    sdpa) over the whole sequence."""
    model = loaded.model
    model.set_attn_implementation(attention)
    try:
        if model.config._attn_implementation != attention:
            raise UnsupportedModel(
                loaded.model_type,
                "its attention does not go through transformers' AttentionInterface",
            )
        input_ids = torch.tensor([token_ids], device=loaded.device)
        return model(input_ids=input_ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
