#!/usr/bin/env bash
# Per-round protocol cost with stub workers (bench/protocol.py) on the GPU host, in one command.
#
# Here, once (writes ignored files under .devcarry/):
#   bash scripts/device_protocol.sh prep [BASELINE_COMMIT]
#     .devcarry/tokenizer/  the embedded model's tokenizer as tokenizer.json (no 94 MB GGUF needed)
#     .devcarry/protobase/  the code at BASELINE_COMMIT (default 50b06e9: v2 before the per-round
#                           cuts), measured in the same run as "v2 before"
# On the device (run from the repo root; carry .devcarry/grpcwhl .devcarry/whl .devcarry/tokenizer
# .devcarry/protobase):
#   bash scripts/device_protocol.sh [quick|full]
# installs grpcio 1.85 (.devcarry/grpcwhl) and gguf/structlog (.devcarry/whl) into /tmp/site, then
#   quick (default, ~100 s): bench.grpc_echo (bare exchange on TCP loopback, 4 KB and 28 KB: aio vs
#     sync server and client, and raw sockets without gRPC) and bench.protocol (v2 at BASELINE vs
#     v2 now vs v2 now over the workers' data channel (serving.datachannel), and the tree in
#     .devcarry/protoover if carried; a BASELINE with the data channel is measured over it too;
#     budgets 4 and 64; each delta written to a client stream; interleaved twice; CPU per process
#     and per thread);
#   full (~6 min): v1 too, the gRPC/GIL knobs and the data channel (Protocol and streams clients),
#     interleaved 3 times;
#   profile (~70 s; needs only .devcarry/grpcwhl .devcarry/whl .devcarry/tokenizer): this tree over the
#     data channel, text outputs, client writes, budgets 4 and 64, repeat 3, with --profile (the round's
#     phase timeline and a cProfile of the orchestrator and of the stub workers' data-channel sessions per
#     budget: protocol_profile_h200_text.{md,json}),
#     then the same without text in the order 64, 4 (repeat 2: is budget 64's cost the order?);
#   spin (~55 s): this tree over the data channel, text, client writes, budgets 4 and 64, repeat 2: polling
#     off (SPECDEC_SPIN_US=0), with busy-polling (SPECDEC_SPIN_US=1000), both with float32 feature rows, and
#     with busy-polling and bf16 feature rows (what the GPU workers send); $OUT/protocol_h200_spin.{md,json};
#   (every mode: bench.protocol's --feature-dtype default is auto = bf16 on a CUDA host, and busy-polling is
#     the tree's default, auto = on with >= 8 CPUs, unless the mode sets them)
#   final (~60 s; needs only .devcarry/grpcwhl .devcarry/whl .devcarry/tokenizer): this tree's defaults on the
#     GPU host — the data channel, busy-polling as the tree sets it when SPECDEC_SPIN_US is unset (auto: on
#     with >= 8 CPUs), bf16 feature rows (what the GPU workers send) — against the same with polling off
#     (SPECDEC_SPIN_US=0), text outputs, client writes, budgets 4 and 64, repeat 3;
#     $OUT/protocol_h200_final.{md,json} (the meta records what auto resolved to: busy_poll); REPEAT=N and
#     TAG=name (results protocol_<name>.*) change the repeats and the results' name;
#   confirm (~55 s; also carry .devcarry/ha_base, made here by `bash scripts/device_protocol.sh prep-ha BASE`):
#     the data channel at BASE vs this tree, text outputs, client writes, budgets 4 and 64, repeat 2.
# Results: $OUT/protocol_h200.{md,json} (full) or $OUT/protocol_h200_quick.{md,json} (quick) and
# $OUT/grpc_echo_h200.{md,json} (and bench/results/); profile: $OUT/protocol_{h200_text,profile_h200_text,
# h200_order}.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
# the code packages at commit $1, extracted into $2 (the kernels are kernels/ before their rename, specdec_kernels/
# after: git archive refuses a path the commit lacks, so only the ones it has are named)
code_tree() {
  git archive "$1" -- $(git ls-tree --name-only "$1" -- bench deploy draft_service kernels specdec_kernels modeling \
      orchestrator protocol serving specdec_client specdec_proto target_service) | tar -x -C "$2"
}
if [ "${1:-}" = prep-ha ]; then  # the baseline tree of `confirm` (leaves .devcarry/protobase alone)
  rm -rf $D/ha_base && mkdir -p $D/ha_base
  code_tree "${2:?BASE commit}" $D/ha_base
  echo "$2" > $D/ha_base/COMMIT
  du -sh $D/ha_base
  exit 0
fi
if [ "${1:-}" = prep ]; then
  base=${2:-50b06e9}
  mkdir -p $D/tokenizer
  python3 - <<'PY'
import json
from modeling.model_files import default_gguf_path
from modeling.tokenizer import TextTokenizer
tok = TextTokenizer.from_file(default_gguf_path())
tok.tok.save(".devcarry/tokenizer/tokenizer.json")
eos = tok.tok.id_to_token(tok.eos_token_ids[0]) if tok.eos_token_ids else None
json.dump({"eos_token": eos, "chat_template": tok.chat_template}, open(".devcarry/tokenizer/tokenizer_config.json", "w"))
PY
  rm -rf $D/protobase && mkdir -p $D/protobase
  code_tree "$base" $D/protobase
  echo "$base" > $D/protobase/COMMIT
  du -sh $D/tokenizer $D/protobase
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $D/grpcwhl/*.whl $D/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import grpc, google.protobuf as p; print('grpc', grpc.__version__, 'protobuf', p.__version__)"
base=()
if [ -d $D/protobase ]; then base=(--baseline "$D/protobase=$(cat $D/protobase/COMMIT) (before)"); fi
# an extra candidate tree, if carried (e.g. a change under evaluation: COMMIT names it)
if [ -d $D/protoover ]; then base+=(--baseline "$D/protoover=$(cat $D/protoover/COMMIT)"); fi
keep() { if [ -n "${OUT:-}" ]; then cp "$@" "$OUT"/; fi; }  # each result as soon as it exists
mode=${1:-quick}
if [ "$mode" = profile ]; then
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 3 --versions none \
      --client-writes --text --profile --tag h200_text --knobs '{"data_channel": true}'
  keep bench/results/protocol_h200_text.* bench/results/protocol_profile_h200_text.*
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 2 --versions none \
      --budgets 64,4 --client-writes --tag h200_order --knobs '{"data_channel": true}'
  keep bench/results/protocol_h200_order.*
elif [ "$mode" = spin ]; then
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 6 --rounds 64 --repeat 2 --versions none \
      --client-writes --text --feature-dtype float32 --tag h200_spin \
      --knobs '{"data_channel": true, "env": {"SPECDEC_SPIN_US": "0"}}' \
      --knobs '{"data_channel": true, "env": {"SPECDEC_SPIN_US": "1000"}}' \
      --knobs '{"data_channel": true, "feature_dtype": "bfloat16", "env": {"SPECDEC_SPIN_US": "1000"}}'
  keep bench/results/protocol_h200_spin.*
elif [ "$mode" = final ]; then
  unset SPECDEC_SPIN_US SPECDEC_SPIN_MAX_LIVE  # the tree's defaults, whatever the shell had
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 6 --rounds 64 --repeat ${REPEAT:-3} --versions none \
      --client-writes --text --feature-dtype bfloat16 --tag ${TAG:-h200_final} \
      --knobs '{"data_channel": true}' \
      --knobs '{"data_channel": true, "env": {"SPECDEC_SPIN_US": "0"}}'
  keep bench/results/protocol_${TAG:-h200_final}.*
elif [ "$mode" = confirm ]; then
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 2 --versions none \
      --baseline "$D/ha_base=$(cat $D/ha_base/COMMIT)" --baseline-knobs --client-writes --text ${CONFIRM_FLAGS:-} \
      --tag h200_confirm --knobs '{"data_channel": true}'
  keep bench/results/protocol_h200_confirm.*
elif [ "$mode" = full ]; then
  tag=h200
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 3 --tag $tag "${base[@]}" \
      --knobs '{"unix": true}' \
      --knobs '{"data_channel": true}' \
      --knobs '{"data_channel": "streams"}' \
      --knobs '{"grpc_args": [["grpc.http2.bdp_probe", 0]]}' \
      --knobs '{"switch_interval": 0.0002}' \
      --knobs '{"writer_task": true}'
  keep bench/results/protocol_$tag.*
  python3 -m bench.grpc_echo --repeat 2 --tag h200
  keep bench/results/grpc_echo_h200.*
else
  tag=h200_quick
  python3 -m bench.grpc_echo --repeat 1 --exchanges 2000 --payloads 4096,28000 --transports tcp \
      --pairs aio:aio,sync:aio,aio:sync,raw:raw,raw:aio --tag h200
  keep bench/results/grpc_echo_h200.*
  # a baseline that has the data channel is measured over it too (before/after of a data-channel change)
  if [ -f $D/protobase/serving/datachannel.py ]; then base+=(--baseline-knobs); fi
  python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 2 --versions v2 \
      --client-writes --tag $tag "${base[@]}" --knobs '{"data_channel": true}'
  keep bench/results/protocol_$tag.*
fi
