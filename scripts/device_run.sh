#!/usr/bin/env bash
# On the device: bash scripts/device_run.sh K [command...] — install the carried wheels, keep
# GGUF part K in /tmp/specdec (it survives while the machine stays warm), join the parts once
# all four are there (SPECDEC_GGUF then names the file), and run the command if given.
# Four parts of ~24.6 MB (session 7: the tracked tree is ~34 MB and one call carries 64 MiB in
# all, tree included): here, `split -n 4 -d -a 1 GGUF /tmp/gq` then .devcarry/partK/gguf.partK.
set -eo pipefail
K=$1; shift
mkdir -p /tmp/specdec
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cp .devcarry/part$K/gguf.part$K /tmp/specdec/
if [ -f /tmp/specdec/gguf.part0 ] && [ -f /tmp/specdec/gguf.part1 ] && [ -f /tmp/specdec/gguf.part2 ] && [ -f /tmp/specdec/gguf.part3 ]; then
  cat /tmp/specdec/gguf.part0 /tmp/specdec/gguf.part1 /tmp/specdec/gguf.part2 /tmp/specdec/gguf.part3 > /tmp/specdec/model.gguf
  export SPECDEC_GGUF=/tmp/specdec/model.gguf
fi
ls -la /tmp/specdec
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ $# -gt 0 ]; then "$@"; fi
