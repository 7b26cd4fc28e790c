#!/usr/bin/env bash
# Session 23 on the H200, after the GGUF's part calls (`bash scripts/device_run.sh K`, K = 0..3) on the
# same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   [RUN=tag] bash scripts/device_s23.sh ab — one orchestrator process: --steps on (the steps-on cost model, the
#                                  planner exploring within the fit error) AR / tree@16 / tree@64 / adaptive at
#                                  c = 1, 4, 16, 64, two repeats; then --steps off, the same cells once
#   [RUN=tag] bash scripts/device_s23.sh on — the --steps on half of `ab` alone
#   [RUN=tag] bash scripts/device_s23.sh held — AR / tree@16 / adaptive at c = 16, 64, two repeats, --steps on
#                                  (one-token rounds of a one-token plan hold their feature rows at the target)
#   [RUN=tag] bash scripts/device_s23.sh focus — AR / tree@16 / adaptive at c = 16, 64, three repeats, --steps on then off
set -eo pipefail
source scripts/device_env.sh
case "$1" in
ab|on)
  timeout -s TERM 330 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,tree@64,adaptive \
    --concurrency 1,4,16,64 --repeat 2 --tag "h200_${RUN:-s23}_steps_on" --orchestrator-flags "--steps on" \
    --note "${NOTE:-session 23: --steps on (one process; steps-on cost model, exploration within its fit error)}" 2>&1 | grep "c="
  [ "$1" = on ] && exit 0
  timeout -s TERM 230 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,tree@64,adaptive \
    --concurrency 1,4,16,64 --tag "h200_${RUN:-s23}_steps_off" --orchestrator-flags "--steps off" \
    --note "session 23: --steps off (one process; the session-6 cost model, exploration within its fit error)" 2>&1 | grep "c=" ;;
held)
  timeout -s TERM 200 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
    --concurrency 16,64 --repeat 2 --tag "h200_${RUN:-s23d}_held_on" --orchestrator-flags "--steps on" \
    --note "${NOTE:-session 23: --steps on, held feature rows}" 2>&1 | grep "c=" ;;
focus)
  for st in on off; do
    timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
      --concurrency 16,64 --repeat 3 --tag "h200_${RUN:-s23c}_focus_$st" --orchestrator-flags "--steps $st" \
      --note "${NOTE:-session 23} --steps $st: c = 16, 64, three repeats" 2>&1 | grep "c="
  done ;;
esac
