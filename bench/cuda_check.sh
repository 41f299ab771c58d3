#!/usr/bin/env bash
# The CUDA checks of issue 10 in one run on a lent GPU machine, under 10 minutes:
#   1. the tests that need CUDA: decode steps replayed from CUDA graphs against the eager path,
#      a GPU executor sizing its KV cache from free memory, the peer harness on CUDA;
#   2. the peer harness on a SmolLM2-135M-shaped model (hidden 576, 30 layers, 9/3 heads, MLP
#      1536, vocab 49,152; random weights: the real ones, 98 MB as Q4_1, do not fit what travels
#      to that machine, and speed does not depend on the weights' values), bfloat16, the fixed
#      workload, 3 runs: splitserve with and without decode graphs, transformers static
#      `generate` and transformers continuous batching;
#   3. which CUDA configurations give a request the same bits whatever its batch (issue 35):
#      bench.same_bits in bfloat16 and float32, attention auto (flash_attn where installed) and
#      sdpa, decode graphs on and off.
#
# Here, once: bash bench/cuda_wheels.sh. Then, through the device tool, carrying .whl:
#   bash bench/cuda_check.sh
# Files come back in $OUT (at most 8, none deeper than two folders): env.txt, pytest.log,
# peers.md (the tables), peers.log, results.json, results.png, same_bits_{bfloat16,float32}.json.
# A dry run of the plumbing on a CPU machine (no .whl/ there, the project's venv first on PATH):
#   CHECK_DEVICE=cpu CHECK_ARGS="--runs 1 --requests 4 --new-tokens 8 --model-layers 2" bash bench/cuda_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/cuda-check-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
# Nothing beyond the machine can be reached: never let a library try.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import sys, torch, transformers, grpc, google.protobuf as pb
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/executor/test_decode_graphs.py tests/executor/test_executor_accelerator.py \
    tests/bench/test_compare.py::test_peers_on_cuda_with_and_without_decode_graphs >"$OUT/pytest.log" 2>&1
echo "pytest exit $?"
tail -5 "$OUT/pytest.log"
# A peer that hangs fails alone (--timeout), so the others' figures still reach results.json.
timeout 360 python3 -m bench.compare --device "${CHECK_DEVICE:-cuda}" --dtype bfloat16 --timeout 150 \
    --systems splitserve,splitserve-eager,transformers,transformers-cb --workloads fixed --runs 3 \
    --models random-llama --model-hidden 576 --model-layers 30 --model-heads 9 --model-kv-heads 3 \
    --model-intermediate 1536 --model-vocab 49152 \
    --out-dir /tmp/cuda-peers --json "$OUT/results.json" --png "$OUT/results.png" ${CHECK_ARGS:-} \
    >"$OUT/peers.md" 2>"$OUT/peers.log"
echo "bench.compare exit $?"
cat "$OUT/peers.md"
for dtype in bfloat16 float32; do
    timeout 120 python3 -m bench.same_bits --device "${CHECK_DEVICE:-cuda}" --dtype "$dtype" --backends auto,sdpa \
        --graphs on,off --json "$OUT/same_bits_$dtype.json" 2>>"$OUT/peers.log"
    echo "bench.same_bits $dtype exit $?"
done
