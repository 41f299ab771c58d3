"""Limits and policies of one scheduler: fixed at start, but for the knobs an operator may turn
while it runs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler_service.core.policy import Policy, StepMode

# Proposers of speculative decoding (core/speculation.py).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
# A decode batch from which steps carry no drafts: where a GPU's decode starts being compute-bound
# for a small model, a guess to tune per deployment (--speculative-max-batch).
DEFAULT_SPECULATIVE_MAX_BATCH = 16


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    # From the executor's Describe.
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    # Most requests holding KV blocks at once.
    max_num_seqs: int = 256
    # Most tokens computed in one step (decodes count one each).
    max_num_batched_tokens: int = 2048
    policy: Policy = Policy.FCFS
    mode: StepMode = StepMode.MIXED
    # Split prompts longer than the step's remaining budget across steps.
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Steady decodes travel by handle and are planned in bulk (see decode_set); off for an
    # executor that does not support it.
    bulk_decodes: bool = True
    # A constrained request's bitmask may follow its plan (StepPlan.bitmasks_for_step), so it
    # is pipelined like any other; off for an executor that does not take them, where it is
    # planned only once its last token is back.
    late_bitmasks: bool = False
    # The executor copies blocks for a plan (StepPlan.block_copies), so sibling choices fork
    # from one prompt computation; off for one that does not, where each computes its own.
    block_copies: bool = False
    # Recurrent-state slots of a hybrid model's executor (Mamba, Gated DeltaNet, short
    # convolutions): each running request holds one, so at most this many run at once; 0 for a
    # model without recurrent layers. A hybrid model runs without forks, and without a prefix
    # cache unless it keeps checkpoints (see __post_init__).
    num_state_slots: int = 0
    # A hybrid model's checkpoints: a request's recurrent state is kept every this many full
    # blocks of its tokens, in a slot no request holds, so that a prefix hit resumes from the
    # last one it covers (core/checkpoint_policy.py). 0: none kept. The lane takes
    # --state-checkpoint-blocks for an executor that supports_state_checkpoints, else 0.
    state_checkpoint_blocks: int = 0
    # Blocks of the executor's host tier (ExecutorInfo.num_host_blocks): preempted requests'
    # K/V is swapped there instead of being recomputed, and cached prefix blocks leaving the
    # device go there. 0: none.
    num_host_blocks: int = 0
    # Speculative decoding (core/speculation.py): who proposes drafts, the most drafts a request
    # gets in one step (0: none; the lane sets it only for an executor that
    # supports_draft_tokens), and the decode batch from which a step carries no drafts. Off for
    # a hybrid model (see __post_init__).
    speculative_method: str = "ngram"
    num_speculative_tokens: int = 0
    speculative_max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH

    @property
    def max_seq_len(self) -> int:
        """Most tokens one request may hold: the model's limit, or the whole KV cache if that is
        smaller (a request that outgrew the cache would preempt itself forever)."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "speculative_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative_method!r}")
        for name in ("num_state_slots", "state_checkpoint_blocks", "num_speculative_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.num_state_slots:
            # A prefix hit starts a request after its cached tokens, and a fork after its
            # sibling's prompt: both need the recurrent state at that point. A slot holds only a
            # running request's latest state, so a hit resumes only from a checkpoint, and
            # without checkpoints there is no prefix caching; a fork's point (its prompt's last
            # token but one) is rarely a checkpoint's, so there are no forks. Set here, whatever
            # the caller asked, so every way a config is built (the lane, a replay, a test,
            # reconfigure's replace) gets it.
            if not self.state_checkpoint_blocks:
                object.__setattr__(self, "enable_prefix_caching", False)
            object.__setattr__(self, "block_copies", False)
            # The recurrent state cannot be wound back past drafts the executor rejected.
            object.__setattr__(self, "num_speculative_tokens", 0)

    @property
    def state_checkpoint_tokens(self) -> int:
        """Tokens between a hybrid model's checkpoints; 0 when none are kept (no recurrent
        layers, no prefix cache, or state_checkpoint_blocks 0)."""
        if self.num_state_slots and self.enable_prefix_caching:
            return self.state_checkpoint_blocks * self.block_size
        return 0


@dataclass(slots=True, frozen=True)
class SchedulingKnobs:
    """What the Admin API changes on a running scheduler, effective from the next step."""

    policy: Policy
    mode: StepMode
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, config: SchedulerConfig) -> SchedulingKnobs:
        """The knobs a config runs under."""
        return cls(config.policy, config.mode, config.max_num_batched_tokens, config.max_num_seqs)

    def applied_to(self, config: SchedulerConfig) -> SchedulerConfig:
        return replace(
            config,
            policy=self.policy,
            mode=self.mode,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )
