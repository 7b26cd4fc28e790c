#!/usr/bin/env bash
# bash scripts/device_snapshot.sh [REV] — export a commit's tracked files (without the drafter
# checkpoint and bench/results) to .devcarry/clean (git-ignored, ~2 MB), so a device call runs
# committed code while the shared working tree has edits in progress. Carry ".devcarry/clean";
# on the device: cd .devcarry/clean && ln -sfn ../../checkpoints checkpoints && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
rm -rf .devcarry/clean && mkdir -p .devcarry/clean
git archive "$REV" | tar -x -C .devcarry/clean --exclude=checkpoints --exclude=bench/results
git rev-parse --short "$REV" > .devcarry/clean/REV
du -sh .devcarry/clean
