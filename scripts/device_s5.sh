#!/usr/bin/env bash
# Session-5 issue-14 device jobs on one H200, from the repository root after the three GGUF calls
# (`bash scripts/device_run.sh K`: installs .devcarry/whl into /tmp/site and leaves
# /tmp/specdec/model.gguf). Carry: .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4/eval_texts.json.gz.
# Usage: bash scripts/device_s5.sh JOB... with JOB one of
#   tests        the GPU tests of tests/kernels (batched verify/draft, paged KV, fast path, MLA); TESTS_S caps them (240 s)
#   concurrency  bench.concurrency: c = 1, 4, 16, 64 × AR, chain, tree@4/16/64, adaptive
#   batch_costs  bench.batch_costs (verify_batch vs b solo calls; paged vs contiguous kernel)
#   fast_path    bench.gpu_fast_path (batch-1 throughput per mode, drafter in the tree)
#   invariance   bench.batch_invariance (batched vs solo greedy, lock-step / staggered / threaded)
#   invariance_unfixed  the same without the TreeInputs copy-event wait (A/B of the race fix)
#   prefill      bench.prefill_interleave: ITL of 16 tree@16 streams while 2k/8k prompts arrive,
#                --step-tokens 512 vs none (session 6)
#   protocol     scripts/device_protocol.sh quick (stub workers: gRPC vs the data channel; carry
#                also .devcarry/tokenizer and .devcarry/protobase)
# (session 6: bench.concurrency runs the workers' data channel by default, as deploy.local does)
# run one after another, each bounded by what is left of LIMIT seconds; logs tarred into $OUT.
set -u
T0=$(date +%s)
LIMIT=${LIMIT:-560}
left() { echo $((LIMIT - ($(date +%s) - T0))); }
[ -f /tmp/specdec/model.gguf ] || { echo "GGUF not staged"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devcarry/grpcwhl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_GGUF=/tmp/specdec/model.gguf \
       SPECDEC_EVAL_TEXTS=$PWD/.devcarry/h4/eval_texts.json.gz
REV=${REV:-$(git rev-parse --short HEAD 2>/dev/null || echo worktree)}
CONC_FLAGS=${CONC_FLAGS:-}
mkdir -p $OUT/logs
for job in "$@"; do
    t=$(( $(left) - 10 )); [ $t -gt 20 ] || { echo "$job: no time left"; continue; }
    log=$OUT/logs/$job.log
    case $job in
    tests) TS=${TESTS_S:-240}; timeout -k 5 $(( t < TS ? t : TS )) python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels \
               tests/kernels > $log 2>&1 ;;
    concurrency) timeout -s TERM -k 5 $t python3 -m bench.concurrency --seconds 8 --warmup 2 --streams-per-client 8 \
               --tag h200 --out-dir $OUT --worker-flags "--device cuda --dtype bfloat16 --graphs --max-batch 64" \
               --note "one H200, code $REV" $CONC_FLAGS > $log 2>&1 ;;
    batch_costs) timeout -s TERM -k 5 $t python3 -m bench.batch_costs --rounds 10 --tag h200 > $log 2>&1 ;;
    fast_path) timeout -s TERM -k 5 $t python3 -m bench.gpu_fast_path --gguf /tmp/specdec/model.gguf \
               --prompts-file .devcarry/prompts.json --out $OUT > $log 2>&1 ;;
    invariance) timeout -s TERM -k 5 $t python3 -m bench.batch_invariance --model /tmp/specdec/model.gguf \
               --tag h200 > $log 2>&1 ;;
    invariance_unfixed) timeout -s TERM -k 5 $t python3 -m bench.batch_invariance --model /tmp/specdec/model.gguf \
               --unfixed --tag h200_unfixed \
               --scenarios stagger_ar,threads_ar16,threads_ar64,threads_tree16_64 > $log 2>&1 ;;
    prefill) timeout -s TERM -k 5 $t python3 -m bench.prefill_interleave --device cuda --streams 16 --tree 16 \
               --long 2048,7936,2048,7936 --budgets 512,0 --model /tmp/specdec/model.gguf --out $OUT/prefill_interleave_h200.md > $log 2>&1 ;;
    protocol) timeout -s TERM -k 5 $t bash scripts/device_protocol.sh quick > $log 2>&1 ;;
    *) echo "unknown job $job" > $log ;;
    esac
    echo "$job rc=$? at +$(( $(date +%s) - T0 )) s" | tee -a $log
    tail -40 $log
done
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
ls -la $OUT
echo "call took $(($(date +%s) - T0)) s"
