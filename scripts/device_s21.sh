#!/usr/bin/env bash
# Session 21 on the H200, after the GGUF's part calls (`bash scripts/device_run.sh K`, K = 0..3) on the
# same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   bash scripts/device_s21.sh shards      — A/B of the sharded orchestrator (--processes 4 vs 1), four c
#   bash scripts/device_s21.sh learn       — adaptive vs tree@16 at c = 16, 64 with the planner's learning on, then off
#   bash scripts/device_s21.sh shared      — 4 shards, each planning its share of the workers' step (c = 4, 16, 64)
set -eo pipefail
source scripts/device_env.sh
case "$1" in
shards)
  for n in 4 1; do
    timeout -s TERM 290 python3 -m bench.concurrency "${COMMON[@]}" --configs autoregressive,tree@16,tree@64,adaptive --once autoregressive --repeat 2 \
      --concurrency 1,4,16,64 --channel-per-stream --tag "h200_s21_shards$n" --orchestrator-flags "--processes $n" \
      --note "session 21: orchestrator --processes $n, a connection per stream" 2>&1 | grep "c="
  done ;;
learn)
  for l in on off; do
    timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,adaptive --repeat 4 --concurrency 16,64 \
      --tag "h200_s21_learn_$l" --orchestrator-flags "--adaptive-learn $l" \
      --note "session 21: adaptive vs tree@16, the planner's learning $l (one orchestrator process)" 2>&1 | grep "c="
  done ;;
shared)  # after the shards plan their share of the workers' step (budget.shared_by)
  timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,tree@64,adaptive --repeat 2 \
    --concurrency 4,16,64 --channel-per-stream --tag h200_s21_shards4_shared --orchestrator-flags "--processes 4" \
    --note "session 21: --processes 4, each shard planning its share of the workers' step" 2>&1 | grep "c=" ;;
esac
