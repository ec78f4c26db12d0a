#!/usr/bin/env bash
# Fill DIR with the wheels that PYTHON lacks to run relayrl[local] (issue 30), for PYTHON's version,
# ABI and platforms, on a machine with a package index; then, on the air-gapped GPU machine with the
# same Python environment:
#
#   PYTHON=/path/to/python bash scripts/gpu_wheels.sh DIR     # here, with an index
#   PYTHON=/path/to/python bash scripts/gpu_check.sh --offline --wheels DIR   # there
#
# What is missing comes from relayrl.bench.gpu_deps run by PYTHON (its installed distributions
# against pyproject.toml's requirements, following the downloaded wheels' own requirements), in
# rounds of `pip download --no-deps --only-binary=:all: --python-version ... --abi ... --platform ...`
# until nothing is missing. Nothing is installed, into PYTHON or anywhere. Prints the wheels' total size.
set -euo pipefail

fail() { echo "gpu_wheels: error: $*" >&2; exit 1; }
say() { echo "gpu_wheels: $*"; }

[ $# -eq 1 ] && [ "${1#-}" = "$1" ] || { echo "usage: [PYTHON=python3] bash scripts/gpu_wheels.sh DIR" >&2; exit 2; }
DIR="$(realpath -m -- "$1")"
PYTHON="${PYTHON:-python3}"
case "$PYTHON" in */*) PYTHON="$(realpath -s -m -- "$PYTHON")" ;; esac
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

command -v "$PYTHON" >/dev/null 2>&1 || fail "PYTHON=$PYTHON: no such command"
pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || fail "PYTHON=$PYTHON does not run"
case "$pyver" in
  3.1[1-9]|3.[2-9][0-9]) ;;
  *) fail "needs Python >= 3.11; PYTHON=$PYTHON is $pyver" ;;
esac
mkdir -p "$DIR"
flags="$("$PYTHON" -m relayrl.bench.gpu_deps target)" || fail "cannot read PYTHON's platform tags (above)"
mapfile -t target <<< "$flags"
say "for Python $pyver ($PYTHON): ${target[0]} ${target[1]} ${target[2]} ${target[-1]} ... (${#target[@]} flags)"
previous=""
for round in 1 2 3 4 5 6 7 8 9 10; do
  missing="$("$PYTHON" -m relayrl.bench.gpu_deps missing --wheels "$DIR")" || fail "cannot tell what PYTHON lacks (above)"
  [ -n "$missing" ] || break
  mapfile -t need <<< "$missing"
  [ "${need[*]}" != "$previous" ] || fail "pip download gave no wheel for PYTHON's platform satisfying: ${need[*]}"
  say "round $round: ${need[*]}"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: "${target[@]}" -d "$DIR" "${need[@]}" ||
    fail "pip download failed (above)"
  previous="${need[*]}"
  [ "$round" -lt 10 ] || fail "still missing after 10 rounds: ${need[*]}"
done
shopt -s nullglob
wheels=("$DIR"/*.whl)
bytes=0
for w in "${wheels[@]}"; do bytes=$((bytes + $(stat -c %s "$w"))); done
say "$DIR: ${#wheels[@]} wheels, $((bytes / 1024)) KiB ($(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }') MiB)"
"$PYTHON" -m relayrl.bench.gpu_deps plan --wheels "$DIR" >/dev/null || fail "$DIR does not cover what PYTHON lacks (above)"
