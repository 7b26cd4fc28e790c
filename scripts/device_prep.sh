#!/usr/bin/env bash
# Prepare, here (once per session: .devcarry/ is git-ignored and does not survive a new checkout),
# everything a GPU run on the lent device carries:
#   .devcarry/whl/       cp312 wheels the device image lacks (gguf, structlog, prometheus-client)
#   .devcarry/grpcwhl/   our grpcio ≥ 1.85 set (the image has 1.84), and py-spy
#   .devcarry/partK/     the embedded GGUF in N parts (K = 0..N-1; partK/of: N, size, SHA-256): one call carries
#                        64 MiB in all, the working tree included (~36 MB with the 4-layer drafter:
#                        N = 4 of ~24.6 MB; a larger checkpoint in the tree makes N larger; PARTS=N
#                        overrides; a part call carries .devcarry/whl and the part, nothing else);
#                        `bash scripts/device_run.sh K` on N back-to-back calls joins them
#                        into /tmp/specdec/model.gguf
#   .devcarry/tokenizer/ the tokenizer alone (stub-worker protocol bench: no GGUF needed)
#   .devcarry/h4/eval_texts.json.gz  HumanEval/MT-Bench texts (the device lacks those packages;
#                        SPECDEC_EVAL_TEXTS names it for bench.concurrency / bench.acceptance)
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
mkdir -p $D/whl $D/grpcwhl
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$@"; }
dl $D/whl "gguf==0.17.1" "structlog==25.5.0" "prometheus-client==0.26.0"
dl $D/grpcwhl "grpcio==1.85.3" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" "grpcio-status==1.85.3" \
    "py-spy==0.4.3"  # (py-spy: bench.concurrency --py-spy; a static binary, /tmp/site/bin on the device)
G=$(python3 -c "import modeling.weights as w; print(w.default_gguf_path())")
# what a part may weigh: 64 MiB less the working tree (tracked + untracked-not-ignored), the wheels and 2 MiB
TREE=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
ROOM=$((64 * 1048576 - TREE - $(du -sb $D/whl | cut -f1) - 2 * 1048576))
[ "$ROOM" -gt 1048576 ] || { echo "the working tree ($TREE bytes) leaves no room for a GGUF part in a 64 MiB call"; exit 1; }
N=${PARTS:-$(( ($(stat -c %s "$G") + ROOM - 1) / ROOM ))}
[ "$N" -ge 1 ] && [ "$N" -le 10 ] || { echo "GGUF in $N parts? (working tree $TREE bytes leaves $ROOM per call)"; exit 1; }
# each part's `of`: N, the whole file's size and SHA-256 — device_run.sh joins only parts of one split, checks the result
STAMP="$N $(stat -c %s "$G") $(sha256sum "$G" | cut -c1-64)"
rm -rf $D/part[0-9] && split -n "$N" -d -a 1 "$G" /tmp/gq
for k in $(seq 0 $((N - 1))); do mkdir -p $D/part$k && mv /tmp/gq$k $D/part$k/gguf.part$k && echo "$STAMP" > $D/part$k/of; done
echo "GGUF in $N parts (working tree $((TREE / 1048576)) MiB): bash scripts/device_run.sh K for K = 0..$((N - 1))"
bash scripts/device_protocol.sh prep >/dev/null  # .devcarry/tokenizer (and the protocol baseline tree)
python3 -m bench.datasets  # .devcarry/h4/eval_texts.json.gz
du -sh $D/*
