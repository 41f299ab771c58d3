"""Executor settings as parsed from the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from executor_service.serving.access import ExecutorAccess
from service_support.transport_security import ClientTls, ServerTls

# On CPU there is nothing to profile: the KV budget is a configured size, and 1 GiB holds ~23k
# tokens of the default 135M model without crowding a laptop.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_LOGPROBS = 20
# Share of total accelerator memory the process may fill (weights, activations and KV together).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Tokens of the profiling forward on CUDA: the activation peak of a step this large is reserved.
DEFAULT_PROFILE_TOKENS = 2048
# Long enough that a live scheduler (which sends an empty plan every third of it while idle)
# never loses its hold; short enough that one that vanished without its stream ending (a
# partition) frees the executor for another within a minute.
DEFAULT_LEASE_TIMEOUT_S = 30.0
# Largest decode batch replayed from a CUDA graph (decode_graphs.py); vLLM's default is larger
# (512), but past a few hundred rows a decode step is arithmetic, not launches, and every graph
# is captured at start-up.
DEFAULT_CUDA_GRAPH_MAX_BATCH = 256
# Seconds the holder's stream gets after SIGTERM to finish its requests and end: under
# Kubernetes' default 30 s termination grace, with room to stop after it.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
# ExecutorInfo.role: which part of requests the scheduler plans on an executor.
ROLES = ("prefill", "decode", "both")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


@dataclass(slots=True, frozen=True)
class ExecutorSettings:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # Recurrent-state slots for a model with recurrent layers (state_budget.py); None: decided
    # from the memory budget.
    state_slots: int | None = None
    max_model_len: int | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    threads: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    profile_tokens: int = DEFAULT_PROFILE_TOKENS
    trust_remote_code: bool = False
    # "auto", "sdpa" or "flash_attn".
    attention_backend: str = "auto"
    # Seconds without a plan after which the holding scheduler's hold lapses.
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    # Linear layers with packed weights where the device and dtype allow it.
    packed_linear: bool = True
    # Packed through the C panel kernel (panel_linear.py) where the CPU has AVX-512; oneDNN if not.
    panel_linear: bool = True
    # Linear layers multiplied on AMX's bf16 tiles (panel_amx.c) where the CPU has them: faster, but
    # not the float path's bits (the same on every AVX-512 CPU), hence opt-in.
    amx: bool = False
    # Weights made of 4-bit blocks (a dequantized GGUF Q4_1 checkpoint, the default SmolLM2's)
    # read as those blocks by the panel kernel: the same bits from under a fifth of the traffic.
    weight_blocks: bool = True
    # Pure decode steps of up to this many rows replay CUDA graphs (CUDA, one rank); 0: never.
    cuda_graph_max_batch: int = DEFAULT_CUDA_GRAPH_MAX_BATCH
    # Greedy rows' lm_head through the int8 screen (greedy_head.py), where the head is on the
    # panel kernel's float path: the same token as that head, at about half its cost.
    greedy_screen: bool = True
    # A small model of the same tokenizer that proposes drafts for speculative decoding
    # (ContinuingRequest.num_model_drafts), with a K/V cache of its own; None: none.
    draft_model_dir: Path | None = None
    # TLS (mutual with a client CA) on the executor API; None serves plaintext.
    tls: ServerTls | None = None
    # How this executor calls other executors to fetch K/V (kv_fetch.peer_tls of tls and the
    # --tls-peer-* flags); None: plaintext, as it serves.
    peer_tls: ClientTls | None = None
    # Plaintext grpc.health.v1-only port for probes.
    health_port: int | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Prometheus metrics over HTTP on this port (off when None).
    metrics_port: int | None = None
    # text or json (service_support/log_format.py).
    log_format: str = "text"
    # Ranks the model is sharded over (tp_group.py); 1 runs it on one device.
    tensor_parallel_size: int = 1
    # A start-up refusal logs its traceback too (-v).
    verbose: bool = False
    # Who may call the Executor API; the command line always decides it (None only for
    # executors built in process, which serve nobody).
    access: ExecutorAccess | None = None
    # ExecutorInfo.role, for the scheduler; nothing else here depends on it.
    role: str = "both"
    # GiB of host memory for the host tier of K/V blocks (host_tier.py); 0: no tier.
    kv_host_gib: float = 0.0


def parse_size(text: str) -> int:
    """Bytes in a size such as '512MiB', '2GB' or '1048576'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
