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
#   bash scripts/device_protocol.sh
# installs grpcio 1.85 (.devcarry/grpcwhl) and gguf/structlog (.devcarry/whl) into /tmp/site and runs
# the bench: v1, v2 before, v2 now, and v2 with gRPC/GIL knobs, interleaved 3 times, then
# bench.grpc_echo (bare gRPC exchange, aio vs sync on each side); results in
# $OUT/protocol_h200.{md,json} and $OUT/grpc_echo_h200.{md,json} (and bench/results/).
# Expected wall time: ~5 min (6 variants x 2 budgets x 3 repeats, ~6.5 min on the 2-core CPU VM).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
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
  git archive "$base" -- bench deploy draft_service kernels modeling orchestrator protocol serving specdec_client \
      specdec_proto target_service | tar -x -C $D/protobase
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
python3 -m bench.protocol --tokenizer $D/tokenizer --requests 8 --rounds 64 --repeat 3 --tag h200 "${base[@]}" \
    --knobs '{"grpc_args": [["grpc.http2.bdp_probe", 0]]}' \
    --knobs '{"switch_interval": 0.0002}' \
    --knobs '{"writer_task": true}'
python3 -m bench.grpc_echo --repeat 2 --tag h200
if [ -n "${OUT:-}" ]; then cp bench/results/protocol_h200.* bench/results/grpc_echo_h200.* "$OUT"/; fi
