#!/usr/bin/env bash
# On the device (carry .devcarry/whl): the grouped MoE's GPU tests and timings in one call (session 18). Writes under
# $OUT: pytest.txt (specdec_kernels.moe incl. the one-launch expert sort and CUDA-graph capture, the row-invariant linear,
# the DeepSeek fast path and bf16 pipeline), moe_kernel_h200{_s18,_tp8_s18,_tp8_fp8_s18}.{md,json}
# (bench.moe_kernel: full width, a TP8 rank's slices, FP8 weights) and kimi_layer.{md,json} (the layer bench, both widths).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${TEST_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_moe.py \
  tests/kernels/test_kernel_ops.py tests/kernels/test_deepseek_fast.py tests/modeling/test_deepseek_pipeline.py \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
for args in "--inter 2048 --tag _s18" "--inter 256 --tag _tp8_s18" "--inter 256 --fp8 --tag _tp8_fp8_s18"; do
  timeout "${MOE_S:-80}" python3 -m bench.moe_kernel $args --reps 10 --out "$OUT" > /dev/null 2>&1; echo "moe $args rc=$?"
done
timeout "${LAYER_S:-150}" python3 -m bench.mla_kernel --layer-only --layer-widths tp8,full \
  --linear-tiles bench/results/kernel_tiles_kimi_tp8_split.json --out /tmp/layer > "$OUT/layer.log" 2>&1
echo "layer rc=$?"; cp /tmp/layer/mla_kernel_h200.md "$OUT/kimi_layer.md"; cp /tmp/layer/mla_kernel_h200.json "$OUT/kimi_layer.json"
grep -h "^| [0-9]" "$OUT"/moe_kernel_h200*.md | cut -c1-140
grep -h "^| TP8\|^| full" "$OUT/kimi_layer.md"; grep "GPU µs" "$OUT/kimi_layer.md" | cut -c1-900
