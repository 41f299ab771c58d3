"""Builds a ready ModelRunner and the ExecutorInfo it is described by, from settings."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import torch

from executor_service.attention.host_tier import HostBlocks
from executor_service.attention.kv_cache import KVCacheShape, PagedKVCache
from executor_service.attention.paged_attention import select_backend
from executor_service.cpu_forward.fused_layers import fuse_layers
from executor_service.cpu_forward.greedy_head import (
    install_greedy_screen,
    screenable_head,
)
from executor_service.cpu_forward.kernel_activations import install_kernel_activations
from executor_service.cpu_forward.lean_forward import lean_llama
from executor_service.cpu_forward.packed_experts import pack_experts
from executor_service.cpu_forward.packed_linear import pack_linears, packing_available
from executor_service.cpu_forward.packed_routers import pack_routers
from executor_service.kernels.argmax_kernel import RowArgmax, load_row_argmax
from executor_service.kernels.cpu_kernels import KernelUnavailable
from executor_service.kernels.layer_kernels import LayerKernels, load_layer_kernels
from executor_service.kernels.panel_linear import PanelKernel, load_panel_kernel
from executor_service.kernels.row_kernels import RowKernels, load_row_kernels
from executor_service.model.model_loader import LoadedModel, dtype_name, load_model
from executor_service.model.model_support import UnsupportedModel
from executor_service.parallel.tp_group import agree_on_min
from executor_service.parallel.tp_steps import rank0_tokens
from executor_service.recurrent.slot_mixers import RecurrentLayers
from executor_service.recurrent.state_slots import StateSlots
from executor_service.recurrent.state_transfer import state_layout_name
from executor_service.runner.decode_graphs import (
    CudaGraphRecorder,
    DecodeGraphs,
    decode_graphs_on,
)
from executor_service.runner.draft_model import DraftModel
from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.validation import Limits
from executor_service.serving.settings import ExecutorSettings
from executor_service.startup.draft_loading import (
    draft_cache_shape,
    load_draft_model,
    share_blocks,
)
from executor_service.startup.host_budget import decide_host_blocks
from executor_service.startup.kv_budget import decide_num_blocks
from executor_service.startup.self_check import (
    SelfCheckReference,
    run_self_check,
    self_check_reference,
)
from executor_service.startup.state_budget import decide_num_slots, memory_budget
from protos.limits import MAX_MESSAGE_BYTES
from protos.splitserve.executor.v1 import executor_pb2

logger = logging.getLogger(__name__)

# What a KvBlockChunk needs beside the state it carries (its layout string, field headers).
STATE_MESSAGE_ROOM = 64 << 10


@dataclass(slots=True)
class ReadyExecutor:
    """A model runner that passed its start-up checks, and the ExecutorInfo that describes it."""

    runner: ModelRunner
    info: executor_pb2.ExecutorInfo


def _layer_kernels() -> LayerKernels | None:
    """The C elementwise passes, or None (torch's operations) where they cannot be built; the
    event=layers_fused line says which, and under --attention-backend auto the backend's choice
    logs why."""
    try:
        return load_layer_kernels()
    except KernelUnavailable:
        return None


def _panel_kernel(amx: bool, weight_blocks: bool) -> PanelKernel | None:
    """The C panel linear kernel, AMX on where wanted and available, reading weights made of
    4-bit blocks as such where weight_blocks, or None (oneDNN) where it cannot be had, which an
    event=panel_linear line says with the reason; event=linears_packed names the backend,
    whether AMX is on and how many weights are read as blocks."""
    try:
        panels = load_panel_kernel()
    except KernelUnavailable as error:
        logger.info("event=panel_linear enabled=false reason=%r", str(error))
        return None
    panels.use_amx(amx)
    return panels if weight_blocks else panels.without_blocks()


def _row_argmax(device: torch.device) -> RowArgmax | None:
    """The C argmax for greedy rows on CPU; None (torch's) on other devices, or where it cannot
    be built, which an event=greedy_argmax line says with the reason."""
    if device.type != "cpu":
        return None
    try:
        return load_row_argmax()
    except KernelUnavailable as error:
        logger.info("event=greedy_argmax impl=torch reason=%r", str(error))
        return None


def _row_kernels() -> RowKernels | None:
    """A steady decode step's gather and write-back in C, or None (numpy's operations) where
    they cannot be built, which an event=row_kernels line says with the reason."""
    try:
        return load_row_kernels()
    except KernelUnavailable as error:
        logger.info("event=row_kernels impl=numpy reason=%r", str(error))
        return None


def _self_check(loaded: LoadedModel, kv_cache: PagedKVCache, backend: str, reference: SelfCheckReference) -> None:
    """The self-check; for a model with recurrent layers whose multi-token form ignores the state
    it is handed (transformers' Mamba-1 scan), a chunk that continues a sequence is then run one
    token at a time, and the check must pass that way."""
    try:
        run_self_check(loaded, kv_cache, backend, reference)
    except UnsupportedModel as error:
        recurrent = loaded.recurrent
        if recurrent is None or recurrent.one_token_continuations:
            raise
        recurrent.one_token_continuations = True
        run_self_check(loaded, kv_cache, backend, reference)
        logger.info("event=recurrent_continuations mode=one_token reason=%r", error.reason)


def _moves_kv(shape: KVCacheShape, recurrent: RecurrentLayers | None, parallel: bool) -> bool:
    """Whether a request's K/V (and recurrent state) can move to or from this executor. Not for
    one sharded over ranks, each of which holds only its own heads' K/V. A model with recurrent
    layers moves its state slot with the blocks: every state it keeps is in its slots, since a
    model with a layer that keeps state outside transformers' cache interface is refused at load;
    but the state travels in one message, so a slot too large for one is not moved."""
    if parallel or (shape.num_layers == 0 and recurrent is None):
        return False
    if recurrent is not None and recurrent.layout.bytes_per_slot() > MAX_MESSAGE_BYTES - STATE_MESSAGE_ROOM:
        logger.info(
            "event=kv_transfer enabled=false reason='a state slot of %d bytes exceeds one message of %d'",
            recurrent.layout.bytes_per_slot(), MAX_MESSAGE_BYTES,
        )
        return False
    return True


def build_executor(settings: ExecutorSettings, device: str | None = None) -> ReadyExecutor:
    """device: this rank's device under tensor parallelism (every rank calls this together,
    in the initialized group); settings.device otherwise."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    parallel = settings.tensor_parallel_size > 1
    loaded = load_model(
        settings.model_dir,
        device or settings.device,
        settings.dtype,
        settings.max_model_len,
        settings.trust_remote_code,
        settings.tensor_parallel_size,
    )
    backend = select_backend(loaded.device, loaded.dtype, settings.attention_backend)
    shape = KVCacheShape(
        num_layers=len(loaded.attention_layers),
        num_kv_heads=loaded.num_kv_heads,
        key_dim=loaded.key_dim,
        value_dim=loaded.value_dim,
        block_size=settings.block_size,
        dtype=loaded.dtype,
    )
    recurrent = loaded.recurrent
    num_slots = 0
    if recurrent is not None and parallel:
        raise UnsupportedModel(
            loaded.model_type,
            "its recurrent layers are not sharded over tensor-parallel ranks yet; run it with --tensor-parallel-size 1",
        )
    # Before the long parts of the start (profiling, packing, the self-check).
    num_host_blocks = decide_host_blocks(settings.kv_host_gib, loaded.model_type, recurrent is not None, shape)
    if recurrent is not None:
        slot_bytes = recurrent.layout.bytes_per_slot()
        num_slots = decide_num_slots(loaded.model_type, slot_bytes, settings, memory_budget(settings, loaded.device))
        if parallel:
            num_slots = agree_on_min(num_slots)
        recurrent.states = StateSlots(recurrent.layout, num_slots, loaded.device)
    # Before the budget, so that a GPU's free memory is what the draft model's weights leave.
    draft = load_draft_model(settings, loaded) if settings.draft_model_dir is not None else None
    num_blocks = decide_num_blocks(loaded, shape, settings, backend, num_slots)
    if draft is not None and settings.num_kv_blocks is None:
        num_blocks = share_blocks(num_blocks, shape, draft_cache_shape(draft, settings.block_size))
    if parallel:
        num_blocks = agree_on_min(num_blocks)
    # Taken before fusing and packing, so that the self-check holds everything this executor
    # replaces of the model, the head included, to transformers' own modules and torch's GEMM.
    reference = self_check_reference(loaded, settings.block_size, num_blocks)
    # Packing replaces the linear layers, which under TP hold sharded weights and collectives.
    if settings.packed_linear and not parallel and packing_available(loaded.device, loaded.dtype):
        _pack(loaded, settings)
        if draft is not None:
            _pack(draft, settings)
    kv_cache = PagedKVCache(shape, num_blocks, loaded.device, loaded.attention_layers)
    _self_check(loaded, kv_cache, backend, reference)
    host = HostBlocks(kv_cache, num_host_blocks) if num_host_blocks else None
    # A request longer than the whole cache could never be scheduled, so the cache bounds it too.
    limits_len = [loaded.max_model_len, num_blocks * settings.block_size]
    limits = Limits(
        vocab_size=loaded.vocab_size,
        num_kv_blocks=num_blocks,
        block_size=settings.block_size,
        max_model_len=min(limits_len),
        max_logprobs=min(settings.max_logprobs, loaded.vocab_size),
        num_state_slots=num_slots,
        num_host_blocks=num_host_blocks,
        draft_model=draft is not None,
    )
    moves_kv = _moves_kv(shape, recurrent, parallel)
    kv_layout = shape.layout() + (f" {state_layout_name(recurrent.layout)}" if recurrent else "")
    info = executor_pb2.ExecutorInfo(
        model_id=loaded.model_id,
        vocab_size=loaded.vocab_size,
        eos_token_ids=loaded.eos_token_ids,
        max_model_len=limits.max_model_len,
        block_size=settings.block_size,
        num_kv_blocks=num_blocks,
        dtype=dtype_name(loaded.dtype),
        device=str(loaded.device),
        incarnation_id=uuid.uuid4().hex,
        max_logprobs=limits.max_logprobs,
        attention_backend=backend,
        lease_timeout_s=settings.lease_timeout_s,
        supports_decode_handles=True,
        supports_late_bitmasks=True,
        # A fork would need its source's recurrent state too, which no block copy carries.
        supports_block_copies=recurrent is None,
        tensor_parallel_size=settings.tensor_parallel_size,
        kv_cache_bytes=num_blocks * shape.bytes_per_block() * settings.tensor_parallel_size,
        num_state_slots=num_slots,
        state_slot_bytes=recurrent.layout.bytes_per_slot() if recurrent else 0,
        supports_state_checkpoints=recurrent is not None,
        supports_kv_transfer=moves_kv,
        kv_layout=kv_layout if moves_kv else "",
        role=settings.role,
        num_host_blocks=num_host_blocks,
        # Verifying drafts computes positions past the last one kept, which K/V in blocks
        # tolerates (the next step overwrites it) but a recurrent layer's state cannot go back
        # from. Under tensor parallelism every rank verifies from rank 0's tokens.
        supports_draft_tokens=recurrent is None,
        draft_model=draft.model_id if draft is not None else "",
    )
    graphs = None
    if recurrent is not None and loaded.device.type == "cuda":
        # A graph replays one batch's gathers; recurrent mixers take their steps split by sequence.
        logger.info("event=decode_graphs enabled=false reason='the model has recurrent layers'")
    elif loaded.sequence_rope and loaded.device.type == "cuda":
        # A captured graph replays one rotary table; these models pick theirs per sequence.
        logger.info("event=decode_graphs enabled=false reason='rotary frequencies depend on each sequence length'")
    elif decode_graphs_on(loaded.device, settings.cuda_graph_max_batch, settings.tensor_parallel_size):
        recorder = CudaGraphRecorder(loaded.device)
        graphs = DecodeGraphs(loaded, kv_cache, settings.cuda_graph_max_batch, limits.max_model_len, recorder)
        logger.info(
            "event=decode_graphs batch_sizes=%s widths=%s",
            ",".join(map(str, graphs.batch_sizes)),
            ",".join(map(str, graphs.widths)),
        )
        graphs.capture_all()
    runner = ModelRunner(
        loaded,
        kv_cache,
        limits,
        backend,
        rank0_tokens if parallel else None,
        _row_argmax(loaded.device),
        graphs,
        _row_kernels(),
        host,
        _draft_runner(draft, settings.block_size, num_blocks, backend),
    )
    return ReadyExecutor(runner=runner, info=info)


def _pack(loaded: LoadedModel, settings: ExecutorSettings) -> None:
    """The model's layers fused and its linears packed for the CPU kernels, and its forward the
    lean one where every layer is fused."""
    recurrent = loaded.recurrent
    panels = _panel_kernel(settings.amx, settings.weight_blocks) if settings.panel_linear else None
    kernels = _layer_kernels()
    fuse_layers(loaded.model, kernels, panels)
    if kernels is not None:
        install_kernel_activations(loaded.model, kernels)
    head = screenable_head(loaded.model) if settings.greedy_screen else None
    pack_routers(loaded.model, panels)
    pack_experts(loaded.model, panels)
    pack_linears(loaded.model, panels, keep=recurrent.weights_read() if recurrent else frozenset())
    if head is not None:
        install_greedy_screen(loaded.model, head.weight)
    loaded.lean = lean_llama(loaded.model)
    logger.info("event=forward model=%s impl=%s", loaded.model_id, "lean" if loaded.lean is not None else "transformers")


def _draft_runner(draft: LoadedModel | None, block_size: int, num_blocks: int, backend: str) -> DraftModel | None:
    if draft is None:
        return None
    cache = PagedKVCache(draft_cache_shape(draft, block_size), num_blocks, draft.device, draft.attention_layers)
    return DraftModel(draft, cache, backend)
