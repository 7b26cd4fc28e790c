# Sourced by the scripts/device_s*.sh runs on the device: the carried wheels into /tmp/site (the GGUF
# joined by the part calls, `bash scripts/device_run.sh K`), the environment every run starts with.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/whl/*.whl .devcarry/grpcwhl/*.whl
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECDEC_GGUF=/tmp/specdec/model.gguf \
    SPECDEC_EVAL_TEXTS=$PWD/.devcarry/h4/eval_texts.json.gz
ls -la "$SPECDEC_GGUF"
W="--device cuda --dtype bfloat16 --graphs --max-batch 64"
COMMON=(--seconds 5 --warmup 2.5 --streams-per-client 8 --out-dir "$OUT" --worker-flags "$W")
