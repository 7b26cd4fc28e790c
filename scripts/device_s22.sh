#!/usr/bin/env bash
# Session 22 on the H200, after the GGUF's part calls (`bash scripts/device_run.sh K`, K = 0..3) on the
# same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   [RUN=tag] bash scripts/device_s22.sh steps — A/B of the Steps stream (--steps off, then on), one orchestrator process,
#                                          AR / tree@16 / adaptive at c = 1, 4, 16, 64
#   [RUN=tag] bash scripts/device_s22.sh steps4 — the same A/B with --processes 4 at c = 16, 64, two repeats
#   bash scripts/device_s22.sh fit       — every fixed shape and adaptive with --steps on, c = 1, 4, 16, 64: the cells
#                                          that `python -m bench.cost_table --fit-concurrency` fits a cost model to
set -eo pipefail
source scripts/device_env.sh
case "$1" in
steps)
  for s in off on; do
    timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
      --concurrency 1,4,16,64 --tag "h200_${RUN:-s22}_steps_$s" --orchestrator-flags "--steps $s" \
      --note "session 22: orchestrator --steps $s (one process)" 2>&1 | grep "c="
  done ;;
steps4)
  for s in off on; do
    timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive --repeat 2 \
      --concurrency 16,64 --channel-per-stream --tag "h200_${RUN:-s22}_steps4_$s" --orchestrator-flags "--processes 4 --steps $s" \
      --note "session 22: --processes 4 --steps $s, a connection per stream" 2>&1 | grep "c="
  done ;;
fit)
  timeout -s TERM 290 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,chain,tree@4,tree@16,tree@64,adaptive \
    --concurrency 1,4,16,64 --tag h200_s22_steps_fit --orchestrator-flags "--steps on" \
    --note "session 22: --steps on (one process), every fixed shape: the cost model's fit" 2>&1 | grep "c=" ;;
esac
