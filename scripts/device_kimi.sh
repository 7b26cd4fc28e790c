#!/usr/bin/env bash
# On the device (carry .devcarry/whl): the DeepSeek / Kimi-K2 GPU checks and layer timings in one call
# (session 17). Writes under $OUT: pytest.txt (the GPU tests of the MLA kernel with page tables, the
# grouped experts, the row-invariant linear incl. split-K, the DeepSeek fast path eager and from CUDA
# graphs, the bf16 pipeline, the one-GPU service), kernel_tiles_kimi_tp8_split.json (split-K sweep at a
# Kimi-K2 TP8 rank's weights and the fp32 router) and layer/ (bench.mla_kernel --layer-only with the
# sweep's winners, a TP8 rank and full width). Each step has its own time limit; the table is last.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
# the one-GPU service test needs our grpcio set (carry .devcarry/grpcwhl too; skipped without it)
[ -d .devcarry/grpcwhl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .devcarry/grpcwhl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${TEST_S:-300}" python3 -m pytest -q -rs -p no:cacheprovider --durations=8 \
  tests/kernels/test_mla_batch.py tests/kernels/test_mla_attention.py tests/kernels/test_mla_prefix.py \
  tests/kernels/test_moe.py tests/kernels/test_kernel_ops.py tests/kernels/test_deepseek_fast.py \
  tests/modeling/test_deepseek_pipeline.py tests/modeling/test_deepseek_service.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3
# SWEEP_S=0: no sweep; the layer then takes the committed sweep's tiles
TILES=bench/results/kernel_tiles_kimi_tp8_split.json
if [ "${SWEEP_S:-150}" != 0 ]; then
  timeout "${SWEEP_S:-150}" python3 -m bench.kernel_tiles --kimi-tp8 --split --out "$OUT" > "$OUT/split_sweep.md" 2>&1
  echo "sweep rc=$?"; TILES="$OUT/kernel_tiles_kimi_tp8_split.json"
fi
timeout "${LAYER_S:-120}" python3 -m bench.mla_kernel --layer-only --layer-widths "${LAYER_WIDTHS:-tp8,full}" \
  --linear-tiles "$TILES" --out "$OUT/layer" > "$OUT/layer.log" 2>&1
echo "layer rc=$?"
grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head -10
[ -f "$OUT/split_sweep.md" ] && grep "^|" "$OUT/split_sweep.md" | head -16
grep "^|" "$OUT/layer/mla_kernel_h200.md" | tail -8
