#!/usr/bin/env bash
# On the device (carry .devcarry/whl), session 19: the grouped MoE's GPU tests (incl. the one-launch expert sort),
# then the Kimi-K2 layer bench twice in one call — the expert sort as torch ops (specdec_kernels.moe.SMALL_PAIRS 0) and in
# one launch (the default) — both widths. Writes under $OUT: pytest.txt, layer_{torch,one}.{md,json}.
# SORT=1: the expert sort's tests and bench.moe_kernel --sort (torch ops vs one launch, 64–4096 pairs) instead of
# the GPU tests, then the layer A/B.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
if [ "${SORT:-0}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe.py -k "tiles or sort" > "$OUT/pytest_sort.txt" 2>&1
  echo "pytest sort rc=$?"; tail -1 "$OUT/pytest_sort.txt"
  timeout 200 python3 -m bench.moe_kernel --sort --reps 20 --out "$OUT" > "$OUT/sort.log" 2>&1; echo "sort rc=$?"
  cat "$OUT/moe_sort_h200.md"
else
  timeout "${TEST_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_moe.py \
    tests/kernels/test_kernel_ops.py tests/kernels/test_router.py tests/kernels/test_deepseek_fast.py tests/modeling/test_deepseek_pipeline.py \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
fi
[ "${LAYER:-1}" = 0 ] && exit 0  # LAYER=0: the tests only
# MODES: torch (the expert sort as torch ops), one (the default), linear_router (the router through
# specdec_kernels.matmul.linear with session 17's tiling, as before session 19's specdec_kernels.router)
for mode in ${MODES:-torch one}; do
  small=0; [ "$mode" != torch ] && small=m.SMALL_PAIRS
  timeout "${LAYER_S:-150}" python3 -c "
import sys, specdec_kernels.moe as m, bench.mla_kernel as b, modeling.deepseek_fast as f
from specdec_kernels.matmul import linear
m.SMALL_PAIRS = $small
if '$mode' == 'linear_router':
    f._router_logits = lambda self, x: linear(x.float(), self.gate.weight.float(), tiles=(16, 64, 256, 4, 3, 14))
b.main(['--layer-only', '--layer-widths', 'tp8,full', '--linear-tiles',
        'bench/results/kernel_tiles_kimi_tp8_split.json', '--out', '/tmp/layer_$mode'])
" > "$OUT/layer_$mode.log" 2>&1
  echo "layer $mode rc=$?"
  cp /tmp/layer_$mode/mla_kernel_h200.md "$OUT/layer_$mode.md"; cp /tmp/layer_$mode/mla_kernel_h200.json "$OUT/layer_$mode.json"
  grep -h "^| TP8\|^| full" "$OUT/layer_$mode.md"
done
