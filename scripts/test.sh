#!/usr/bin/env bash
# Set up (.venv, torch 2.13.0 CPU, archlab with the `test` extra: every package the tests import) and run
# the test suite without the tests marked slow (~10 minutes on 2 cores). Pytest arguments pass through:
# scripts/test.sh -m "slow or not slow" runs every test (what CI runs), scripts/test.sh tests/lab/test_lab.py one file.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
python -m pytest -q "$@"
