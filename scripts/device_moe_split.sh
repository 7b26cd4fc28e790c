#!/usr/bin/env bash
# On the device (carry .devcarry/whl): split-K for the grouped MoE experts (session 18). Writes under $OUT:
# pytest.txt (GPU tests of specdec_kernels.moe, the row-invariant linear, the DeepSeek fast path and bf16 pipeline),
# moe_sweep_h200_{tp8_,}split.{md,json} (bench.moe_kernel --split: each projection over BN × split-K count at a
# TP8 rank's slices, I 256, and at full width, I 2048) and layer{0,1}/ (bench.mla_kernel --layer-only at a TP8
# rank: without, then with the sweeps' best counts in specdec_kernels.moe.MOE_SPLIT; LAYER_WIDTHS for both widths).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${TEST_S:-200}" python3 -m pytest -q -rs -p no:cacheprovider --durations=5 tests/kernels/test_moe.py \
  tests/kernels/test_kernel_ops.py tests/kernels/test_deepseek_fast.py tests/modeling/test_deepseek_pipeline.py \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -2; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
timeout "${SWEEP_S:-150}" python3 -m bench.moe_kernel --split --inter 256 --reps 10 --tag _tp8_split --out "$OUT" \
  > "$OUT/sweep_tp8.log" 2>&1; echo "sweep tp8 rc=$?"
SPLITS="$OUT/moe_sweep_h200_tp8_split.json"
if [ "${FULL_SWEEP_S:-150}" != 0 ]; then
  timeout "${FULL_SWEEP_S:-150}" python3 -m bench.moe_kernel --split --inter 2048 --reps 10 --tag _split --out "$OUT" \
    > "$OUT/sweep_full.log" 2>&1; echo "sweep full rc=$?"; SPLITS="$SPLITS,$OUT/moe_sweep_h200_split.json"
fi
TILES=bench/results/kernel_tiles_kimi_tp8_split.json
timeout "${LAYER_S:-100}" python3 -m bench.mla_kernel --layer-only --layer-widths tp8 --linear-tiles "$TILES" \
  --out "$OUT/layer0" > "$OUT/layer0.log" 2>&1; echo "layer (unsplit experts) rc=$?"
timeout "${LAYER_S:-100}" python3 -m bench.mla_kernel --layer-only --layer-widths "${LAYER_WIDTHS:-tp8}" \
  --linear-tiles "$TILES" --moe-split "$SPLITS" --out "$OUT/layer1" > "$OUT/layer1.log" 2>&1
echo "layer (split experts) rc=$?"
for f in "$OUT"/moe_sweep_h200*split.md; do grep "^|" "$f" | head -8; done
grep MOE_SPLIT "$OUT/layer1.log"
grep -h "^| TP8\|^| full" "$OUT"/layer0/mla_kernel_h200.md "$OUT"/layer1/mla_kernel_h200.md
