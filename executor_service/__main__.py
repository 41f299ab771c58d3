"""Command line: python -m executor_service --model DIR [--port PORT] [options].

What a user can get wrong at start (the folder, the device, a port, a flag's value) is refused
in one line and exit status 2 before the model loads; -v adds the traceback."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import torch

from executor_service.attention.paged_attention import BACKENDS, BackendUnavailable
from executor_service.model.model_loader import check_model_folder
from executor_service.model.model_support import UnsupportedModel
from executor_service.parallel.tp_group import launched_by_torchrun
from executor_service.serving.access import ExecutorAccess
from executor_service.serving.kv_fetch import peer_tls
from executor_service.serving.server import ServeOptions, serve, step_thread
from executor_service.serving.settings import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CUDA_GRAPH_MAX_BATCH,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_MAX_LOGPROBS,
    ROLES,
    ExecutorSettings,
    parse_size,
)
from executor_service.startup.startup import build_executor
from executor_service.startup.tp_serve import serve_tensor_parallel
from protos.executor_access import DEFAULT_SCHEDULER_NAME, read_token_file
from service_support.cli_help import DefaultsHelpFormatter
from service_support.default_ports import DEFAULT_EXECUTOR_PORT
from service_support.flag_types import (
    fraction,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from service_support.health_port import add_health_port_flag
from service_support.local_folder import FolderError
from service_support.log_format import add_log_format_flag, configure_logging
from service_support.parent_death import end_with_parent
from service_support.port_check import PortUnavailable, check_listen_ports
from service_support.transport_security import (
    ClientTls,
    ServerTls,
    TlsConfigError,
    read_pem,
    server_tls,
)

logger = logging.getLogger("executor_service")


class DeviceUnavailable(ValueError):
    """--device names a device this machine does not have."""


def device_name(text: str) -> str:
    """A device torch can name (auto, cpu, cuda, cuda:N); whether this machine has it is checked
    at start, so that a GPU deployment's flags still parse on a machine without one."""
    if text != "auto":
        try:
            torch.device(text)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"not a device: {text!r} (auto, cpu, cuda or cuda:N)") from None
    return text


def kv_cache_size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 bytes, got {text!r}")
    return size


def parse_args(argv: list[str] | None, prog: str = "python -m executor_service") -> ExecutorSettings:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve the splitserve Executor API.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="local Hugging Face model folder (config.json and *.safetensors weights); nothing is "
        "downloaded: `splitserve prepare-model` prepares the default model and prints its folder",
    )
    parser.add_argument(
        "--port", type=port_number, default=DEFAULT_EXECUTOR_PORT, help="Executor API port; 0 picks a free one"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    parser.add_argument(
        "--device", type=device_name, default="auto", help="auto (cuda when torch sees a GPU), cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    parser.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="KV cache size in blocks (default: 1 GiB on CPU; on CUDA the free memory after a "
        "profiling pass)",
    )
    budget.add_argument(
        "--kv-cache-memory", type=kv_cache_size, default=None, help="KV cache size in bytes, e.g. 512MiB, 2GiB"
    )
    parser.add_argument(
        "--state-slots",
        type=positive_int,
        default=None,
        help="for a model with recurrent layers (Mamba, Gated DeltaNet, short convolutions): how many "
        "requests may hold recurrent state at once (default: up to 256, within half the memory budget)",
    )
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="cap below the model's own")
    parser.add_argument(
        "--max-logprobs", type=non_negative_int, default=DEFAULT_MAX_LOGPROBS, help="most top logprobs a request may ask for"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of GPU memory the executor may use, above 0 and at most 1",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", *BACKENDS],
        help="auto: flash_attn on CUDA in half precision when installed; cpu_paged (decode "
        "and prefill attention by C kernels built with the system's C compiler) on CPU in "
        "float32; else sdpa",
    )
    parser.add_argument(
        "--lease-timeout",
        type=positive_float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        help="seconds without a plan after which another scheduler may take this executor",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modelling code the model folder ships (config.json auto_map)",
    )
    parser.add_argument(
        "--no-packed-linear",
        dest="packed_linear",
        action="store_false",
        help="keep linear layers on torch's default GEMM instead of oneDNN with packed weights, "
        "and transformers' own layer code instead of fused Llama layers (CPU, float32)",
    )
    parser.add_argument(
        "--no-panel-linear",
        dest="panel_linear",
        action="store_false",
        help="pack linear layers for oneDNN instead of the C panel kernel (CPU, float32, AVX-512)",
    )
    parser.add_argument(
        "--amx",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="multiply linear layers on AMX's bf16 tiles where the CPU has them (1.2-1.9x the float "
        "path on 32-512 rows): float32 weights and inputs are split into three bf16 pieces each and "
        "six of the nine products kept (the three left out are under 2^-21 |x w| together, a small "
        "systematic shrink); 4-bit blocks are exact in bf16, so only the inputs are split. Either way "
        "the bits differ from the float path's, which are the same on every AVX-512 CPU, so a fleet "
        "mixing AMX and other hosts, or a request moved between them, no longer gets the same logits",
    )
    parser.add_argument(
        "--weight-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read weights whose every 32 inputs are d q + m (q in 0..15: a dequantized GGUF Q4_1 "
        "checkpoint, as the default SmolLM2's) as those 4-bit blocks, ~0.75 bytes a weight instead "
        "of 4, with the same bits (CPU, float32, panel kernel); --no-weight-blocks reads every "
        "weight as float32, as an ordinary checkpoint's, to measure what the blocks give",
    )
    parser.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        help="local model folder of a small model with the same vocabulary (e.g. `python -m "
        "executor_service.truncated_draft` of this one) that proposes draft tokens for the "
        "scheduler's --speculative-method draft; it keeps a K/V cache of its own beside the model's",
    )
    parser.add_argument(
        "--greedy-screen",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pick greedy rows' tokens through the int8 screen (CPU, float32, on the panel kernel's "
        "float path, where oneDNN's int8 linear is exact): the head's cost about halves, and the "
        "token is the float32 head's, bit for bit (the kept tokens' logits are computed as the "
        "packed head computes them); costs the head's int8 copy, a quarter of its float32 size",
    )
    parser.add_argument(
        "--cuda-graph-max-batch",
        type=non_negative_int,
        default=DEFAULT_CUDA_GRAPH_MAX_BATCH,
        help="replay pure decode steps of up to N sequences from CUDA graphs captured per batch "
        "and context bucket (CUDA, without tensor parallelism); 0 runs every step eagerly",
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate (chain) of this executor; serves TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        help="PEM CA: only schedulers presenting a certificate it signed, with a name among "
        "--allowed-scheduler-names, may connect (mutual TLS); the certificate's common name and the "
        "scheduler's claimed id together are then its identity",
    )
    parser.add_argument(
        "--tls-peer-cert",
        type=Path,
        help="PEM client certificate (chain) this executor presents to other executors when it "
        "fetches K/V from them (mutual TLS); it must allow clientAuth (deploy/make_certs.py's "
        "executor-peer.pem). Without it the server certificate is presented, which peers refuse "
        "when it allows serverAuth only, and every move is then recomputed",
    )
    parser.add_argument("--tls-peer-key", type=Path, help="PEM private key of --tls-peer-cert")
    parser.add_argument(
        "--tls-peer-server-name",
        metavar="NAME",
        help="name other executors' certificates carry, when it is not the address this one "
        "dials them by (executors found through dns:/// are dialled by IP)",
    )
    parser.add_argument(
        "--allowed-scheduler-names",
        default=DEFAULT_SCHEDULER_NAME,
        metavar="NAME[,NAME...]",
        help="under mutual TLS, the certificate common names that may drive this executor "
        "(deploy/make_certs.py issues the default); any other certificate the CA signed is refused",
    )
    parser.add_argument(
        "--executor-token-file",
        type=Path,
        help="a shared token (the file's first line, 16+ characters) every caller must send; the "
        "scheduler gets the same file. Required without mutual TLS",
    )
    parser.add_argument(
        "--insecure-executor",
        action="store_true",
        help="take plans from anyone who reaches the port, who can then read the K/V of other "
        "requests: for a network nothing else can reach; logged as a warning, and shown in status",
    )
    add_health_port_flag(parser)
    parser.add_argument("--metrics-port", type=port_number, help="serve Prometheus metrics over HTTP on this port")
    add_log_format_flag(parser)
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="shard the model over N ranks with transformers' tensor-parallel plan (NCCL on "
        "CUDA, one GPU per rank; gloo on CPU); the executor starts the other ranks itself, or "
        "runs under torchrun --nproc-per-node N",
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="which part of requests the scheduler plans here (ExecutorInfo.role): prefill (prompts "
        "up to their first token, then the request moves to a decode executor with its K/V), decode "
        "(requests whose prompt was computed elsewhere, and short prompts) or both; the executor "
        "itself runs any plan either way",
    )
    parser.add_argument(
        "--kv-host-gib",
        type=non_negative_float,
        default=0.0,
        metavar="N",
        help="a host tier of K/V blocks in N GiB of host memory (pinned on CUDA): the scheduler "
        "swaps preempted requests' blocks and evicted cached prefixes there instead of dropping "
        "them, and copies them back instead of recomputing; 0: no tier. Not with "
        "--tensor-parallel-size above 1, nor for a model with recurrent layers (refused at start)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds after SIGTERM for the scheduler to finish the requests running here and "
        "end its stream; what still runs then is recomputed by the scheduler elsewhere",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="on a start-up failure, log its traceback after the one-line reason",
    )
    args = parser.parse_args(argv)
    if args.kv_host_gib and args.tensor_parallel_size > 1:
        # Each rank holds only its own heads' K/V, and no rank keeps a host tier yet.
        parser.error("--kv-host-gib needs --tensor-parallel-size 1: a sharded executor keeps no host tier")
    try:
        tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        peer = peer_flags_tls(args, tls)
        token = read_token_file(args.executor_token_file) if args.executor_token_file else None
        access = ExecutorAccess.from_flags(
            token, args.insecure_executor, args.allowed_scheduler_names, tls is not None and tls.mutual
        )
    except ValueError as error:
        parser.error(str(error))
    return ExecutorSettings(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_memory,
        state_slots=args.state_slots,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        threads=args.threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
        trust_remote_code=args.trust_remote_code,
        attention_backend=args.attention_backend,
        lease_timeout_s=args.lease_timeout,
        packed_linear=args.packed_linear,
        greedy_screen=args.greedy_screen,
        draft_model_dir=args.draft_model,
        panel_linear=args.panel_linear,
        amx=args.amx,
        weight_blocks=args.weight_blocks,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        tls=tls,
        peer_tls=peer,
        health_port=args.health_port,
        drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        tensor_parallel_size=args.tensor_parallel_size,
        verbose=args.verbose,
        access=access,
        role=args.role,
        kv_host_gib=args.kv_host_gib,
    )


def peer_flags_tls(args: argparse.Namespace, tls: ServerTls | None) -> ClientTls | None:
    """How this executor calls its peers, from the --tls-peer-* flags and how it serves;
    TlsConfigError when a flag cannot apply."""
    if (args.tls_peer_cert is None) != (args.tls_peer_key is None):
        raise TlsConfigError("--tls-peer-cert and --tls-peer-key go together")
    if args.tls_peer_cert is not None and (tls is None or not tls.mutual):
        # A peer that serves without a client CA asks for no certificate.
        raise TlsConfigError("--tls-peer-cert/--tls-peer-key need mutual TLS (--tls-client-ca)")
    if args.tls_peer_server_name is not None and tls is None:
        raise TlsConfigError("--tls-peer-server-name needs TLS (--tls-cert, --tls-key)")
    cert = read_pem(args.tls_peer_cert, "peer certificate") if args.tls_peer_cert is not None else None
    key = read_pem(args.tls_peer_key, "peer key") if args.tls_peer_key is not None else None
    return peer_tls(tls, cert, key, args.tls_peer_server_name)


def check_device(name: str) -> None:
    device = torch.device("cpu" if name == "auto" else name)
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceUnavailable(f"--device {name}: torch sees no CUDA device here; pass --device cpu (or auto)")
    if device.index is not None and device.index >= count:
        raise DeviceUnavailable(
            f"--device {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}; pass one of them"
        )


def check_before_loading(settings: ExecutorSettings) -> None:
    """What would otherwise fail only once the model has loaded (tens of seconds later), checked
    first: the folder, the device, and the ports this process will listen on."""
    try:
        check_model_folder(settings.model_dir, settings.trust_remote_code)
    except FolderError as error:
        raise FolderError(f"--model {error}") from error
    if settings.draft_model_dir is not None:
        try:
            check_model_folder(settings.draft_model_dir, settings.trust_remote_code)
        except FolderError as error:
            raise FolderError(f"--draft-model {error}") from error
    check_device(settings.device)
    # Under torchrun only rank 0 serves; the others may run on machines of their own.
    if launched_by_torchrun() and os.environ.get("RANK") != "0":
        return
    check_listen_ports(
        settings.host,
        {"--port": settings.port, "--health-port": settings.health_port, "--metrics-port": settings.metrics_port},
    )


def main(argv: list[str] | None = None, prog: str = "python -m executor_service") -> int:
    settings = parse_args(argv, prog)
    configure_logging(settings.log_format)
    end_with_parent()
    assert settings.access is not None, "parse_args always decides the access policy"
    options = ServeOptions(
        host=settings.host,
        port=settings.port,
        lease_timeout_s=settings.lease_timeout_s,
        access=settings.access,
        tls=settings.tls,
        peer_tls=settings.peer_tls,
        health_port=settings.health_port,
        drain_timeout_s=settings.drain_timeout_s,
        metrics_port=settings.metrics_port,
    )
    # A refusal is one line that says why and what to do, not a traceback (unless -v): the
    # folder, the flags or the model is the problem, not the code.
    try:
        check_before_loading(settings)
        logger.info(
            "event=executor_starting model=%s port=%d tensor_parallel_size=%d",
            settings.model_dir, settings.port, settings.tensor_parallel_size,
        )
        if settings.tensor_parallel_size > 1:
            return serve_tensor_parallel(settings, options)
        worker = step_thread()
        executor = worker.submit(build_executor, settings).result()
    except (FolderError, DeviceUnavailable, PortUnavailable) as problem:
        logger.error("event=executor_refused reason=%r", str(problem), exc_info=settings.verbose)
        return 2
    except UnsupportedModel as refusal:
        logger.error(
            "event=executor_refused model_type=%s reason=%r", refusal.model_type, refusal.reason, exc_info=settings.verbose
        )
        return 1
    except BackendUnavailable as refusal:
        logger.error("event=executor_refused reason=%r", str(refusal), exc_info=settings.verbose)
        return 1
    asyncio.run(serve(executor, options, worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
