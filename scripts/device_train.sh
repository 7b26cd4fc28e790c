#!/usr/bin/env bash
# Drafter training call of issue 9 (plans/0008), one H200, run from the repository root after the
# GGUF staging (scripts/device_run.sh K for every part K = 0..N-1 that scripts/device_prep.sh made leaves
# /tmp/specdec/model.gguf). Within LIMIT s:
#   1. data (GEN_MIN > 0): the target answers the prompts in $DC/$H/prompts.npz (base round: every
#      prompt once, greedy or sampled at T ~ U[0.7, 1.0]; GEN_ROUNDS=1 GEN_SKIP_BASE=1: resampling
#      round 1 instead), shards into $W/data (plus any carried in $DC/$H/data);
#   2. training (TRAIN_MIN > 0) of the RUNS in lock-step on the same batches, KL 0.5, bf16 master,
#      warm-up 50 steps to PEAK: fresh from the shipped checkpoint — continuing its lineage when
#      $DC/$H/lineage.json is carried, else with a new held-out set — its cosine timed to end after
#      PLAN_MIN training minutes (0: with this call's budget); RESUME=NAME instead continues run NAME
#      left in $W by an earlier call on the same warm machine (its light state + export), the cosine
#      re-timed to reach its floor when this call's budget ends (--replan);
#      A RUNS entry NAME=L6B8/kl0.5/bf16/grow appends zero-output layers to the shipped 4; GROW_LR_SCALE=S
#      multiplies their lr (session 7: at S = 1 they stayed near zero); a fifth field e<W>x<share> (e.g.
#      u=L4B8/kl0.5/bf16/shipped;e=L4B8/kl0.5/bf16/shipped/e128x0.5) weights that run's anchors toward the first W
#      response tokens (training.recipe.sample_anchors; the uniform runs' batches and anchors are unchanged);
#   3. ACCEPT_N > 0: in-process acceptance (bf16, graphs, chain + tree@64) shipped vs the runs.
# Carry: .devcarry/whl and .devcarry/$H (prompts.npz, eval_texts.json.gz, optional lineage.json, data/).
# Returns (≤ 8 files): $OUT/ckpt/model-*.safetensors (the best run by final τ̂ on the first 64
# response tokens, published layout), $OUT/data.tar (the new shards), $OUT/small.tgz (train.log,
# ckpt/*.json, the light state: no weights, no moments; the session record with every run's curves).
# From a snapshot (scripts/device_snapshot.sh REV, carried as .devcarry/clean): cd .devcarry/clean &&
#   ln -sfn ../../checkpoints checkpoints && DC=.. bash scripts/device_train.sh
# Evaluation (a follow-up call on the same warm machine, ≤ EVAL_LIMIT s, carrying .devcarry/grpcwhl too): bash scripts/device_train.sh eval
#   → $OUT/acceptance_services_h200_$EVAL_TAG.{md,json} (shipped vs every run exported in $W, through the
#   services, T=0/1) + eval_logs.tgz; EVAL_SHIPPED_ONLY=1: the shipped drafter alone when no trained
#   exports are on the machine (a fresh one); EVAL_MODES (default chain,tree@64), EVAL_N (16).
# CPU dry run (minutes on a 2-core VM; tiny budgets): OUT=/tmp/d10/out W=/tmp/d10/w GGUF=<local gguf> CPU_TEST=1 bash scripts/device_train.sh
set -u
T0=$(date +%s)
LIMIT=${LIMIT:-350}          # seconds for the whole call (timeout of the python step below)
GGUF=${GGUF:-/tmp/specdec/model.gguf}
W=${W:-/tmp/specdec/train}  # work dir (data, exports, every run's light state stay here)
H=${H:-h10}                  # the carried folder under $DC
DC=${DC:-.devcarry}          # the carried folder (DC=.. when run inside a .devcarry/clean snapshot)
PEAK=${PEAK:-2e-4}
GEN_MIN=${GEN_MIN:-0}
TRAIN_MIN=${TRAIN_MIN:-6}
PLAN_MIN=${PLAN_MIN:-0}
RUNS=${RUNS:-l4=L4B8/kl0.5/bf16/shipped}
EVAL_TAG=${EVAL_TAG:-s10}
mkdir -p "$OUT" "$W/data"
if [ "${1:-}" = eval ]; then  # follow-up call on the same warm machine: shipped vs both trained drafters through the services
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DC"/whl/*.whl $(ls "$DC"/grpcwhl/*.whl 2>/dev/null)
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_EVAL_TEXTS=$(realpath "$DC")/$H/eval_texts.json.gz
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF"; exit 3; }
    D="shipped=$PWD/checkpoints/dflash-smollm2-135m"
    for e in "$W"/export-*/; do [ -f "$e/config.json" ] && r=$(basename "$e") && D="$D,${r#export-}=${e%/}"; done
    echo "drafters: $D"
    case $D in *,*) ;; *) [ -n "${EVAL_SHIPPED_ONLY:-}" ] || { echo "no trained exports in $W (the training call did not run on this machine)"; exit 3; };; esac
    timeout -k 5 "${EVAL_LIMIT:-150}" python3 -m bench.acceptance_services --drafters "$D" --n "${EVAL_N:-16}" --max-new 64 \
        --modes "${EVAL_MODES:-chain,tree@64}" --temperatures 0,1 --gguf "$GGUF" --worker-flags "${EVAL_FLAGS:---device cuda --dtype bfloat16}" \
        --where "one H200, bf16, CUDA graphs, services on loopback over gRPC" --log-dir "$OUT/eval_logs" \
        --out "$OUT/acceptance_services_h200_$EVAL_TAG"
    echo "eval rc=$?"
    (cd "$OUT" && tar czf eval_logs.tgz eval_logs && rm -rf eval_logs)
    exit 0
fi
cp -n "$DC"/$H/data/shard-*.npz "$W/data/" 2>/dev/null
if [ -z "${CPU_TEST:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$DC"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF (run scripts/device_run.sh K for every GGUF part K first)"; ls -la /tmp/specdec; exit 3; }
    EXTRA=(--warmup-steps 50 --minutes "$(python3 -c "print(($LIMIT - 15) / 60)")" --gen-minutes "$GEN_MIN" --gen-batch 2048
           --train-minutes "$TRAIN_MIN" --eval-every 400 --accept-n "${ACCEPT_N:-0}" --accept-max-new 64 --reserve 45)
else  # CPU: the same control flow in seconds (tiny generation, 3 steps, 1 held-out sequence)
    export PYTHONPATH=$PWD
    EXTRA=(--warmup-steps 2 --minutes 60 --gen-minutes 0.01 --gen-batch 12 --max-new 8 --max-steps 3 --batch-seqs 2 --train-minutes 50 --eval-every 2 --eval-seqs 1
           --accept-n ${CPU_ACCEPT_N:-1} --accept-max-new 8 --timing-warmup 1 --timing-steps 1)
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 SPECDEC_EVAL_TEXTS=$(realpath "$DC")/$H/eval_texts.json.gz
LEFT=$((LIMIT - 8 - ($(date +%s) - T0)))
[ "$LEFT" -gt 30 ] || { echo "train: only ${LEFT} s of LIMIT=${LIMIT} left after set-up (wheel install?): not starting"; exit 4; }
LINE=()   # continue the carried lineage, resume a run left on this machine, or start fresh
if [ -n "${RESUME:-}" ]; then LINE=(--resume "$W/state-$RESUME" --resume-weights "$W/export-$RESUME" --replan)  # keeps its peak lr
elif [ -f "$DC/$H/lineage.json" ]; then LINE=(--lineage "$DC/$H/lineage.json" --cycle)
elif [ "$PLAN_MIN" = 0 ]; then LINE=(--cycle)
else LINE=(--plan-minutes "$PLAN_MIN"); fi
GEN=(); [ -n "${GEN_ROUNDS:-}" ] && GEN=(--gen-rounds "$GEN_ROUNDS" --gen-seed "$GEN_ROUNDS"); [ -n "${GEN_SKIP_BASE:-}" ] && GEN+=(--gen-skip-base)
timeout -k 5 "$LEFT" python3 -m training.device_session --out "$OUT" --work "$W" \
    --gguf "$GGUF" --data "$W/data" --prompts "$DC/$H/prompts.npz" "${GEN[@]}" "${LINE[@]}" --runs "$RUNS" \
    $([ -z "${RESUME:-}" ] && echo --lr "$PEAK") --grow-lr-scale "${GROW_LR_SCALE:-1}" --timing-warmup 20 --timing-steps 60 --trim-loops 16 --light-state \
    "${EXTRA[@]}" 2>&1 | tee "$OUT/train.log"
echo "train rc=${PIPESTATUS[0]}" | tee -a "$OUT/train.log"
# small files into one archive (the link returns 8 files): logs, the checkpoint's json, the light state
(cd "$OUT" && tar czf small.tgz train.log $(ls ckpt/*.json 2>/dev/null) state session.json 2>/dev/null; \
 rm -rf train.log ckpt/*.json state session.json; \
 ls shard-*.npz >/dev/null 2>&1 && tar cf data.tar shard-*.npz && rm -f shard-*.npz)
ls -la "$OUT" "$OUT/ckpt" 2>/dev/null
echo "call took $(($(date +%s) - T0)) s"
