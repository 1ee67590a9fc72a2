#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with the plugin profiling inside it, on one GPU.
#
#   scripts/megatron_lm_gpu_check.sh [MEGATRON_LM_DIR] [--python PY] [--iters N]
#                                    [--profile-every N] [--out DIR] [--no-install]
#                                    [--run-timeout S] [--deadline-s S]
#   scripts/megatron_lm_gpu_check.sh --check-only OUT_DIR ITERS PROFILE_EVERY LAYERS
#
# MEGATRON_LM_DIR: a Megatron-LM checkout at tag core_v0.16.1 (default $DYNMO_MEGATRON_LM;
# else the tag is cloned into ~/.cache/dynmo-megatron-lm, which needs network).
# Installs what Megatron-LM's imports need if missing (six regex triton pydantic, and
# tensorboard for the writer check; --no-install: none), then runs under torchrun
#   python -m dynmo_plugin.integrations.pretrain_gpt --mock-data --bf16 ... \
#     --tensorboard-dir OUT/tb --dynmo --dynmo-profile-every N --dynmo-output OUT/dynmo
# and checks that the plugin's profile events were written: one per N iterations in
# OUT/dynmo/report.json, each timing every layer, and dynmo/layer_<n>_fwd_ms scalars in
# Megatron-LM's TensorBoard events. That run also saves Megatron-LM checkpoints
# (--save, torch_dist) at ITERS/2 and ITERS; the second run resumes from the one at
# ITERS/2 (--load; the tracker file pointed at it) and its losses must match the first
# run's (exactly, or within 5e-3 relative: GPU kernels with atomics need not be bitwise
# deterministic). The third runs Megatron-LM's own MoE (--num-experts 4, top-2, MoE on
# layers 1 and 3, alltoall dispatcher; fp32) with --dynmo for 6 iterations: the plugin's `moe`
# events every iteration from 2, with each MoE layer's tokens per expert. On one GPU the
# pipeline is PP=1, so no layer moves here: migrations, saves after them and resumes
# under other pipeline sizes are tests/integrations/test_megatron_lm*.py's (CPU, PP=2).
# A failed run does not stop the others (2/3 needs 1/3's checkpoint; 3/3 is tried anyway).
# --check-only runs the first check alone on a finished run's OUT_DIR. --run-timeout S:
# a pretrain_gpt.py run still going after S seconds (default 150) is a failed run.
# --deadline-s S: the whole script's time (scripts/device_check.sh passes what its total
# leaves): each run's limit is also cut to what is left of S, so a run never outlives
# the caller's own `timeout` (GNU timeout puts a nested timeout in a process group of
# its own, which the outer one's kill does not reach); a run that would get under 45 s is
# not started, and one its deadline stopped ends the script, both with exit 124 (the
# caller's budget; 1 where a check or a run had already failed). DYNMO_MLM_MIN_RUN_S: that 45 s.
# Exit 0: passed; 1: a check failed or a run failed; 2: usage/setup.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG=core_v0.16.1
SRC="${DYNMO_MEGATRON_LM:-}"
PY=""; ITERS=20; EVERY=5; LAYERS=4; OUT="$ROOT/runs/megatron_lm_gpu_check"; INSTALL=1
RUN_TIMEOUT=150  # seconds per pretrain_gpt.py run: a hang ends as a failed run (exit 124); a
                 # healthy one took ~46 s on the H200; under what device_check.sh leaves, so
                 # a hang is named a hang, not the caller's deadline
DEADLINE=""      # --deadline-s: seconds for the whole script (SECONDS counts from its start)
MIN_RUN_S="${DYNMO_MLM_MIN_RUN_S:-45}"  # a run given less is not started (a launch took ~46 s on the H200)

die() { echo "megatron_lm_gpu_check.sh: error: $*" >&2; exit 2; }
say() { echo "[megatron_lm_gpu_check.sh] $*" >&2; }

check() {  # check OUT ITERS EVERY LAYERS: the plugin's events in the report and TensorBoard
  "$PY" - "$@" <<'EOF'
import json, os, sys
out, iters, every, layers = sys.argv[1], *map(int, sys.argv[2:])
report = json.load(open(os.path.join(out, "dynmo", "report.json")))
profiles = [e for e in report["events"] if e["kind"] == "profile" and not e.get("cancelled")]
want = list(range(every, iters + 1, every))
got = [e["iteration"] for e in profiles]
ok = got == want and all(len(e["profile"]["layers"]) == layers for e in profiles)
print(f"profile events at {got} (want {want}), each timing {layers} layers: {'PASS' if ok else 'FAIL'}")
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("tensorboard not importable: writer check skipped")
else:
    acc = EventAccumulator(os.path.join(out, "tb")).Reload()
    steps = [e.step for e in acc.Scalars("dynmo/layer_1_fwd_ms")] if "dynmo/layer_1_fwd_ms" in acc.Tags()["scalars"] else []
    tb_ok = steps == want
    print(f"TensorBoard dynmo/layer_1_fwd_ms at {steps}: {'PASS' if tb_ok else 'FAIL'}")
    ok = ok and tb_ok
sys.exit(0 if ok else 1)
EOF
}

ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) [[ $# -ge 2 ]] || die "--python needs an interpreter"; PY="$2"; shift 2 ;;
    --iters) [[ $# -ge 2 ]] || die "--iters needs a number"; ITERS="$2"; shift 2 ;;
    --profile-every) [[ $# -ge 2 ]] || die "--profile-every needs a number"; EVERY="$2"; shift 2 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a directory"; OUT="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --run-timeout) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--run-timeout needs seconds"; RUN_TIMEOUT="$2"; shift 2 ;;
    --deadline-s) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || die "--deadline-s needs seconds"; DEADLINE="$2"; shift 2 ;;
    --check-only) [[ $# -eq 5 ]] || die "--check-only OUT_DIR ITERS PROFILE_EVERY LAYERS"; ARGS=("$2" "$3" "$4" "$5"); shift 5 ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown argument $1 (see --help)" ;;
    *) SRC="$1"; shift ;;
  esac
done
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "interpreter $PY not found; give one with --python"
if [[ ${#ARGS[@]} -gt 0 ]]; then check "${ARGS[@]}"; exit $?; fi

# ---- the source ------------------------------------------------------------------------
if [[ -z "$SRC" ]]; then
  SRC="$HOME/.cache/dynmo-megatron-lm"
  if [[ ! -f "$SRC/pretrain_gpt.py" ]]; then
    say "cloning Megatron-LM $TAG into $SRC"
    git clone -q --depth 1 --branch "$TAG" https://github.com/NVIDIA/Megatron-LM "$SRC" ||
      die "cannot clone Megatron-LM; give the root of a checkout at $TAG as MEGATRON_LM_DIR"
  fi
fi
[[ -f "$SRC/pretrain_gpt.py" ]] || die "$SRC: no pretrain_gpt.py; give the root of a Megatron-LM checkout at $TAG"
SRC="$(cd "$SRC" && pwd)"

# ---- the machine and the packages ---------------------------------------------------------
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  die "$PY sees no CUDA GPU: Megatron-LM's pretrain() asserts CUDA (the CPU tests are tests/integrations/test_megatron_lm.py)"
"$PY" -c 'import dynmo_plugin' 2>/dev/null || die "$PY cannot import dynmo_plugin: pip install -e $ROOT"
MISSING=()
for m in six regex triton pydantic; do
  "$PY" -c "import $m" 2>/dev/null || MISSING+=("$m")
done
if [[ ${#MISSING[@]} -gt 0 ]]; then
  [[ $INSTALL -eq 1 ]] || die "missing ${MISSING[*]} (drop --no-install, or install them)"
  say "installing ${MISSING[*]}"
  "$PY" -m pip install -q --disable-pip-version-check "${MISSING[@]}" || die "pip install ${MISSING[*]} failed"
fi
# tensorboard only feeds the writer check, which says "skipped" without it
if ! "$PY" -c "import tensorboard" 2>/dev/null && [[ $INSTALL -eq 1 ]]; then
  "$PY" -m pip install -q --disable-pip-version-check tensorboard || say "no tensorboard: writer check skipped"
fi

# ---- the runs --------------------------------------------------------------------------------
rm -rf "$OUT"; mkdir -p "$OUT"
HALF=$((ITERS / 2))
FAIL=0
run_limit() {  # seconds the next run may take: --run-timeout, cut to what --deadline-s leaves
  local limit=$RUN_TIMEOUT left
  if [[ -n "$DEADLINE" ]]; then
    left=$((DEADLINE - SECONDS - 10))  # 10 s for the kill (-k 5) and the checks after it
    [[ $left -lt $limit ]] && limit=$left
  fi
  echo "$limit"
}
run() {  # run LOG FLAGS...: pretrain_gpt.py through the wrapper on one GPU; 1 (and FAIL=1) if
  # it fails: the runs after it are still tried (one device call is all there is)
  local log="$1"; shift
  local limit; limit="$(run_limit)"
  if [[ $limit -lt $MIN_RUN_S ]]; then  # the caller's budget, not a failure: 124 (a failed check still 1)
    say "no time left for $log (--deadline-s $DEADLINE, $SECONDS s gone)"; exit $((FAIL ? 1 : 124))
  fi
  set +e
  DYNMO_MEGATRON_LM="$SRC" CUDA_DEVICE_MAX_CONNECTIONS=1 timeout -k 5 "$limit" "$PY" -m torch.distributed.run \
    --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "${DYNMO_CHECK_PORT:-29561}" \
    -m dynmo_plugin.integrations.pretrain_gpt \
    --hidden-size 512 --num-attention-heads 8 --seq-length 512 \
    --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16 \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
    --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion \
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion \
    --eval-iters 0 --eval-interval 1000 --log-interval 1 "$@" >"$log" 2>&1
  local rc=$?
  set -e
  [[ $rc -eq 0 ]] && return 0
  tail -n 30 "$log" >&2
  if [[ ($rc -eq 124 || $rc -eq 137) && $limit -lt $RUN_TIMEOUT ]]; then  # cut by --deadline-s
    say "stopped at the deadline after $limit s (exit $rc): $log"; exit $((FAIL ? 1 : 124))
  fi
  say "the run failed (exit $rc): $log"; FAIL=1; return 1
}
say "1/3 pretrain_gpt.py from $SRC, $ITERS iterations, profiled every $EVERY, saved at $HALF and $ITERS; log: $OUT/train.log"
if run "$OUT/train.log" --bf16 --num-layers "$LAYERS" --train-iters "$ITERS" --tensorboard-dir "$OUT/tb" \
    --save "$OUT/ckpt" --save-interval "$HALF" \
    --dynmo --dynmo-profile-every "$EVERY" --dynmo-output "$OUT/dynmo"; then
  grep -E "iteration +$ITERS/|dynmo:" "$OUT/train.log" | tail -n 4 >&2 || true
  check "$OUT" "$ITERS" "$EVERY" "$LAYERS" || FAIL=1
fi

say "2/3 resumed from the checkpoint at iteration $HALF (--load); log: $OUT/resume.log"
if [[ ! -d "$OUT/ckpt/iter_$(printf %07d "$HALF")" ]]; then
  say "no checkpoint at iteration $HALF: 2/3 not run"; FAIL=1
elif ! echo "$HALF" > "$OUT/ckpt/latest_checkpointed_iteration.txt"; then
  say "cannot point the tracker file at iteration $HALF: 2/3 not run"; FAIL=1
elif run "$OUT/resume.log" --bf16 --num-layers "$LAYERS" --train-iters "$ITERS" --load "$OUT/ckpt" \
      --dynmo --dynmo-output "$OUT/resumed"; then
"$PY" - "$OUT" "$HALF" <<'EOF' || FAIL=1
import json, os, sys
out, half = sys.argv[1], int(sys.argv[2])
def losses(name):
    report = json.load(open(os.path.join(out, name, "report.json")))
    return {r["iteration"]: r["loss"] for r in report["iterations"]}
full, resumed = losses("dynmo"), losses("resumed")
its = sorted(resumed)
worst = max((abs(resumed[i] - full[i]) / abs(full[i]) for i in its), default=float("inf"))
ok = its == [i for i in sorted(full) if i > half] and worst <= 5e-3
shown = "bit-exact" if worst == 0 else f"max relative difference {worst:.2e}"
print(f"resumed iterations {its}: losses {shown} vs the uninterrupted run: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
fi

say "3/3 Megatron-LM's own MoE (--num-experts 4, layers 1 and 3), 6 iterations; log: $OUT/moe.log"
run "$OUT/moe.log" --num-layers 4 --train-iters 6 --num-experts 4 --moe-router-topk 2 \
  --moe-layer-freq "[1,0,1,0]" --moe-expert-capacity-factor 1.5 \
  --moe-token-dispatcher-type alltoall --disable-bias-linear \
  --dynmo --dynmo-output "$OUT/moe" || exit 1
"$PY" - "$OUT" <<'EOF' || FAIL=1
import json, os, sys
report = json.load(open(os.path.join(sys.argv[1], "moe", "report.json")))
events = [e for e in report["events"] if e["kind"] == "dynamism" and e["scenario"] == "moe"]
got = [(e["iteration"], sorted(e["detail"]["tokens_per_expert"])) for e in events]
want = [(i, ["1", "3"]) for i in range(2, 7)]
ok = got == want and all(len(c) == 4 for e in events for c in e["detail"]["tokens_per_expert"].values())
print(f"moe events {got} (want {want}): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF
exit $FAIL
