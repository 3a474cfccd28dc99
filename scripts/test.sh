#!/usr/bin/env bash
# Set up, then run the whole test suite (lab tests need root and skip with a reason otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
