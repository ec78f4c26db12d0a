#!/usr/bin/env bash
# Create .venv and install relayrl with everything it needs, on a fresh machine.
# CPU torch 2.13.0 goes in first; the constraints file keeps anything from replacing it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[local,dev,ray,tasks]'
.venv/bin/python -c "import torch, relayrl; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('relayrl', relayrl.__version__, '| torch', torch.__version__)"
