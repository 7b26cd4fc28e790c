#!/usr/bin/env bash
# Prepare, here (once per session: .devcarry/ is git-ignored and does not survive a new checkout),
# everything a GPU run on the lent device carries:
#   .devcarry/whl/       cp312 wheels the device image lacks (gguf, structlog, prometheus-client)
#   .devcarry/grpcwhl/   our grpcio ≥ 1.85 set (the image has 1.84)
#   .devcarry/partK/     the embedded GGUF in four parts (K = 0..3, ~24.6 MB each: one call carries
#                        64 MiB in all and the tracked tree is ~34 MB); `bash scripts/device_run.sh K`
#                        on four back-to-back calls joins them into /tmp/specdec/model.gguf
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
dl $D/grpcwhl "grpcio==1.85.3" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" "grpcio-status==1.85.3"
G=$(python3 -c "import modeling.weights as w; print(w.default_gguf_path())")
rm -rf $D/part0 $D/part1 $D/part2 $D/part3 && mkdir -p $D/part0 $D/part1 $D/part2 $D/part3
split -n 4 -d -a 1 "$G" /tmp/gq
for k in 0 1 2 3; do mv /tmp/gq$k $D/part$k/gguf.part$k; done
bash scripts/device_protocol.sh prep >/dev/null  # .devcarry/tokenizer (and the protocol baseline tree)
python3 -m bench.datasets  # .devcarry/h4/eval_texts.json.gz
du -sh $D/*
