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
# partK/of (scripts/device_prep.sh): "N SIZE SHA256" of the split; a part staged from another split is stale
read -r N SIZE SHA < .devcarry/part$K/of
for f in /tmp/specdec/gguf.part*.of; do  # (and the model joined from them)
  [ -e "$f" ] && [ "$(cat "$f")" != "$N $SIZE $SHA" ] && rm -f "${f%.of}" "$f" /tmp/specdec/model.gguf
done
cp .devcarry/part$K/gguf.part$K /tmp/specdec/ && echo "$N $SIZE $SHA" > /tmp/specdec/gguf.part$K.of
PARTS=$(seq -f /tmp/specdec/gguf.part%g 0 $((N - 1)))
if ls $PARTS >/dev/null 2>&1; then  # all N of this split: join, check, then publish
  cat $PARTS > /tmp/specdec/model.gguf.tmp
  if [ "$(stat -c %s /tmp/specdec/model.gguf.tmp)" = "$SIZE" ] && [ "$(sha256sum /tmp/specdec/model.gguf.tmp | cut -c1-64)" = "$SHA" ]; then
    mv /tmp/specdec/model.gguf.tmp /tmp/specdec/model.gguf
    export SPECDEC_GGUF=/tmp/specdec/model.gguf
  else
    echo "joined GGUF does not match the split's size/SHA-256: not published"; rm -f /tmp/specdec/model.gguf /tmp/specdec/model.gguf.tmp
  fi
fi
ls -la /tmp/specdec
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ $# -gt 0 ]; then "$@"; fi
