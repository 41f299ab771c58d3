#!/usr/bin/env bash
# Fetches, here, the wheels that bench/cuda_check.sh installs on a lent GPU machine, into .whl/
# (ignored by git; name it in the device tool's carry). That machine reaches no package registry
# and its image holds older transformers, grpcio and protobuf than this project needs (the
# committed protos are generated against grpcio 1.85 and protobuf 7): these are the versions of
# constraints.txt, for CPython 3.12 on x86-64 Linux, about 31 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="grpcio grpcio-health-checking grpcio-reflection protobuf prometheus_client transformers
huggingface_hub tokenizers safetensors hf-xet httpx2 httpcore2 truststore click regex typer tqdm
annotated-doc shellingham"
rm -rf .whl
mkdir -p .whl
for name in $PACKAGES; do
    pin=$(grep -i "^${name}==" constraints.txt) || { echo "constraints.txt pins no $name" >&2; exit 1; }
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pin"
done
du -sh .whl
