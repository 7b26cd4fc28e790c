#!/usr/bin/env bash
# Session 26's plan for the H200 (plans/0009 "Session 26"), after the GGUF's part calls (`bash scripts/device_run.sh K`,
# K = 0..N-1) on the same warm machine; carry .devcarry/whl, .devcarry/grpcwhl (with py-spy), .devcarry/h4. To $OUT.
#   [RUN=tag] bash scripts/device_s26.sh gap — the same-shape gap at c = 64: tree@16, adaptive@16 (the adaptive policy
#                 capped at 16: identical shapes) and adaptive × 4 interleaved repeats, every service recorded by py-spy
#                 over every cell (--py-spy; the profiles come back as $OUT/spy.tgz: $OUT returns at most 8 files);
#                 here: tar xzf spy.tgz -C DIR && python -m bench.spy concurrency_h200_<tag>_gap.json --spy-dir DIR
#                 --c 64 --a tree@16 --b adaptive@16 [--service target|draft]   (~130 s); the services' logs (the
#                 planner's "plan" lines) come back as $OUT/logs.tgz; FLAGS: the orchestrator's flags (default
#                 "--steps off"; session 27: FLAGS="--steps off --adaptive-learn off", no trials: the cap alone)
#   [RUN=tag] bash scripts/device_s26.sh learn — c = 64, tree@16 and adaptive × 5, the planner's learning on, off, on
#                 (three runs, one lease: concurrency_h200_<tag>_learn_{on1,off,on2}.*; ~400 s)
#   then, for the pool of leases (bench.concurrency_pool; each lease counted once): RUN=s26 bash scripts/device_s25.sh
#   low|high (the rule run's configurations, ~300 s each)
set -eo pipefail
source scripts/device_env.sh
case "$1" in
gap)
  timeout -s TERM 400 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,adaptive@16,adaptive --repeat 4 \
    --concurrency 64 --tag "h200_${RUN:-s26}_gap" --orchestrator-flags "${FLAGS:---steps off}" --py-spy /tmp/spy \
    --log-dir /tmp/gaplogs \
    --note "${NOTE:-session 26 plan: the same-shape gap at c = 64 with py-spy on every service}" 2>&1 | grep "c="
  tar czf "$OUT/spy.tgz" -C /tmp/spy .
  tar czf "$OUT/logs.tgz" -C /tmp/gaplogs . ;;
learn)  # session 27: does the planner's learning cost at c = 64? on / off / on, one lease, tree@16 and adaptive × 5 (~400 s)
  for L in on1 off on2; do
    timeout -s TERM 180 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,adaptive --repeat 5 \
      --concurrency 64 --tag "h200_${RUN:-s27}_learn_$L" --orchestrator-flags "--steps off --adaptive-learn ${L%[12]}" \
      --note "session 27: the planner's learning ${L%[12]} at c = 64 (an on/off/on sequence on one lease)" 2>&1 | grep "c="
  done ;;
*) echo "usage: device_s26.sh gap|learn"; exit 2 ;;
esac
