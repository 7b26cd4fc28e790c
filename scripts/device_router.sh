#!/usr/bin/env bash
# On the device (carry .devcarry/whl), session 19: the float32 router's blockings (bench.router_kernel),
# then, under the best one (SPECDEC_ROUTER_BLOCKS), the router and DeepSeek fast-path GPU tests and the
# Kimi-K2 layer bench. Writes under $OUT: router_kernel_h200.{md,json}, pytest.txt, layer.{md,json,log}.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 150 python3 -m bench.router_kernel --out "$OUT" > /tmp/router.log 2>&1; echo "router bench rc=$?"
sed -n '/^| blocking/,$p' "$OUT/router_kernel_h200.md"
BEST=$(grep -o "ROUTER_BEST=.*" /tmp/router.log | cut -d= -f2)
[ -n "$BEST" ] && [ "$BEST" != None ] && export SPECDEC_ROUTER_BLOCKS=$BEST
echo "SPECDEC_ROUTER_BLOCKS=${SPECDEC_ROUTER_BLOCKS:-default}"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_router.py tests/kernels/test_deepseek_fast.py \
  tests/modeling/test_deepseek_pipeline.py > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"; tail -1 "$OUT/pytest.txt"
timeout 150 python3 -m bench.mla_kernel --layer-only --layer-widths tp8,full \
  --linear-tiles bench/results/kernel_tiles_kimi_tp8_split.json --out /tmp/layer > "$OUT/layer.log" 2>&1
echo "layer rc=$?"; cp /tmp/layer/mla_kernel_h200.md "$OUT/layer.md"; cp /tmp/layer/mla_kernel_h200.json "$OUT/layer.json"
grep -h "^| TP8\|^| full" "$OUT/layer.md"; grep "GPU µs" "$OUT/layer.md" | tr ';' '\n' | grep -h "router\|_linear\|split_sum"
