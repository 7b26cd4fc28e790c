#!/usr/bin/env bash
# On the device: bash scripts/device_run.sh K [command...] — install the carried wheels, keep
# GGUF part K in /tmp/specdec (it survives while the machine stays warm), join the parts once
# all N are there (SPECDEC_GGUF then names the file), and run the command if given.
# scripts/device_prep.sh splits the GGUF into N parts sized so that a part, the wheels and the
# working tree fit one call's 64 MiB (N = 4 of ~24.6 MB with the 4-layer drafter in the tree).
set -eo pipefail
K=$1; shift
mkdir -p /tmp/specdec
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
cp .devcarry/part$K/gguf.part$K /tmp/specdec/
N=$(cat .devcarry/part$K/of 2>/dev/null || echo 4)   # how many parts (scripts/device_prep.sh writes it)
PARTS=$(seq -f /tmp/specdec/gguf.part%g 0 $((N - 1)))
if ls $PARTS >/dev/null 2>&1; then
  cat $PARTS > /tmp/specdec/model.gguf
  export SPECDEC_GGUF=/tmp/specdec/model.gguf
fi
ls -la /tmp/specdec
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ $# -gt 0 ]; then "$@"; fi
