#!/usr/bin/env bash
# Set up (.venv, torch 2.13.0 CPU, archlab with the `test` extra: every package the tests import) and run
# the whole test suite, slow tests included. Pass pytest arguments to narrow it: scripts/test.sh -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
python -m pytest -q "$@"
