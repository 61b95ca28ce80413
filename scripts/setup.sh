#!/usr/bin/env bash
# Create .venv and install archlab with everything its tests need.
# torch==2.13.0 goes first: a CPU wheel is on local disk, and any other torch requirement
# would make pip pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[hf,fast,data,tb,serve,eval,ray,lab,dev]" "torch==2.13.0"
