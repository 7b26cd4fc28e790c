#!/usr/bin/env bash
# Session 24 on the H200, after the GGUF's part calls (`bash scripts/device_run.sh K`, K = 0..4) on the
# same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   [RUN=tag] bash scripts/device_s24.sh gap — the same-shape gap at c = 64: --steps off, AR / tree@16 / adaptive /
#                                  adaptive@16 (the policy under a 16-node cap: tree@16's KV reservation, no
#                                  tree@64 trials), three repeats, with each service's CPU use; then --steps on,
#                                  AR / tree@16 / adaptive at c = 64, two repeats (held rows, 16 at most)
#   [RUN=tag] bash scripts/device_s24.sh on — the --steps on half of `gap` alone
#   [RUN=tag] bash scripts/device_s24.sh held — --steps on, AR / tree@16 / adaptive at c = 1, 4, 16, 64, two repeats: a
#                                  request that joins a one-token plan holds its prompt's feature rows too, held rows
#                                  are fetched on the request's own Session (no 16-row cap)
#   [RUN=tag] bash scripts/device_s24.sh steps — --steps on, AR / tree@16 / adaptive at c = 1, 4, 16, 64, two repeats
#                                  (ran with a planner change since reverted: a drafted round after one that
#                                  drafted nothing not recorded — plans/0009 "Session 24"); then --steps off,
#                                  the same cells once
set -eo pipefail
source scripts/device_env.sh
case "$1" in
gap)
  timeout -s TERM 230 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive,adaptive@16 \
    --concurrency 64 --repeat 3 --tag "h200_${RUN:-s24}_gap_off" --orchestrator-flags "--steps off" \
    --note "${NOTE:-session 24: the same-shape gap at c = 64, --steps off, with each service CPU use}" 2>&1 | grep "c=" ;;&
gap|on)
  timeout -s TERM 150 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
    --concurrency 64 --repeat 2 --tag "h200_${RUN:-s24}_c64_on" --orchestrator-flags "--steps on" \
    --note "${NOTE:-session 24: --steps on at c = 64 (held rows, at most 16), with each service CPU use}" 2>&1 | grep "c=" ;;
held)
  timeout -s TERM 330 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
    --concurrency 16,64 --repeat 3 --tag "h200_${RUN:-s24c}_held_on" --orchestrator-flags "--steps on" \
    --note "${NOTE:-session 24: --steps on, prompt rows held at open, fetches on the Session}" 2>&1 | grep "c=" ;;
steps)
  timeout -s TERM 330 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
    --concurrency 1,4,16,64 --repeat 2 --tag "h200_${RUN:-s24b}_steps_on" --orchestrator-flags "--steps on" \
    --note "${NOTE:-session 24: --steps on, catch-up rounds not recorded}" 2>&1 | grep "c="
  timeout -s TERM 200 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,adaptive \
    --concurrency 1,4,16,64 --tag "h200_${RUN:-s24b}_steps_off" --orchestrator-flags "--steps off" \
    --note "${NOTE:-session 24: --steps off, catch-up rounds not recorded}" 2>&1 | grep "c=" ;;
esac
