#!/usr/bin/env bash
# Session-5 shared device call of issue 9 (plans/0008 "Session 5"), on an nvidia-h200-x2, run from
# the repository root after the GGUF staging calls (scripts/device_run.sh K) and the three state
# staging calls:
#   GPU 1: continue the `kl` lineage (step 6,079) on all three shards, --replan (annealed this call),
#          7.5 train minutes, on-device acceptance new vs shipped; state back in $OUT/h4 (+ a return call).
#   GPU 0: tau against context length and language (bench.acceptance_context, T=0 and T=1), then
#          block 16 / 6 layers from scratch in lock-step with a 4-layer block-8 control, same data,
#          for the seconds left.
# Needs on the machine: /tmp/specdec/model.gguf, /tmp/specdec/h4/state/{state.json,state.part000-005},
# /tmp/specdec/h4/eval_texts.json.gz, /tmp/specdec/h4/data/shard-20261130223702-001.npz (staged);
# carried: .devcarry/whl and the other two shards. Returns $OUT/h4/{train.log,state.json,state.part000-002}
# and $OUT/hf_gpu0.tgz: 6 files, ~49 MiB. Whole call <= LIMIT + ~5 s (tar).
# Dry run of the control flow (no GPU): mkdir -p /tmp/d/h4/state && touch /tmp/d/g /tmp/d/h4/state/state.json &&
#   cp .devcarry/h4/data/*.npz /tmp/d/h4/data/ && OUT=/tmp/d/out W=/tmp/d/h4 GGUF=/tmp/d/g PY="echo python3" bash training/device_s5.sh
set -u
T0=$(date +%s)
PY=${PY:-python3}
LIMIT=${LIMIT:-545}
GGUF=${GGUF:-/tmp/specdec/model.gguf}
W=${W:-/tmp/specdec/h4}  # the kl lineage's work dir; the variants use ${W}v
left() { echo $((LIMIT - ($(date +%s) - T0))); }
mkdir -p "$OUT/h4" "$OUT/hf" $W/data
cp -n .devcarry/h4/data/shard-*.npz $W/data/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-h4 .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site-h4:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 SPECDEC_EVAL_TEXTS=$W/eval_texts.json.gz
ok=1
{ [ -f $GGUF ] && [ -f $W/state/state.json ] && [ "$(ls $W/data/shard-*.npz | wc -l)" = 3 ]; } || ok=0
[ $ok = 1 ] || { echo "staged files missing:"; ls -la /tmp/specdec $W $W/state $W/data; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader 2>/dev/null

(   # GPU 1: the kl lineage
    [ $ok = 1 ] || exit 3
    export CUDA_VISIBLE_DEVICES=1
    timeout -k 5 "$(left)" $PY -m training.device_session --out "$OUT/h4" --gguf $GGUF --minutes 8.7 \
        --train-minutes 7.5 --replan --lr 8e-4 --trim-loops 16 --eval-every 500 --accept-n 8 \
        --accept-max-new 64 --return-files 4 --return-mib 50
    echo "h4 rc=$?"
) > "$OUT/h4/train.log" 2>&1 &
H4=$!

(   # GPU 0: context/language bench, then the architecture variants
    [ $ok = 1 ] || exit 3
    export CUDA_VISIBLE_DEVICES=0
    timeout -k 5 110 $PY -m bench.acceptance_context --device cuda --gguf $GGUF --n 8 --max-new 128 \
        --modes chain,tree@16,tree@64 --out "$OUT/hf/acceptance_context_h200"
    echo "ctx T=0 rc=$?"
    timeout -k 5 70 $PY -m bench.acceptance_context --device cuda --gguf $GGUF --n 8 --max-new 128 \
        --modes chain,tree@64 --temperature 1 --out "$OUT/hf/acceptance_context_h200_t1"
    echo "ctx T=1 rc=$?"
    R=$(left)
    echo "variants: $R s left"
    if [ "$R" -gt 150 ]; then
        timeout -k 5 "$R" $PY -m training.device_session --out "$OUT/hf/v" --work ${W}v --gguf $GGUF \
            --data $W/data --minutes "$(python3 -c "print(($R - 8) / 60)")" \
            --train-minutes "$(python3 -c "print(($R - 70) / 60)")" --replan --trim-loops 16 --eval-every 250 \
            --runs 'l4b8=L4B8/kl0.5/bf16/scratch;l6b8=L6B8/kl0.5/bf16/scratch;l4b16=L4B16/kl0.5/bf16/scratch' \
            --return-files 1 --return-mib 6
        echo "variants rc=$?"
    fi
) > "$OUT/hf/gpu0.log" 2>&1 &
G0=$!

wait $H4 $G0
cp ${W}v/state-final/state.json "$OUT/hf/variants_state.json" 2>/dev/null
tar czf "$OUT/hf_gpu0.tgz" -C "$OUT" hf && rm -rf "$OUT/hf"
ls -la "$OUT" "$OUT/h4"
tail -4 "$OUT/h4/train.log"
echo "call took $(($(date +%s) - T0)) s"
