#!/usr/bin/env bash
# Create .venv (once) and install torch-thunderbolt into it with what the tests and plots need.
# TORCH_SPEC can override the pinned torch (CI and this project's Linux machines use the 2.13.0 CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/find_python.sh
. scripts/find_python.sh
if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || exit 1  # a stock Mac's python3 is 3.9: say what to install instead
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot]"
