#!/usr/bin/env bash
# GPU check (issue 30): on a machine with a CUDA GPU, install what relayrl[local] needs and run the
# check's sections (src/relayrl/bench/gpu_check.py), each under its own time bound and carrying on
# after a failure, the whole within 8 minutes on one H200: environment (driver, torch, free GPU
# memory, /dev/shm, bf16); the default recipe on CUDA in float32 and bfloat16 (held-out gain,
# samples/s, trainer busy, peak GPU memory); a LoRA run; `relayrl bench trainer --device cuda`; a
# randomly initialised Qwen2.5-0.5B-shaped model built on `meta` and materialised on the GPU
# (trainer step, decode loop, weight export); the vLLM run where `import vllm` works. It prints a
# table and writes runs/gpu_check/gpu_check.json. Not yet run on a GPU when written. CI stays
# CPU-only and never runs this (tests/unit/test_gpu_check_script.py checks the install logic).
#
#   bash scripts/gpu_check.sh            # from anywhere; builds .venv-gpu from a package index
#   bash scripts/gpu_check.sh --vllm     # also installs vllm==0.32.0 (scripts/constraints-vllm-cuda.txt)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh --offline --wheels DIR
#
# With an index: checks PYTHON (default python3) is >= 3.11 and can make a venv, and that the disk
# has room, before any download; then a CUDA build of torch 2.13.0 from the index the driver's CUDA
# version calls for (nvidia-smi's "CUDA Version": >= 13.0 PyPI's default cu130 wheel, 12.8/12.9
# the cu128 index, 12.6/12.7 cu126, older refused; RELAYRL_TORCH_INDEX=URL overrides), then relayrl
# with `.[local]` under scripts/constraints.txt into .venv-gpu.
#
# --offline (an air-gapped machine): uses PYTHON as it is, with the torch installed there; installs
# nothing from an index; whatever relayrl[local] needs that PYTHON lacks comes from DIR
# (`pip install --no-index --find-links DIR --no-deps --target .gpu-deps/pyX.Y`, a folder of its
# own put on PYTHONPATH, so PYTHON's own site-packages are never modified); relayrl itself runs from
# this source tree (PYTHONPATH=src). Fill DIR on a machine with an index:
# `PYTHON=/path/to/that/python bash scripts/gpu_wheels.sh DIR`.
#
# Without a usable CUDA GPU it stops where one is needed, saying so in one line (gpu_check.json
# then holds the environment and the reason). Settings: RELAYRL_GPU_RUNS (runs/gpu_check),
# RELAYRL_GPU_VENV (.venv-gpu), RELAYRL_GPU_DEPS (.gpu-deps/pyX.Y), RELAYRL_GPU_CHECK_BUDGET_S
# (460, the sections' budget), RELAYRL_GPU_MIN_FREE_GB (12, free disk needed for the index install).
set -euo pipefail

fail() { echo "gpu_check: error: $*" >&2; exit 1; }
say() { echo "gpu_check: $*"; }
usage() { echo "usage: [PYTHON=python3] bash scripts/gpu_check.sh [--vllm] | --offline [--wheels DIR]" >&2; exit 2; }

offline=0 wheels="" with_vllm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --wheels) [ $# -ge 2 ] || usage; wheels="$(realpath -m -- "$2")"; shift ;;
    --vllm) with_vllm=1 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) usage ;;
  esac
  shift
done
[ -z "$wheels" ] || [ "$offline" = 1 ] || fail "--wheels DIR goes with --offline"
[ -z "$wheels" ] || [ -d "$wheels" ] || fail "--wheels $wheels: no such folder"
[ "$offline" = 0 ] || [ "$with_vllm" = 0 ] || fail "--vllm installs from an index: not with --offline (put vllm into PYTHON yourself)"

PYTHON="${PYTHON:-python3}"
case "$PYTHON" in */*) PYTHON="$(realpath -s -m -- "$PYTHON")" ;; esac
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT_DIR="${RELAYRL_GPU_RUNS:-runs/gpu_check}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0

# -- 1. preflight, before any download: Python >= 3.11 --------------------------------------------
command -v "$PYTHON" >/dev/null 2>&1 || fail "PYTHON=$PYTHON: no such command (set PYTHON=/path/to/python3.11+)"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || fail "PYTHON=$PYTHON does not run"
case "$pyver" in
  3.1[1-9]|3.[2-9][0-9]) ;;
  *) fail "needs Python >= 3.11; PYTHON=$PYTHON is $pyver (set PYTHON=/path/to/python3.11+)" ;;
esac
say "Python $pyver ($PYTHON)"

# -- 2. the GPU as the driver reports it ---------------------------------------------------------
smi_cuda="" gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)"
  smi_cuda="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)"
  say "GPUs: $(echo "${gpus:-none listed}" | head -n 4 | tr '\n' ';') driver CUDA ${smi_cuda:-unknown}"
fi

stop_no_gpu() {  # the point where a real GPU is needed: gpu_check.json with the environment and the reason
  PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m relayrl.bench.gpu_check --out-dir "$OUT_DIR" --mode "$1" \
    --stopped "$2" >/dev/null 2>&1 || true
  fail "$2 (the environment is in $OUT_DIR/gpu_check.json)"
}

if [ "$offline" = 1 ]; then
  # -- 3a. offline: PYTHON's own torch, the missing dependencies from DIR, relayrl from src --------
  torch_line="$("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null)" ||
    fail "--offline uses the torch installed in PYTHON=$PYTHON, and it has none that imports"
  say "offline: torch ${torch_line% *} (CUDA ${torch_line#* }) from $PYTHON; no package index is used"
  DEPS="${RELAYRL_GPU_DEPS:-.gpu-deps/py$pyver}"
  mkdir -p "$DEPS"
  DEPS="$(realpath -- "$DEPS")"
  export PYTHONPATH="$ROOT/src:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
  deps_args=(); [ -z "$wheels" ] || deps_args=(--wheels "$wheels")
  errfile="$(mktemp)"
  plan="$("$PYTHON" -m relayrl.bench.gpu_deps plan "${deps_args[@]}" 2>"$errfile")" ||
    { msg="$(tail -n 1 "$errfile")"; rm -f "$errfile"
      fail "relayrl[local] needs what $PYTHON lacks: $msg (fill a folder with \`PYTHON=... bash scripts/gpu_wheels.sh DIR\` where an index is reachable, then --wheels DIR)"; }
  rm -f "$errfile"
  pins=(); [ -z "$plan" ] || mapfile -t pins <<< "$plan"
  if [ "${#pins[@]}" -gt 0 ]; then
    say "installing ${#pins[@]} wheels from $wheels into $DEPS: ${pins[*]}"
    PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" \
      --no-deps --upgrade --target "$DEPS" "${pins[@]}" || fail "pip install --no-index --find-links $wheels failed (above)"
  else
    say "nothing to install: $PYTHON (with $DEPS) has everything relayrl[local] needs"
  fi
  PY="$PYTHON"
  mode=offline
else
  # -- 3b. with an index: the torch wheel for this driver, into .venv-gpu ----------------------------
  [ -n "$gpus" ] || stop_no_gpu index "no CUDA GPU on this machine (nvidia-smi is missing or lists none): the torch install and every run need one"
  [ -n "$smi_cuda" ] || fail "nvidia-smi does not say which CUDA version the driver supports (no \"CUDA Version:\" in its header)"
  major="${smi_cuda%%.*}" minor="${smi_cuda#*.}"
  if [ -n "${RELAYRL_TORCH_INDEX:-}" ]; then torch_index="$RELAYRL_TORCH_INDEX"
  elif [ "$major" -ge 13 ]; then torch_index=""
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 8 ]; then torch_index=https://download.pytorch.org/whl/cu128
  elif [ "$major" -eq 12 ] && [ "$minor" -ge 6 ]; then torch_index=https://download.pytorch.org/whl/cu126
  else fail "the driver supports CUDA $smi_cuda; torch 2.13.0 needs 12.6 or newer (cu126, cu128 or PyPI's cu130 wheels): update the driver"
  fi
  say "torch index: ${torch_index:-PyPI default (torch 2.13.0 cu130 wheels)} (driver CUDA $smi_cuda)"
  [ "$with_vllm" = 0 ] || [ -z "$torch_index" ] ||
    fail "--vllm: vllm 0.32.0's PyPI wheel is built for CUDA 13.0 (driver CUDA $smi_cuda); install vLLM's cu128 build into .venv-gpu yourself"
  VENV="${RELAYRL_GPU_VENV:-.venv-gpu}"
  PY="$VENV/bin/python"
  if ! "$PY" -m pip --version >/dev/null 2>&1; then  # missing or half made: made again, before any download
    "$PYTHON" -m venv --clear "$VENV" >/dev/null 2>&1 && "$PY" -m pip --version >/dev/null 2>&1 ||
      fail "PYTHON=$PYTHON cannot make a venv with pip at $VENV (on Debian/Ubuntu: apt install python$pyver-venv)"
  fi
  free_kb="$(df -Pk "$VENV" | awk 'NR == 2 { print $4 }')"
  need_gb="${RELAYRL_GPU_MIN_FREE_GB:-12}"
  [ "$free_kb" -ge $((need_gb * 1024 * 1024)) ] || fail "$((free_kb / 1024 / 1024)) GiB free at $VENV; a CUDA torch needs ~$need_gb GiB"
  # this machine's pip settings may point at CPU wheels (find-links, extra indexes): not for this venv
  pip_gpu() { PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
  has_cuda_torch() {  # torch 2.13.0 built for a CUDA the driver supports
    "$PY" -c "import sys, torch; c = torch.version.cuda; sys.exit(0 if torch.__version__.startswith('2.13.0') and c and tuple(map(int, c.split('.')[:2])) <= ($major, $minor) else 1)" 2>/dev/null
  }
  if ! has_cuda_torch; then
    say "installing torch 2.13.0 into $VENV (a few GB)"
    if [ -n "$torch_index" ]; then pip_gpu --force-reinstall --index-url "$torch_index" torch==2.13.0 || fail "cannot install torch==2.13.0 from $torch_index"
    else pip_gpu --force-reinstall torch==2.13.0 || fail "cannot install torch==2.13.0 from PyPI"
    fi
  fi
  pip_gpu -c scripts/constraints.txt -e '.[local]' || fail "cannot install relayrl[local] into $VENV"
  if [ "$with_vllm" = 1 ]; then
    pip_gpu -c scripts/constraints-vllm-cuda.txt vllm==0.32.0 || fail "cannot install vllm==0.32.0 into $VENV"
  fi
  has_cuda_torch || fail "the torch in $VENV is not a CUDA build the driver supports: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
  mode=index
fi

# -- 4. relayrl imports, then the sections -------------------------------------------------------
err="$("$PY" -c 'import relayrl.cli.main' 2>&1)" || fail "relayrl does not import with $PY: $(echo "$err" | tail -n 1)"
say "relayrl imports ($PY); the sections write $OUT_DIR/gpu_check.json"
exec "$PY" -m relayrl.bench.gpu_check --out-dir "$OUT_DIR" --mode "$mode"
