#!/usr/bin/env bash
# Rehearse the device call on CPU, on the lent GPU machines' software stack: Python 3.12
# with PyPI's torch (a CUDA build, run here without a GPU) and nothing else but numpy,
# packaging and tensorboard (megatron_lm_gpu_check.sh read TensorBoard events on the H200),
# as the machines come; the project sent as the device tool sends it (a copy
# of the working tree with the carried runs/device); the carried wheels installed offline
# exactly as device_check.sh installs them; then device_check.sh --dry-run there.
# What it cannot rehearse: CUDA itself (kernels, events, the profiler's CUDA activity).
#
#   scripts/device_rehearsal.sh [--torch VERSION] [--tests] [-- gpu_check.py flags]
#     --torch   the machines' torch (default 2.11.0: 2.11.0+cu130 on the H100/H200 so far)
#     --tests   also the tests of the call's code under that interpreter (~20 min here)
#   e.g. scripts/device_rehearsal.sh -- --set issue34
#
# Needs: python3.12 (PATH, or $PY312), a registry (the first run installs 5 GB into
# runs/rehearsal/venv, reused after), runs/device from `device_check.sh --prepare`.
# Writes runs/rehearsal/{venv,tree,out}; exit status: device_check.sh's (or pytest's).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/runs/rehearsal"
TORCH_VERSION=2.11.0
TESTS=0
EXTRA=()
die() { echo "device_rehearsal.sh: error: $*" >&2; exit 2; }
say() { echo "[device_rehearsal.sh] $*" >&2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) [[ $# -ge 2 ]] || die "--torch needs a version, e.g. 2.11.0"; TORCH_VERSION="$2"; shift 2 ;;
    --tests) TESTS=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
is312() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [[ -n "${PY312:-}" ]]; then
  is312 "$PY312" || die "PY312=$PY312 is not a Python 3.12 interpreter (the lent machines run 3.12)"
else  # the first python3.12 that runs (a pyenv shim may not)
  for cand in $(command -v python3.12 || true) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    is312 "$cand" && { PY312="$cand"; break; }
  done
  [[ -n "${PY312:-}" ]] || die "no python3.12 found: set PY312 to one (the lent machines run 3.12)"
fi
compgen -G "$ROOT/runs/device/wheels/*.whl" >/dev/null ||
  die "no carried wheels: run scripts/device_check.sh --prepare MEGATRON_LM_DIR first"

VENV="$WORK/venv"
if [[ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH_VERSION" ]]; then
  say "making $VENV: Python $("$PY312" -V 2>&1 | cut -d' ' -f2), torch==$TORCH_VERSION, numpy, packaging, tensorboard"
  rm -rf "$VENV"; "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy packaging tensorboard ||
    die "installing torch==$TORCH_VERSION failed"
fi

# the tree the device tool sends: tracked and untracked-not-ignored files, plus the carry
TREE="$WORK/tree"
rm -rf "$TREE"; mkdir -p "$TREE"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2>/dev/null) |
  tar -xf - -C "$TREE"
mkdir -p "$TREE/runs"; cp -r "$ROOT/runs/device" "$TREE/runs/device"
rm -rf "$TREE/runs/device/site" "$TREE/runs/device/work" "$TREE/runs/device/out"

say "device_check.sh --dry-run in $TREE with $VENV/bin/python"
rm -rf "$WORK/out"; set +e
(cd "$TREE" && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
   --upgrade --target runs/device/site runs/device/wheels/*.whl &&
 env -u DYNMO_MEGATRON_LM OUT="$WORK/out" DYNMO_SOURCE_COMMIT="$(git -C "$ROOT" rev-parse --short HEAD)" \
   bash scripts/device_check.sh --python "$VENV/bin/python" --dry-run --total-s 480 -- ${EXTRA[@]+"${EXTRA[@]}"})
RC=$?
set -e
say "device_check.sh: exit $RC; its files: $WORK/out"
[[ $TESTS -eq 1 ]] || exit $RC

say "the call's tests under $VENV/bin/python (test tools added to the venv)"
"$VENV/bin/pip" install -q --disable-pip-version-check pytest hypothesis pytest-timeout pyyaml \
  matplotlib kubernetes || die "installing the test tools failed"
cd "$TREE"
PYTHONPATH="$TREE:$TREE/runs/device/site" DYNMO_MEGATRON_LM="$TREE/runs/device/megatron-lm" OMP_NUM_THREADS=1 \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/profiling tests/megatron/test_profiler.py \
  tests/megatron/test_profiling_clock.py tests/megatron/test_profiling_rest.py tests/scripts tests/integrations
