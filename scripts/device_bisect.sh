#!/usr/bin/env bash
# Bisect a throughput change on the H200 across commits (issue 14: tree@16 at c=64 fell 6,344 ->
# 5,258 tok/s between ed35c3e and 8ade7f6).
#
#   here:   bash scripts/device_bisect.sh export REV...
#           git-archives each commit (without the checkpoint and bench/results, ~2.5 MB each) into
#           .devcarry/bisect/<short rev>/ and writes .devcarry/bisect/ORDER (the run order).
#           Carry ".devcarry/bisect" (plus the standard .devcarry/whl, .devcarry/grpcwhl and
#           .devcarry/h4/eval_texts.json.gz: the bench prompts).
#   device: bash scripts/device_bisect.sh run
#           after `bash scripts/device_run.sh K` (K = 0, 1, 2: /tmp/specdec/model.gguf staged).
#           For each line of ORDER ("<rev> [VAR=value ...] [--bench-flag value ...]"), in that commit's tree:
#           python3 -m bench.concurrency --configs $CONFIGS --concurrency $CONC --seconds $SECONDS
#           --warmup $WARMUP over gRPC (--no-data-channel where the commit's bench has the flag;
#           older commits' bench runs gRPC only), the session-5/6 worker flags; the env of the line
#           applies to that run only (e.g. SPECDEC_DRAFT_OVERLAP_MAX_LIVE=0), the extra flags come last (e.g.
#           --data-channel, --ramp 1, --configs ...: they override the defaults). A sampler records
#           every 1 s each stack process's CPU ticks (/proc/pid/stat) and the GPU's utilisation.
#           Writes $OUT/bisect/concurrency_bisect_<rev>[_<n>].{md,json}, cpu_<...>.log,
#           summary.txt (tok/s, mean batches, CPU% per process over the measured window).
#           Each run is capped at RUN_LIMIT s (default 75), the whole call at LIMIT s (default 380).
#           Knobs (env): CONFIGS CONC SECONDS_ WARMUP WFLAGS SPECDEC_GGUF NO_INSTALL (CPU dry runs).
set -u
cd "$(dirname "$0")/.."
B=.devcarry/bisect
case "${1:-}" in
export)
    shift
    mkdir -p $B && : > $B/ORDER
    for arg in "$@"; do  # REV or REV+VAR=value[+--flag+value...]: the same tree, a run with that env/flags
        rev=${arg%%+*}; envs=""; [ "$arg" = "$rev" ] || envs=$(echo "${arg#*+}" | tr "+" " ")
        short=$(git rev-parse --short "$rev") || exit 2
        if [ ! -f "$B/$short/REV" ]; then
            rm -rf "$B/$short" && mkdir -p "$B/$short"
            git archive "$short" | tar -x -C "$B/$short" --exclude=checkpoints --exclude=bench/results
            echo "$short" > "$B/$short/REV"
        fi
        echo "$short $envs" >> $B/ORDER
    done
    du -sh $B; cat $B/ORDER
    exit 0 ;;
run) ;;
*) echo "usage: $0 export REV... | run"; exit 2 ;;
esac

T0=$(date +%s)
LIMIT=${LIMIT:-380}; RUN_LIMIT=${RUN_LIMIT:-75}
CONFIGS=${CONFIGS:-tree@16}; CONC=${CONC:-64}; SECONDS_=${SECONDS_:-12}; WARMUP=${WARMUP:-4}
WFLAGS=${WFLAGS:---device cuda --dtype bfloat16 --graphs --max-batch 64}
export SPECDEC_GGUF=${SPECDEC_GGUF-/tmp/specdec/model.gguf}  # set empty: the embedded model (CPU dry run)
[ -z "$SPECDEC_GGUF" ] || [ -f "$SPECDEC_GGUF" ] || { echo "GGUF not staged"; exit 3; }
[ -n "${NO_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devcarry/grpcwhl/*.whl
ROOT=$PWD; R=$OUT/bisect; mkdir -p $R/logs
export PYTHONUNBUFFERED=1 SPECDEC_EVAL_TEXTS=${SPECDEC_EVAL_TEXTS:-$ROOT/.devcarry/h4/eval_texts.json.gz}
# the host, for comparing runs across sessions (the c=64 cells are bound by host CPU)
{ echo "host: $(lscpu | grep -m1 'Model name' | sed 's/.*: *//') x $(nproc), python loop $(python3 -c \
  'import time; t = time.perf_counter(); sum(i * i for i in range(3_000_000)); print(f"{time.perf_counter() - t:.3f}")') s"
} | tee -a $R/summary.txt
n=0
while read -r rev rest; do
    [ -n "$rev" ] || continue
    envs=""; extra=""  # "VAR=value" tokens: env of this run; from the first "--" token on: extra bench flags
    for tok in $rest; do
        if [ -n "$extra" ] || [[ $tok == --* ]]; then extra="$extra $tok"; else envs="$envs $tok"; fi
    done
    n=$((n + 1)); tag="bisect_${rev}_$n"
    left=$((LIMIT - ($(date +%s) - T0)))
    [ $left -gt 45 ] || { echo "$tag: no time left ($left s)" | tee -a $R/summary.txt; continue; }
    t=$(( left - 5 < RUN_LIMIT ? left - 5 : RUN_LIMIT ))
    dir=$ROOT/$B/$rev
    ln -sfn $ROOT/checkpoints $dir/checkpoints
    dc=""; grep -q -- '"--data-channel"' $dir/bench/concurrency.py && dc="--no-data-channel"
    ( while :; do echo "T $(date +%s.%N)"
        for p in $(pgrep -f -- '-m (target_service|draft_service|orchestrator) --port'); do
            echo "$p $(cut -d' ' -f14,15 /proc/$p/stat 2>/dev/null) $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-120)"; done
        nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits 2>/dev/null | sed 's/^/GPU /'; sleep 1; done ) > $R/cpu_$tag.log 2>&1 &
    SAMPLER=$!
    rm -f $R/concurrency_$tag.*
    echo "== $tag ($envs) $dc $extra limit $t s at +$(( $(date +%s) - T0 )) s"
    ( cd $dir && env $envs PYTHONPATH=/tmp/site:$dir timeout -s TERM -k 5 $t python3 -m bench.concurrency \
        --configs $CONFIGS --concurrency $CONC --seconds $SECONDS_ --warmup $WARMUP --streams-per-client 8 \
        --worker-flags "$WFLAGS" $dc $extra --tag $tag --out-dir $R \
        --log-dir /tmp/bisect-logs-$tag --note "code $rev$envs $dc$extra" ) > $R/logs/$tag.log 2>&1
    rc=$?
    kill $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
    python3 - "$R" "$tag" "$rc" "$envs$extra" <<'EOF' | tee -a $R/summary.txt
import json, pathlib, re, sys
R, tag, rc, envs = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    d = json.loads((R / f"concurrency_{tag}.json").read_text())
except Exception as e:
    print(f"{tag} rc={rc} {envs}: no results ({e})"); raise SystemExit
m = d["meta"]
# CPU per stack process (by pid, utime + stime ticks of /proc/pid/stat) from the sampler, over the
# busiest window of 0.75 x (seconds): the measured cell, not start-up or the idle check after it
samples, t, gpu = [], None, []
for line in (R / f"cpu_{tag}.log").read_text().splitlines():
    if line.startswith("T "):
        t = float(line[2:]); samples.append((t, {}))
    elif line.startswith("GPU "):
        gpu.append((t, float(line[4:])))
    elif samples and len(line.split()) > 3 and all(x.isdigit() for x in line.split()[:3]):
        pid, ut, st, args = line.split(None, 3)
        name = next((k for k in ("orchestrator", "target_service", "draft_service") if "-m " + k in args), "?")
        samples[-1][1][pid] = (name, (int(ut) + int(st)) / 100)
best, W = None, 0.75 * m["seconds"]
for i, (t0, c0) in enumerate(samples):
    t1, c1 = next(((tt, cc) for tt, cc in samples[i:] if tt >= t0 + W), (None, None))
    if t1 is None:
        break
    per = {}
    for pid, (name, secs) in c1.items():
        if pid in c0:
            per[name] = per.get(name, 0) + (secs - c0[pid][1]) / (t1 - t0)
    if best is None or sum(per.values()) > sum(best[2].values()):
        best = (t0, t1, per)
cpu = ""
if best:
    t0, t1, per = best
    g = [u for tt, u in gpu if tt is not None and t0 <= tt <= t1]
    cpu = " ".join(f"{k.split('_')[0]} {100 * v:.0f}%" for k, v in sorted(per.items()))
    cpu += f", gpu util {sum(g) / max(1, len(g)):.0f}% ({t1 - t0:.1f} s window)"
for r in d["rows"]:
    print(f"{tag} rc={rc} {envs.strip() or '-'} dc={m.get('data_channel', False)} {r['config']} c={r['c']}: "
          f"{r['tok_s']} tok/s, completed {r['completed']}, errors {r['errors']}, identical {r.get('identical')}, "
          f"mean batch verify {r.get('target_mean_batch_verify')} draft {r.get('draft_mean_batch_draft')}, "
          f"TTFT p50 {r.get('ttft_p50')} ITL p50 {r.get('itl_p50')}; CPU (1 core = 100%): {cpu}")
EOF
done < ${ORDER:-$B/ORDER}
cat $R/summary.txt
tar czf $OUT/bisect_logs.tgz -C $R logs && rm -rf $R/logs
echo "call took $(($(date +%s) - T0)) s"
