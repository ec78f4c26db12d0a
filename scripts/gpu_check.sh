#!/usr/bin/env bash
# GPU check (issues 20, 21): on a machine with a CUDA GPU, run the default recipe with the trainer
# and the hf sampler on CUDA, then with the vLLM engine when it can be imported, with LoRA, and
# with the sharded trainer when there are two GPUs, and print each run's held-out gain, samples/s
# and trainer busy (from its summary.json); then `relayrl bench trainer --device cuda` (FSDP2 over
# NCCL on one rank, or 1 and 2 with two GPUs). Meant to take under 8 minutes
# on one H200 with 16 cores (each run is bounded by RELAYRL_GPU_RUN_LIMIT_S, 240 s); not yet run
# on a GPU when written. CI stays CPU-only and never runs this.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# It sets up its own environment, .venv-gpu: a CUDA build of torch 2.13.0 (PyPI's default Linux
# wheel is one; RELAYRL_TORCH_INDEX=URL picks another index, e.g.
# https://download.pytorch.org/whl/cu128), then relayrl with the versions of
# scripts/constraints.txt. The CPU-only .venv of scripts/setup.sh is left alone. vLLM is not
# installed here (it pins its own torch): put the regular `vllm` package into .venv-gpu first to
# have the vLLM step run; without it the step is skipped, saying why.
# Without a CUDA GPU it fails at once, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu_check: error: $*" >&2; exit 1; }
say() { echo "gpu_check: $*"; }

# -- 1. a CUDA GPU, before anything is installed ----------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || fail "no CUDA GPU on this machine (nvidia-smi not found); this check needs one"
gpus="$(nvidia-smi -L 2>/dev/null || true)"
[ -n "$gpus" ] || fail "no CUDA GPU on this machine (nvidia-smi lists none); this check needs one"
say "GPUs: $(echo "$gpus" | head -n 4 | tr '\n' ';')"

# -- 2. .venv-gpu with a CUDA build of torch 2.13.0 ------------------------------------------
PYTHON="${PYTHON:-python3}"
VENV=.venv-gpu
PY="$VENV/bin/python"
[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
has_cuda_torch() { "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and torch.version.cuda else 1)" 2>/dev/null; }
if ! has_cuda_torch; then
  say "installing a CUDA build of torch 2.13.0 into $VENV (a few GB)"
  # this machine's pip settings may point at CPU wheels (find-links, extra indexes): not for this venv
  pip_gpu() { PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
  if [ -n "${RELAYRL_TORCH_INDEX:-}" ]; then
    pip_gpu --index-url "$RELAYRL_TORCH_INDEX" torch==2.13.0 || fail "cannot install torch==2.13.0 from $RELAYRL_TORCH_INDEX"
  else
    pip_gpu torch==2.13.0 || pip_gpu --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0 ||
      fail "cannot install a CUDA build of torch==2.13.0 (neither PyPI's default wheel nor the cu128 index); set RELAYRL_TORCH_INDEX"
  fi
  has_cuda_torch || fail "the torch installed in $VENV is not a CUDA build: $("$PY" -c 'import torch; print(torch.__version__)')"
fi
"$PY" -c "import relayrl" 2>/dev/null ||
  "$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[local,ray,tasks]'
"$PY" - <<'EOF' || fail "torch cannot use the GPU (torch.cuda.is_available() is False): check the driver against torch's CUDA build"
import sys, torch
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} device(s), "
      f"cuda:0 = {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}, "
      f"bf16 {'yes' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'no'}")
sys.exit(0 if torch.cuda.is_available() else 1)
EOF

# -- 3. the runs -------------------------------------------------------------------------------
OUT_DIR="${RELAYRL_GPU_RUNS:-runs/gpu_check}"
RUN_LIMIT_S="${RELAYRL_GPU_RUN_LIMIT_S:-240}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
names=()

run() {  # run NAME SETTINGS...: the default recipe with these --set settings
  local name="$1"; shift
  local args=(train --set "run.name=$name" --set "run.output_dir=$OUT_DIR")
  for s in "$@"; do args+=(--set "$s"); done
  say "run $name: relayrl ${args[*]}"
  local started=$SECONDS
  if timeout "$RUN_LIMIT_S" "$PY" -m relayrl "${args[@]}" >"$OUT_DIR/$name.log" 2>&1; then
    say "run $name finished in $((SECONDS - started)) s"
    names+=("$name")
  else
    tail -n 20 "$OUT_DIR/$name.log" >&2
    fail "run $name failed or ran past ${RUN_LIMIT_S}s (its output: $OUT_DIR/$name.log)"
  fi
}

mkdir -p "$OUT_DIR"
run hf-cuda train.device=cuda rollout.device=cuda
run hf-cuda-bf16 train.device=cuda rollout.device=cuda model.dtype=auto

if ! "$PY" -c "import relayrl.config.schema as s, sys; sys.exit(0 if 'engine' in s.RolloutConfig.model_fields else 1)"; then
  say "skipping the vLLM run: this relayrl has no rollout.engine key (the vLLM engine is not built in)"
elif ! vllm_error="$("$PY" -c 'import vllm' 2>&1)"; then
  say "skipping the vLLM run: \`import vllm\` fails in $VENV ($(echo "$vllm_error" | tail -n 1)); install the regular vllm package there"
else
  run vllm-cuda train.device=cuda rollout.device=cuda rollout.engine=vllm
fi
run lora-cuda train.device=cuda rollout.device=cuda train.lora.r=8 train.learning_rate=2e-3
ngpus="$(echo "$gpus" | grep -c . || true)"
if [ "$ngpus" -ge 2 ]; then
  run sharded-cuda train.device=cuda rollout.device=cuda train.world_size=2
fi
# the sharded trainer (FSDP2 over NCCL) on the GPUs there are, on a random 52 M Qwen2 (issue 21)
sizes=1; [ "$ngpus" -ge 2 ] && sizes=1,2
say "bench trainer --device cuda --world-size $sizes"
timeout "$RUN_LIMIT_S" "$PY" -m relayrl bench trainer --device cuda --world-size "$sizes" --steps 4 ||
  say "bench trainer on CUDA failed or ran past ${RUN_LIMIT_S}s"

# -- 4. the figures ----------------------------------------------------------------------------
"$PY" - "$OUT_DIR" "${names[@]}" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<14} {'held-out before':>15} {'after':>6} {'gain':>6} {'samples/s':>10} {'trainer busy':>13} {'wall s':>7}")
for name in sys.argv[2:]:
    s = json.loads((out / name / "summary.json").read_text())
    before, after = s["accuracy_before"], s["accuracy_after"]
    gain = f"{after - before:+.2f}" if before is not None and after is not None else "n/a"
    print(f"{name:<14} {before:>15.2f} {after:>6.2f} {gain:>6} {s['samples_per_s']:>10.0f} {s['trainer_busy_fraction']:>12.1%} "
          f"{s['wall_time_s']:>7.1f}")
EOF
