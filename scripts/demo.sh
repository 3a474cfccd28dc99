#!/usr/bin/env bash
# Set up, then run the demo: 2 local ranks on the thunderbolt backend (no Thunderbolt cable needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m torch_thunderbolt demo "$@"
