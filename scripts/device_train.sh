#!/usr/bin/env bash
# Session-7 drafter training call of issue 9 (plans/0008 "Session 7"), one H200, run from the
# repository root after the lead's GGUF staging (scripts/device_run.sh K leaves
# /tmp/specdec/model.gguf). In one call, within LIMIT seconds:
#   1. fresh data: ~GEN_MIN minutes of the target resampling the training prompts (resampling
#      round 1: every prompt once at T ~ U[0.7, 1.0], job ids after the base list);
#   2. two drafters in lock-step on the same batches (carried shards + the new one, loops
#      trimmed), both starting from the shipped checkpoint and continuing its lineage
#      (global step, held-out set, curves): l4 = the shipped 4 layers, l6 = grown to 6 layers
#      (zero output projections, so step 0 = shipped); fresh AdamW moments, a new cycle:
#      warm-up 50 steps to PEAK (2e-4), cosine to PEAK/10 timed to end with the budget;
#      held-out τ̂ before / every 400 steps / after;
#   3. in-process acceptance (bf16, graphs, 8+8 prompts, 64 tokens, chain + tree@64) for the
#      shipped, l4 and l6 drafters.
# Carry: .devcarry/whl .devcarry/h7 (shards 195611-000 + 223702-001, lineage.json = session-5 state.json, prompts.npz, eval_texts.json.gz: 19.4 MiB).
# Returns (≤ 6 files, ≤ 58 MiB): $OUT/ckpt/model-*.safetensors (best run by final τ̂ on the first
# 64 response tokens, published layout, shards ≤ 15 MiB), $OUT/shard-<tag>-*.npz (the new data),
# $OUT/small.tgz (train.log, ckpt/*.json, state/{state.json,state.part000}: the light training
# state — no weights, no moments — and the session record with every run's curves and the
# acceptance table).
# From a snapshot (scripts/device_snapshot.sh REV, carried as .devcarry/clean): cd .devcarry/clean &&
#   ln -sfn ../../checkpoints checkpoints && DC=.. bash scripts/device_train.sh
# Evaluation (a follow-up call on the same warm machine, ≤ 150 s): bash scripts/device_train.sh eval
#   → $OUT/acceptance_services_h200_s7.{md,json} (shipped vs l4 vs l6 through the services, T=0/1) + eval_logs.tgz;
#   EVAL_SHIPPED_ONLY=1: the shipped drafter alone when no trained exports are on the machine (a fresh one);
#   EVAL_MODES (default chain,tree@64), EVAL_N (16).
# CPU dry run (minutes on a loaded 2-core VM; tiny budgets): OUT=/tmp/d7/out W=/tmp/d7/w GGUF=<local gguf> CPU_TEST=1 bash scripts/device_train.sh
set -u
T0=$(date +%s)
LIMIT=${LIMIT:-350}          # seconds for the whole call (timeout of the python step below)
GGUF=${GGUF:-/tmp/specdec/model.gguf}
W=${W:-/tmp/specdec/h7}      # work dir (data, exports, every run's light state stay here)
DC=${DC:-.devcarry}          # the carried folder (DC=.. when run inside a .devcarry/clean snapshot)
PEAK=${PEAK:-2e-4}
GEN_MIN=${GEN_MIN:-0.75}
mkdir -p "$OUT" "$W/data"
if [ "${1:-}" = eval ]; then  # follow-up call on the same warm machine: shipped vs both trained drafters through the services
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$DC"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_EVAL_TEXTS=$(realpath "$DC")/h7/eval_texts.json.gz
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF"; exit 3; }
    D="shipped=$PWD/checkpoints/dflash-smollm2-135m"
    for r in l4 l6; do [ -f "$W/export-$r/config.json" ] && D="$D,$r=$W/export-$r"; done
    echo "drafters: $D"
    case $D in *,*) ;; *) [ -n "${EVAL_SHIPPED_ONLY:-}" ] || { echo "no trained exports in $W (the training call did not run on this machine)"; exit 3; };; esac
    timeout -k 5 "${EVAL_LIMIT:-150}" python3 -m bench.acceptance_services --drafters "$D" --n "${EVAL_N:-16}" --max-new 64 \
        --modes "${EVAL_MODES:-chain,tree@64}" --temperatures 0,1 --gguf "$GGUF" --worker-flags "${EVAL_FLAGS:---device cuda --dtype bfloat16}" \
        --where "one H200, bf16, CUDA graphs, services on loopback over gRPC" --log-dir "$OUT/eval_logs" \
        --out "$OUT/acceptance_services_h200_s7"
    echo "eval rc=$?"
    (cd "$OUT" && tar czf eval_logs.tgz eval_logs && rm -rf eval_logs)
    exit 0
fi
cp -n "$DC"/h7/data/shard-*.npz "$W/data/" 2>/dev/null
if [ -z "${CPU_TEST:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$DC"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    [ -f "$GGUF" ] || { echo "no GGUF at $GGUF (run scripts/device_run.sh K for K=0,1,2 first)"; ls -la /tmp/specdec; exit 3; }
    EXTRA=(--warmup-steps 50 --minutes "$(python3 -c "print(($LIMIT - 15) / 60)")" --gen-minutes "$GEN_MIN" --gen-batch 2048
           --train-minutes 6 --eval-every 400 --accept-n 8 --accept-max-new 64 --reserve 45)
else  # CPU: the same control flow in seconds (tiny generation, 3 steps, 1 held-out sequence)
    export PYTHONPATH=$PWD
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d['meta']['loop']['eval_ids'] = d['meta']['loop']['eval_ids'][:1]; json.dump(d, open(sys.argv[2], 'w'))" "$DC"/h7/lineage.json "$W/lineage-cpu.json"
    LINEAGE=$W/lineage-cpu.json
    EXTRA=(--warmup-steps 2 --minutes 60 --gen-minutes 0.01 --gen-batch 4 --max-new 8 --max-steps 3 --batch-seqs 2 --train-minutes 50 --eval-every 2
           --accept-n ${CPU_ACCEPT_N:-1} --accept-max-new 8 --timing-warmup 1 --timing-steps 1)
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 SPECDEC_EVAL_TEXTS=$(realpath "$DC")/h7/eval_texts.json.gz
LEFT=$((LIMIT - 8 - ($(date +%s) - T0)))
[ "$LEFT" -gt 30 ] || { echo "train: only ${LEFT} s of LIMIT=${LIMIT} left after set-up (wheel install?): not starting"; exit 4; }
timeout -k 5 "$LEFT" python3 -m training.device_session --out "$OUT" --work "$W" \
    --gguf "$GGUF" --data "$W/data" --prompts "$DC"/h7/prompts.npz --gen-rounds 1 --gen-skip-base --gen-seed 1 \
    --lineage "${LINEAGE:-$DC/h7/lineage.json}" --runs 'l4=L4B8/kl0.5/bf16/shipped;l6=L6B8/kl0.5/bf16/grow' \
    --cycle --lr "$PEAK" --timing-warmup 20 --timing-steps 60 --trim-loops 16 --light-state \
    "${EXTRA[@]}" 2>&1 | tee "$OUT/train.log"
echo "train rc=${PIPESTATUS[0]}" | tee -a "$OUT/train.log"
# small files into one archive (the link returns 8 files): logs, the checkpoint's json, the light state
(cd "$OUT" && tar czf small.tgz train.log $(ls ckpt/*.json 2>/dev/null) state session.json 2>/dev/null; \
 rm -rf train.log ckpt/*.json state session.json)
ls -la "$OUT" "$OUT/ckpt" 2>/dev/null
echo "call took $(($(date +%s) - T0)) s"
