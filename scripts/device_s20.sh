#!/usr/bin/env bash
# On the device (carry .devcarry/whl and .devcarry/deepseek_fast_s19.py = `git show ce54646:modeling/deepseek_fast.py`),
# session 20: (1) the linear tiling sweep of the shared expert's stacked gate/up shape (512, 7168) at a Kimi-K2 TP8
# rank, its winner merged into a copy of bench/results/kernel_tiles_kimi_tp8_split.json ($OUT/tiles_s20.json);
# (2) the Kimi-K2 layer bench once per mode, both widths: s19 = session 19's modeling/deepseek_fast.py (MLA
# epilogue as ~17 torch ops, shared expert as two projections, a cat and an add), s20 = the working tree's
# (specdec_kernels.mla_project, stacked gate/up, the routed sum as the shared down projection's residual);
# (3) the DeepSeek/Kimi row-invariant path's GPU tests. MODES: names; a mode with a carried
# .devcarry/deepseek_fast_<mode>.py runs that file as modeling.deepseek_fast (s19 = ce54646's, s20a = fab7078's: the
# block-diagonal absorption), any other name the working tree's. Writes under $OUT: tiles_s20.json, layer_{mode}.{md,json,log},
# pytest.txt.  LAYER=0: tests only.  SWEEP=0: no sweep (the committed table).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
TILES=bench/results/kernel_tiles_kimi_tp8_split.json
if [ "${SWEEP:-1}" = 1 ] && [ "${LAYER:-1}" = 1 ]; then
  timeout 150 python3 -c "
import json
from bench.kernel_tiles import KIMI_M, sweep_linear
best, table = sweep_linear({(512, 7168): KIMI_M}, split=True)
print('best', best)
d = json.load(open('$TILES'))
for (n, k), t in best.items():
    d['linear'][f'{n},{k}'] = list(t)
d.setdefault('linear_all', {}).update({f'{n},{k}': v for (n, k), v in table.items()} if isinstance(table, dict) else {})
json.dump(d, open('$OUT/tiles_s20.json', 'w'))
" > "$OUT/sweep.log" 2>&1 && TILES_S20=$OUT/tiles_s20.json; echo "sweep rc=$?"; grep best "$OUT/sweep.log"
fi
if [ "${LAYER:-1}" = 1 ]; then
for mode in ${MODES:-s20 s19}; do
  tiles=$TILES; [ "$mode" = s20 ] && tiles=${TILES_S20:-$TILES}
  timeout "${LAYER_S:-150}" python3 -c "
import importlib.util, os, sys
old = '.devcarry/deepseek_fast_$mode.py'  # an earlier modeling/deepseek_fast.py (carried), else the working tree's
if os.path.exists(old):
    spec = importlib.util.spec_from_file_location('modeling.deepseek_fast', old)
    mod = importlib.util.module_from_spec(spec); sys.modules['modeling.deepseek_fast'] = mod; spec.loader.exec_module(mod)
    if not hasattr(mod, 'moe_loop'):
        from modeling.deepseek import MoE
        mod.moe_loop = MoE.forward  # (session 19: the routed loop + the shared module's forward)
import bench.mla_kernel as b
b.main(['--layer-only', '--layer-widths', 'tp8,full', '--linear-tiles', '$tiles', '--out', '/tmp/layer_$mode'])
" > "$OUT/layer_$mode.log" 2>&1
  echo "layer $mode rc=$? tiles $tiles"
  cp /tmp/layer_$mode/mla_kernel_h200.md "$OUT/layer_$mode.md"; cp /tmp/layer_$mode/mla_kernel_h200.json "$OUT/layer_$mode.json"
  grep -h "^| TP8\|^| full" "$OUT/layer_$mode.md"
done
fi
TESTS=${TESTS:-"tests/kernels/test_mla_project.py tests/kernels/test_moe.py tests/kernels/test_moe_inputs.py
  tests/kernels/test_kernel_ops.py tests/kernels/test_router.py tests/kernels/test_deepseek_fast.py tests/modeling/test_deepseek_pipeline.py"}
timeout "${TEST_S:-200}" python3 -m pytest -q -rs -p no:cacheprovider $TESTS > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
