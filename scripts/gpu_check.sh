#!/usr/bin/env bash
# One command for any CUDA machine: install what is missing, then run the GPU checks
# (scripts/gpu_check.py) and print their verdict table. docs/gpu.md says what each checks.
#
#   scripts/gpu_check.sh [--wheels DIR] [--python PY] [--dry-run] [-- gpu_check.py flags]
#
#   --wheels DIR  install missing packages from the wheels in DIR only (no registry);
#                 a transformer_engine wheel there is installed too
#   --python PY   the interpreter to start from (default: python3, or the venv this
#                 script made before)
#   --dry-run     no CUDA needed: say what would be installed, install nothing, run
#                 the checks that run on CPU (gpu_check.py --cpu), skip the GPU ones
# Where PY already has a CUDA build of torch (NGC images, the lent GPU machines), that
# torch (and its Transformer Engine) is kept: missing packages go into
# runs/gpu_check/site with the repo's constraints file, its torch pin replaced by the
# torch installed, so pip never swaps it. Otherwise a venv runs/gpu_check/venv gets
# torch from constraints.txt (PyPI's Linux wheel is a CUDA build). Exit status: the
# checks' (1 if any failed), 2 on a usage or install problem. The whole GPU run is meant
# to fit in 8 minutes on one H100/H200 (each row prints its seconds; docs/gpu.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$ROOT/runs/gpu_check"
SITE="$WORK/site"
VENV="$WORK/venv"
WHEELS=""
PY=""
DRY=0
EXTRA=()

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
say() { echo "[gpu_check.sh] $*" >&2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) [[ $# -ge 2 ]] || die "--wheels needs a directory"; WHEELS="$(cd "$2" && pwd)" || die "--wheels $2: no such directory"; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PY="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

if [[ -z "$PY" ]]; then
  if [[ -x "$VENV/bin/python" ]]; then PY="$VENV/bin/python"
  elif [[ $DRY -eq 1 && -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
  else PY="python3"; fi
fi
command -v "$PY" >/dev/null || die "interpreter $PY not found; give one with --python"

pip_install() {  # pip_install PIP_ARGS... : from --wheels only when given, else the registry
  local src=()
  [[ -n "$WHEELS" ]] && src=(--no-index --find-links "$WHEELS")
  "$PY" -m pip install -q --disable-pip-version-check ${src[@]+"${src[@]}"} "$@"
}

# torch: keep a CUDA build where there is one; else a venv with the pinned torch.
TORCH="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")' 2>/dev/null || true)"
if [[ "$TORCH" != *" cpu" && -n "$TORCH" ]]; then
  say "keeping torch ${TORCH% *} (CUDA ${TORCH#* }) of $PY"
elif [[ $DRY -eq 1 ]]; then
  say "dry run: torch is '${TORCH:-absent}'; a GPU run would make $VENV with torch from constraints.txt"
else
  say "no CUDA torch in $PY ('${TORCH:-absent}'): making $VENV with torch from constraints.txt"
  "$PY" -m venv "$VENV" || die "cannot make a venv with $PY"
  PY="$VENV/bin/python"
  pip_install -c "$ROOT/constraints.txt" "torch==$(sed -n 's/^torch==//p' "$ROOT/constraints.txt")" \
    || die "installing torch failed (give wheels with --wheels DIR)"
  TORCH="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "cpu")')"
fi

# What else the checks import, as module:requirement; only the missing ones are installed.
MISSING="$("$PY" - <<'EOF'
import importlib.util
need = {"megatron.core": "megatron-core", "yaml": "pyyaml", "numpy": "numpy", "packaging": "packaging"}
missing = []
for mod, req in need.items():
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        missing.append(req)
print(" ".join(missing))
EOF
)"
TE_WHEELS=()
if [[ -n "$WHEELS" ]]; then
  shopt -s nullglob; TE_WHEELS=("$WHEELS"/transformer_engine*.whl); shopt -u nullglob
fi
if [[ -z "$MISSING" && ${#TE_WHEELS[@]} -eq 0 ]]; then
  say "nothing to install"
elif [[ $DRY -eq 1 ]]; then
  say "dry run: would install into $SITE: ${MISSING:-nothing} ${TE_WHEELS[*]:-}"
else
  mkdir -p "$SITE"
  # the repo's constraints, with torch pinned to the one installed: pip never replaces it
  grep -v '^torch==' "$ROOT/constraints.txt" > "$WORK/constraints.txt"
  echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" >> "$WORK/constraints.txt"
  say "installing into $SITE: $MISSING ${TE_WHEELS[*]:-}"
  # shellcheck disable=SC2086 # MISSING is a list of requirement names
  pip_install --no-deps --upgrade --target "$SITE" -c "$WORK/constraints.txt" $MISSING ${TE_WHEELS[@]+"${TE_WHEELS[@]}"} \
    || die "installing $MISSING failed (give wheels with --wheels DIR)"
fi

export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Deterministic kernels (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG) are
# given by gpu_check.py to the bit-exact rows' launches only, and removed from the timed
# ones (issue 34): nothing to export here.
ARGS=()
[[ $DRY -eq 1 ]] && ARGS+=(--cpu)
# exec: a `timeout` around this script (device_check.sh's hard limit) signals the check
# itself, and its -k SIGKILL still reaches it (a bash parent died at the SIGTERM, and
# timeout then returned without the kill while the check went on)
exec "$PY" "$ROOT/scripts/gpu_check.py" ${ARGS[@]+"${ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
