#!/usr/bin/env bash
# Session 28 on the H200 (plans/0009 "Session 28"), after the GGUF's part calls (`bash scripts/device_run.sh K`,
# K = 0..N-1) on the same warm machine; carry .devcarry/whl, .devcarry/grpcwhl, .devcarry/h4. Results to $OUT.
#   [RUN=tag] bash scripts/device_s28.sh iso — does the bound an adaptive request opens with cost at c = 64? tree@16,
#                 adaptive@16 (cap 16) and adaptive (cap 64) × 4 interleaved repeats with the planner's learning off:
#                 all three run tree@16's shape in every round, so only the cap differs (~130 s)
#   [RUN=tag] bash scripts/device_s28.sh pool — the pool's c = 64 entry for this lease (bench.concurrency_pool, the
#                 procedure of session 26): tree@16 and adaptive, the default planner, × 5 (~150 s)
#   [RUN=tag] bash scripts/device_s28.sh both — iso, then pool (one call, ~300 s)
#   bash scripts/device_s28.sh check — the GPU kernel tests (tests/kernels, bf16 and graphs; $OUT/pytest.txt) and
#                 bench.batch_invariance (batched greedy = solo, bitwise, lock-step / staggered / threaded;
#                 $OUT/batch_invariance_h200_s28.json) at the head issue 14 is resolved at (~300 s)
#   [FROM=n] bash scripts/device_s28.sh rest — the kernel tests after the first n of the collection order ($OUT/pytest_rest.txt)
set -eo pipefail
source scripts/device_env.sh
iso() {
  timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,adaptive@16,adaptive --repeat 4 \
    --concurrency 64 --tag "h200_${RUN:-s28}_iso" --orchestrator-flags "--steps off --adaptive-learn off" \
    --note "session 28: the open-time bound alone at c = 64 (learning off: one shape in every round)" 2>&1 | grep "c="
}
pool() {
  timeout -s TERM 280 python3 -m bench.concurrency "${COMMON[@]}" --configs tree@16,adaptive --repeat 5 \
    --concurrency 64 --tag "h200_${RUN:-s28}_pool" --orchestrator-flags "--steps off" \
    --note "session 28: the default planner against tree@16 at c = 64, one lease's entry in the pool" 2>&1 | grep "c="
}
case "$1" in
iso) iso ;;
pool) pool ;;
both) iso; pool ;;
check)
  set +e
  timeout -k 5 "${TESTS_S:-280}" python3 -m pytest -q -rs -p no:cacheprovider --confcutdir=tests/kernels tests/kernels \
    > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/pytest.txt" | head
  timeout -s TERM -k 5 200 python3 -m bench.batch_invariance --model "$SPECDEC_GGUF" --tag h200_s28 2>&1 | tail -16 ;;
rest)  # the kernel tests after the first FROM (default 98) in collection order: where check's run stopped
  set +e -f  # (-f: test ids hold [ ], not globs)
  python3 -m pytest -q --co -p no:cacheprovider --confcutdir=tests/kernels tests/kernels 2>/dev/null | grep "::" \
    | tail -n +$(( ${FROM:-98} + 1 )) > /tmp/rest_ids.txt
  echo "$(wc -l < /tmp/rest_ids.txt) tests from #$(( ${FROM:-98} + 1 ))"
  timeout -k 5 "${TESTS_S:-380}" python3 -m pytest -q -rs -p no:cacheprovider --confcutdir=tests/kernels \
    $(cat /tmp/rest_ids.txt) > "$OUT/pytest_rest.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" "$OUT/pytest_rest.txt" | tail -3
  grep -E "^FAILED|^ERROR" "$OUT/pytest_rest.txt" | head ;;
*) echo "usage: device_s28.sh iso|pool|both|check|rest"; exit 2 ;;
esac
