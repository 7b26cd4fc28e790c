#!/usr/bin/env bash
# On the device (carry .devcarry/whl and .devcarry/deepseek_fast_s19.py = `git show ce54646:modeling/deepseek_fast.py`),
# session 20: the DeepSeek/Kimi row-invariant path's GPU tests (incl. kernels.mla_project and session 19's
# argument checks, which had run in the interpreter only), then the Kimi-K2 layer bench once per mode, both widths:
# s19 = session 19's modeling/deepseek_fast.py (MLA epilogue as ~17 torch ops, shared expert as two projections,
# a cat and an add), s20 = the working tree's (kernels.mla_project, stacked gate/up, the routed sum as the shared
# down projection's residual). Writes under $OUT: pytest.txt, layer_{mode}.{md,json,log}.  LAYER=0: tests only.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
timeout "${TEST_S:-200}" python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_mla_project.py tests/kernels/test_moe.py \
  tests/kernels/test_kernel_ops.py tests/kernels/test_router.py tests/kernels/test_deepseek_fast.py \
  tests/modeling/test_deepseek_pipeline.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
[ "${LAYER:-1}" = 0 ] && exit 0
for mode in ${MODES:-s20 s19}; do
  timeout "${LAYER_S:-150}" python3 -c "
import importlib.util, sys
if '$mode' == 's19':
    spec = importlib.util.spec_from_file_location('modeling.deepseek_fast', '.devcarry/deepseek_fast_s19.py')
    mod = importlib.util.module_from_spec(spec); sys.modules['modeling.deepseek_fast'] = mod; spec.loader.exec_module(mod)
import bench.mla_kernel as b
b.main(['--layer-only', '--layer-widths', 'tp8,full', '--linear-tiles',
        'bench/results/kernel_tiles_kimi_tp8_split.json', '--out', '/tmp/layer_$mode'])
" > "$OUT/layer_$mode.log" 2>&1
  echo "layer $mode rc=$?"
  cp /tmp/layer_$mode/mla_kernel_h200.md "$OUT/layer_$mode.md"; cp /tmp/layer_$mode/mla_kernel_h200.json "$OUT/layer_$mode.json"
  grep -h "^| TP8\|^| full" "$OUT/layer_$mode.md"
done
