#!/usr/bin/env bash
# The one-GPU acceptance as ONE prepared call on a lent GPU machine (no registry there;
# 15 minutes of device time in all, at most 10 per command): scripts/gpu_check.sh, then
# scripts/megatron_lm_gpu_check.sh, both within --total-s (default 540 s = 9 minutes).
#
#   scripts/device_check.sh --prepare [MEGATRON_LM_DIR]   # here, with a registry
#   scripts/device_check.sh [--total-s S] [--python PY] [-- gpu_check.py flags]  # on the GPU
#   scripts/device_check.sh --dry-run [-- gpu_check.py flags]  # no GPU: the CPU part, same layout
#   scripts/device_check.sh --plan [-- gpu_check.py flags]  # estimated seconds, no run
#   ... -- --set issue34     issue 34's rows only (probe, shape, mlm, throughput): ~180-280 s
#   ... -- --only scenario_cost,bf16_vs_fp32_speed   the second call: these groups do not
#                            fit one 9-minute call beside the rest (gpu_check_plan.SECOND_CALL)
#   ... --no-megatron-lm     gpu_check.sh alone (a short call; its line says so); its
#                            130 s reserve goes to gpu_check.sh's budget
#   ... --probe              also scripts/layer_probe.py first (the roofline's layers
#                            timed: GPU, host, kernels; $OUT/layer_probe.json)
#
# --prepare fills runs/device/ (git-ignored; carry it with the call): wheels/ holds the
# Python 3.12 manylinux wheels the GPU machines lack (megatron-core 0.16.1, pydantic and
# what it needs, pyyaml, six, regex, psutil), megatron-lm/ Megatron-LM's training package at
# core_v0.16.1 from MEGATRON_LM_DIR (default $DYNMO_MEGATRON_LM). That is the recipe that
# worked on the H200 (../shared/notes/h200-measured.md): install the wheels with
# --no-index --no-deps --target, the repository from source.
# On the GPU machine: installs runs/device/wheels into runs/device/site, runs
# gpu_check.sh with --budget-s (what --total-s leaves after the install and the reserve
# of megatron_lm_gpu_check.sh; SIGTERM 60 s past it: gpu_check.py then kills its runs and
# writes the rows done, the rest "skipped: stopped"), packs, then megatron_lm_gpu_check.sh
# with --deadline-s and under `timeout` for what is left, and packs again: whatever
# stops the call, $OUT holds the last whole archive. The runs are written to runs/device/work; $OUT (what the device tool brings
# back: at most 8 files, none deeper than two folders) gets, all at its top
# (else runs/device/out):
#   device_check.txt   each part's exit status and seconds, and the archive's summary
#   gpu_check.txt      the verdict table           gpu_check.log   its progress (stderr)
#   gpu_check.json     the rows as JSON            scenario_costs.json  (when a scenario ran)
#   megatron_lm.txt    megatron_lm_gpu_check.sh's output
#   logs.tar.gz        EVERY log, report and profile of the run (<= 16 MiB, checkpoints
#                      excluded; MANIFEST.txt inside lists what was kept, cut or dropped:
#                      scripts/gpu_check_pack.py)
# --dry-run (no GPU needed): gpu_check.sh --dry-run, megatron_lm_gpu_check.sh not run (its
# line says so), the same files under $OUT.
# DYNMO_SOURCE_COMMIT=<hash> (set in the command line sent to the device, from here:
#                            the device copy's .git is not the tree sent: the 2026-11-27 run
#                            recorded the session's starting commit) names the source in
#                            scenario_costs.json and the simulator's GPU cost model.
# DEVICE_SETUP_S=<s>         (default 120) the limit of the first `import torch` and of the
#                            wheels' install, each; a setup failure's line also goes to
#                            $OUT/device_check.txt (exit 2).
# Exit status: 0 when both passed, 1 when either failed, 2 on a usage or setup problem.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEV="$ROOT/runs/device"
TOTAL=540
MLM_RESERVE=170   # megatron_lm_gpu_check.sh: 3 torchrun launches + their work (138 s on the
                  # H200 on 2026-11-27, with its MoE run failing at the first iteration)
GPU_GRACE=60      # gpu_check.sh's hard limit is its budget plus this (its imports and probe
                  # run before its budget clock starts), then a SIGTERM (it writes its table)
PACK_S=15         # what the last archive and the summary get
INSTALL_S=10      # what the plan counts for the install below
PY=
MODE=run
MLM_SRC="${DYNMO_MEGATRON_LM:-}"
DRY=0
MLM=1
PROBE=0
EXTRA=()
ARCHIVE_MIB=16   # the device tool brings back files of at most 16 MiB

SETUP_S="${DEVICE_SETUP_S:-120}"  # the first `import torch` and the wheels' install, each: a hung
                                  # one ends the call with its line (also in device_check.txt)
OUT_READY=0
die() {  # once $OUT is made (on the GPU machine) the line goes to device_check.txt too
  echo "device_check.sh: error: $*" >&2
  [[ $OUT_READY -eq 0 ]] || { echo "device_check.sh: error: $*" >> "$OUT/device_check.txt"; } 2>/dev/null || true
  exit 2  # whether or not the line could be written there
}
say() { echo "[device_check.sh] $*" >&2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare) MODE=prepare; shift; [[ $# -gt 0 && "$1" != -* ]] && { MLM_SRC="$1"; shift; } ;;
    --plan) MODE=plan; shift ;;
    --dry-run) DRY=1; shift ;;
    --no-megatron-lm) MLM=0; shift ;;
    --probe) PROBE=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    --total-s) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--total-s needs a whole number of seconds"; TOTAL="$2"; shift 2 ;;
    --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PY="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
# The interpreter: --python, else this checkout's .venv for a dry run or a plan here
# (where `make` installed torch), else python3 (the GPU machine's, which has torch).
if [[ -z "$PY" ]]; then
  PY=python3
  [[ ($DRY -eq 1 || $MODE == plan) && -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
fi
[[ $MLM -eq 0 ]] && MLM_RESERVE=0   # --no-megatron-lm: gpu_check.sh gets its reserve too
GPU_BUDGET=$((TOTAL - INSTALL_S - MLM_RESERVE))
[[ $GPU_BUDGET -gt 0 ]] || die "--total-s $TOTAL leaves no time for gpu_check.sh (needs > $((INSTALL_S + MLM_RESERVE)))"

if [[ $MODE == prepare ]]; then
  [[ -n "$MLM_SRC" && -f "$MLM_SRC/pretrain_gpt.py" ]] ||
    die "give a Megatron-LM checkout at core_v0.16.1 (MEGATRON_LM_DIR or \$DYNMO_MEGATRON_LM)"
  rm -rf "$DEV/wheels" "$DEV/megatron-lm"; mkdir -p "$DEV/wheels"
  fetch() { "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$DEV/wheels" "$@"; }
  # psutil: megatron-core's torch_dist writer (Megatron-LM's --save) imports it in each forked
  # writer; without it the writers die and the save waits for them for ever (seen on CPU)
  fetch --no-deps megatron-core==0.16.1 pyyaml six regex psutil || die "pip download failed"
  fetch pydantic || die "pip download pydantic failed"  # with its exact pydantic-core
  (cd "$MLM_SRC" && tar --exclude .git -cf - pretrain_gpt.py gpt_builders.py model_provider.py \
      megatron/training megatron/legacy megatron/rl megatron/post_training megatron/core/package_info.py) |
    (mkdir -p "$DEV/megatron-lm" && cd "$DEV/megatron-lm" && tar -xf -) || die "copying $MLM_SRC failed"
  say "ready: $(du -sh "$DEV" | cut -f1) in $DEV (carry runs/device with the device call)"
  exit 0
fi

if [[ $MODE == plan ]]; then
  NO_MLM=(); [[ $MLM -eq 0 ]] && NO_MLM=(--no-megatron-lm)
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$ROOT/scripts/gpu_check.py" --cpu --plan \
    --budget-s "$GPU_BUDGET" --device-check "$TOTAL" ${NO_MLM[@]+"${NO_MLM[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
  exit $?
fi

# ---- on the GPU machine (or --dry-run here) ------------------------------------------------
OUT="${OUT:-$DEV/out}"
WORK="$DEV/work"   # the runs; only what is listed above goes to $OUT
mkdir -p "$OUT"; rm -f "$OUT/device_check.txt"; OUT_READY=1  # a setup failure's line alone in it
timeout -k 5 "$SETUP_S" "$PY" -c "import torch" 2>/dev/null ||
  die "$PY cannot import torch within $SETUP_S s: pass --python with one that can (here: make install, then --python .venv/bin/python)"
rm -rf "$WORK"; mkdir -p "$WORK"
START=0   # SECONDS counts from this script's start: the torch check is spent too
SITE="$DEV/site"
if [[ $DRY -eq 0 ]] && compgen -G "$DEV/wheels/*.whl" >/dev/null; then
  timeout -k 5 "$SETUP_S" "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --upgrade \
    --target "$SITE" "$DEV"/wheels/*.whl || die "installing $DEV/wheels failed or took over $SETUP_S s"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[[ -f "$DEV/megatron-lm/pretrain_gpt.py" ]] && export DYNMO_MEGATRON_LM="$DEV/megatron-lm"
if [[ $PROBE -eq 1 && $DRY -eq 0 ]]; then
  say "layer_probe.py (GPU, host and kernels of the roofline's layers)"
  "$PY" "$ROOT/scripts/layer_probe.py" --json "$OUT/layer_probe.json" --budget-s 100 || say "layer_probe.py failed"
  START=$SECONDS   # the budgets below are gpu_check's and Megatron-LM's
fi
GPU_ARGS=(--python "$PY")
[[ $DRY -eq 1 ]] && GPU_ARGS+=(--dry-run)
pack() {  # pack LIMIT_S: every log, report and profile so far in $OUT/logs.tar.gz (checkpoints
  # excluded): the device tool brings back 8 files at most, so nothing else of the runs
  # would come back; packed after each part, each archive whole (gpu_check_pack.py renames it in)
  mkdir -p "$WORK/gpu_check"; cp "$OUT/gpu_check.log" "$WORK/gpu_check/gpu_check.log" 2>/dev/null
  PACKED="$(timeout -k 2 "$1" "$PY" "$ROOT/scripts/gpu_check_pack.py" "$OUT/logs.tar.gz" "$WORK/gpu_check" \
    "$WORK/megatron_lm" --limit-mib "$ARCHIVE_MIB" 2>&1)" || PACKED="packing failed: $PACKED"
  rm -f "$OUT/.logs.tar.gz.partial"  # a killed pack's: the tool brings back 8 files at most
}
GPU_CAP=$((GPU_BUDGET + GPU_GRACE))
CAP_LEFT=$((TOTAL - (SECONDS - START) - 80))  # a slow install or probe comes off the cap
[[ $CAP_LEFT -lt $GPU_CAP ]] && GPU_CAP=$((CAP_LEFT > 30 ? CAP_LEFT : 30))
say "gpu_check.sh ${GPU_ARGS[*]} --budget-s $GPU_BUDGET (after $((SECONDS - START)) s of install; stopped at $GPU_CAP s)"
set +e
timeout -k 20 "$GPU_CAP" bash "$ROOT/scripts/gpu_check.sh" "${GPU_ARGS[@]}" -- --budget-s "$GPU_BUDGET" \
  --out "$WORK/gpu_check" ${EXTRA[@]+"${EXTRA[@]}"} 2> "$OUT/gpu_check.log" | tee "$OUT/gpu_check.txt"
GPU_RC=${PIPESTATUS[0]}
GPU_S=$((SECONDS - START))
for f in gpu_check.json scenario_costs.json; do
  [[ -f "$WORK/gpu_check/$f" ]] && cp "$WORK/gpu_check/$f" "$OUT/$f"
done
pack 60
LEFT=$((TOTAL - (SECONDS - START) - PACK_S))
MLM_RC=2
if [[ $DRY -eq 1 ]]; then
  MLM_RC=0
  echo "megatron_lm_gpu_check.sh: not run: --dry-run (it needs a GPU)" | tee "$OUT/megatron_lm.txt"
elif [[ $MLM -eq 0 ]]; then
  echo "megatron_lm_gpu_check.sh: not run: --no-megatron-lm" | tee "$OUT/megatron_lm.txt"
elif [[ -z "${DYNMO_MEGATRON_LM:-}" ]]; then
  echo "megatron_lm_gpu_check.sh: not run: no Megatron-LM (run --prepare first)" | tee "$OUT/megatron_lm.txt"
elif [[ $LEFT -lt 70 ]]; then  # not its first run: 45 s at least (~46 s on the H200) + margins
  echo "megatron_lm_gpu_check.sh: skipped: budget ($LEFT s left of $TOTAL)" | tee "$OUT/megatron_lm.txt"
else
  say "megatron_lm_gpu_check.sh with $LEFT s left"
  DYNMO_CHECK_PORT=$((29500 + RANDOM % 1000)) timeout -k 5 "$LEFT" bash "$ROOT/scripts/megatron_lm_gpu_check.sh" \
    "$DYNMO_MEGATRON_LM" --python "$PY" --no-install --out "$WORK/megatron_lm" --deadline-s "$((LEFT - 5))" \
    > "$OUT/megatron_lm.txt" 2>&1
  MLM_RC=$?
  cat "$OUT/megatron_lm.txt"
fi
[[ -d "$WORK/megatron_lm" ]] && pack $((PACK_S - 3))
set -e
{
  echo "gpu_check.sh: exit $GPU_RC$([[ $GPU_RC -eq 124 || $GPU_RC -eq 137 ]] && echo " (stopped at its hard limit, $GPU_CAP s: the rows not run say 'skipped: stopped')"), $GPU_S s (budget $GPU_BUDGET s)$([[ $DRY -eq 1 ]] && echo ', --dry-run')"
  echo "megatron_lm_gpu_check.sh: exit $MLM_RC$([[ $MLM_RC -eq 124 ]] && echo ' (stopped by the total budget)'), $((SECONDS - START - GPU_S)) s"
  echo "total: $((SECONDS - START)) s of $TOTAL s"
  echo "$PACKED"
} | tee "$OUT/device_check.txt"
[[ $GPU_RC -eq 0 && $MLM_RC -eq 0 ]] && exit 0
[[ $GPU_RC -eq 2 ]] && exit 2
exit 1
