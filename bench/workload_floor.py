"""The least time any float32 system can take for a peer-comparison workload on this machine, and
so the most output tokens/s it can reach: the workload's arithmetic at the machine's fastest
measured float32-accurate GEMM rate (oneDNN's, or the panel kernel's, on AMX where there is
one), with decode attention at the larger of its arithmetic time and the time to read every
sequence's K/V once per step at the measured memory bandwidth.

    python -m bench.workload_floor [--models random-llama,DIR] [--workloads fixed,varied]
        [--threads 2] [--peak-gflops G] [--bandwidth-gbs B]

A ratio target above what the floor allows cannot be met by any engine on this machine, however
fast its kernels: what `bench.compare` measures should be read against it. Counted: every
linear layer of every prompt token and of every decode token (the lm_head only where a token is
sampled: each prompt's last token and every decode token), causal attention (QK and PV, 4 x head
width flops per query, key and head). Not counted: norms, activations, RoPE, sampling, K/V
writes, which only lower the ceiling further.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.compare_models import FP32_BYTES, RANDOM_LLAMA, RandomLlamaDims
from bench.compare_workloads import Workload, WorkloadSizes, build_workload
from executor_service.cpu_forward.packed_linear import PackedLinear
from executor_service.kernels.cpu_kernels import KernelUnavailable
from executor_service.kernels.panel_linear import load_panel_kernel


@dataclass(slots=True, frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, int]) -> Dims:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    @property
    def body_flops(self) -> int:
        """Linear-layer flops of one token below the lm_head (gated MLP)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return 2 * self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention_flops(self, keys: int) -> int:
        """One query token against `keys` keys, every layer and head."""
        return 4 * self.layers * self.heads * self.head_dim * keys

    def kv_bytes(self, keys: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * keys * FP32_BYTES


@dataclass(slots=True, frozen=True)
class Floor:
    output_tokens: int
    gemm_flops: int
    prefill_attention_flops: int
    decode_attention_flops: int
    decode_kv_bytes: int

    def seconds(self, peak_flops: float, bandwidth: float) -> float:
        decode_attention = max(self.decode_attention_flops / peak_flops, self.decode_kv_bytes / bandwidth)
        return (self.gemm_flops + self.prefill_attention_flops) / peak_flops + decode_attention


def workload_floor(dims: Dims, prompts: list[int], new_tokens: list[int]) -> Floor:
    """prompts: each request's prompt length; new_tokens: its output tokens (the first comes
    from the prefill, each later one from a decode step over the context so far)."""
    gemm = prefill_attention = decode_attention = kv = 0
    for prompt, new in zip(prompts, new_tokens, strict=True):
        gemm += prompt * dims.body_flops + dims.head_flops + (new - 1) * (dims.body_flops + dims.head_flops)
        prefill_attention += dims.attention_flops(prompt * (prompt + 1) // 2)
        contexts = sum(prompt + step for step in range(1, new))
        decode_attention += dims.attention_flops(contexts)
        kv += dims.kv_bytes(contexts)
    return Floor(sum(new_tokens), gemm, prefill_attention, decode_attention, kv)


def workload_floor_of(dims: Dims, workload: Workload) -> Floor:
    return workload_floor(dims, [len(p) for p in workload.prompts], workload.new_tokens)


@dataclass(slots=True, frozen=True)
class MachineRates:
    """This machine's fastest float32-accurate GEMM rate and its memory bandwidth."""

    peak_flops: float
    bandwidth: float

    @classmethod
    def measure(cls, threads: int) -> MachineRates:
        """Both measured on `threads` torch threads (the caller's count is restored after)."""
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cls(measure_peak_flops(), measure_bandwidth())
        finally:
            torch.set_num_threads(previous)

    def most_output_tok_s(self, floor: Floor) -> float:
        """The most output tok/s any float32 engine reaches on the floor's workload here."""
        return floor.output_tokens / floor.seconds(self.peak_flops, self.bandwidth)

    def __str__(self) -> str:
        return f"GEMM {self.peak_flops / 1e9:.0f} GFLOP/s, memory {self.bandwidth / 1e9:.1f} GB/s"


def measure_peak_flops(seconds: float = 1.0) -> float:
    """The fastest float32-accurate GEMM rate here, at a prefill MLP's shape: oneDNN's packed
    sgemm, and where the CPU has AVX-512 the panel kernel (on AMX's tiles where it has those)
    for float32 weights and for weights made of 4-bit blocks, which it multiplies faster still."""
    linear = torch.nn.Linear(512, 2816, bias=False)
    rows = torch.randn(2048, linear.in_features)
    candidates = [PackedLinear(linear)]
    try:
        panels = load_panel_kernel()
    except KernelUnavailable:
        panels = None
    if panels is not None:
        candidates += [PackedLinear(linear, panels), PackedLinear(four_bit_linear(512, 2816), panels)]
    flops = 2 * rows.shape[0] * linear.in_features * linear.out_features
    return max(flops * _repeat(lambda: packed(rows), seconds) for packed in candidates)


def four_bit_linear(in_features: int, out_features: int) -> torch.nn.Linear:
    """A linear layer whose every block of 32 inputs takes levels (q - 8) d, q in 0..15 reached
    at both ends, d a power of two: exactly what a Q4_1 copy dequantizes to."""
    levels = torch.randint(0, 16, (out_features, in_features))
    levels[:, 0::32], levels[:, 1::32] = 0, 15
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (levels - 8).float() * 2.0**-6
    return linear


def measure_bandwidth(seconds: float = 1.0) -> float:
    """Bytes/s of a sum over 512 MiB, far past any cache."""
    data = torch.ones(128 << 20)
    return data.numel() * FP32_BYTES * _repeat(lambda: data.sum(), seconds)


def _repeat(work: Callable[[], object], seconds: float) -> float:
    """Calls per second of `work`, after one untimed call."""
    work()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        work()
        calls += 1
    return calls / (time.perf_counter() - started)


def model_dims(spec: str) -> Dims:
    """random-llama's dimensions, or those of the model folder `spec`."""
    if spec == RANDOM_LLAMA:
        d = RandomLlamaDims()
        return Dims(d.hidden, d.layers, d.heads, d.kv_heads, d.hidden // d.heads, d.intermediate, d.vocab)
    return Dims.from_config(json.loads((Path(spec) / "config.json").read_text()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=RANDOM_LLAMA, help=f"{RANDOM_LLAMA} or model folders, comma-separated")
    parser.add_argument("--workloads", default="fixed,varied")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peak-gflops", type=float, help="GEMM rate to use instead of measuring it")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth to use instead of measuring it")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rates = MachineRates(
        args.peak_gflops * 1e9 if args.peak_gflops else measure_peak_flops(),
        args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_bandwidth(),
    )
    print(f"{rates}, {args.threads} threads\n")
    print("| model | workload | GFLOP linear | GFLOP attention | decode K/V GB | floor s | most output tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec in args.models.split(","):
        dims = model_dims(spec)
        for name in args.workloads.split(","):
            floor = workload_floor_of(dims, build_workload(name, WorkloadSizes(), dims.vocab))
            seconds = floor.seconds(rates.peak_flops, rates.bandwidth)
            attention = floor.prefill_attention_flops + floor.decode_attention_flops
            print(
                f"| {Path(spec).name} | {name} | {floor.gemm_flops / 1e9:.0f} | {attention / 1e9:.0f} | "
                f"{floor.decode_kv_bytes / 1e9:.1f} | {seconds:.2f} | {rates.most_output_tok_s(floor):.0f} |"
            )


if __name__ == "__main__":
    main()
