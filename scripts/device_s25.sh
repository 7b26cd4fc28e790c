#!/usr/bin/env bash
# Session 25 on the H200, after the GGUF's part calls (`bash scripts/device_run.sh K`, K = 0..4) on the
# same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   [RUN=tag] bash scripts/device_s25.sh low|high — issue 14's decisive run (plans/0009 "Session 25"): --steps off,
#                 autoregressive once, chain / tree@4 / tree@16 / tree@64 / adaptive × 3 interleaved repeats, at
#                 c = 1, 4 (low) or c = 16, 64 (high); one call each (a call runs at most 600 s)
#   [RUN=tag] bash scripts/device_s25.sh c16|c64 — the same at c = 16 alone (3 repeats, ~170 s) or c = 64 alone with
#                 5 repeats (~290 s): the rule's c = 64 cells drift by ~20 % on some leases, three repeats were too few
#   [RUN=tag] bash scripts/device_s25.sh c1 — c = 1 only: tree@16 / tree@64 / adaptive × 3 repeats, the services' logs
#                 (the planner's "plan" lines) to $OUT/logs
set -eo pipefail
source scripts/device_env.sh
if [ "$1" = c1 ]; then
  timeout -s TERM 300 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,tree@64,adaptive --repeat 3 \
    --concurrency 1 --tag "h200_${RUN:-s25}_c1" --orchestrator-flags "--steps off" --log-dir "$OUT/logs" \
    --note "${NOTE:-session 25: c = 1, why adaptive plans tree@16}" 2>&1 | grep "c="
  exit 0
fi
R=3
case "$1" in
low) C=1,4 ;;
high) C=16,64 ;;
c16) C=16 ;;
c64) C=64 R=5 ;;
*) echo "usage: device_s25.sh low|high|c16|c64|c1"; exit 2 ;;
esac
timeout -s TERM 560 python3 -m bench.concurrency "${COMMON[@]}" \
  --configs autoregressive,chain,tree@4,tree@16,tree@64,adaptive --once autoregressive --repeat $R \
  --concurrency "$C" --tag "h200_${RUN:-s25}_$1" --orchestrator-flags "--steps off" \
  --note "${NOTE:-session 25: the decisive run of issue 14, steps off, three repeats}" 2>&1 | grep "c="
