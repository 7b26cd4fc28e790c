#!/usr/bin/env bash
# Prepare what a GPU run on the lent device carries (run here, once per session): cp312 wheels
# the device image lacks, the embedded GGUF split in 3 parts (a call carries at most 64 MiB,
# the tracked tree is ~31 MB), and the benchmark prompts as token ids.
# Then three back-to-back device calls, each carrying .devcarry/whl, .devcarry/prompts.json and
# one .devcarry/partK, run `bash scripts/device_run.sh K <command>`; the third joins the GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.devcarry
mkdir -p $D/whl $D/part0 $D/part1 $D/part2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform any -d $D/whl "gguf==0.17.1" "structlog==25.5.0"
G=$(python3 -c "import modeling.weights as w; print(w.default_gguf_path())")
rm -f $D/part*/gguf.part*
split -n 3 -d "$G" $D/gguf.part
for k in 0 1 2; do mv $D/gguf.part0$k $D/part$k/gguf.part$k; done
python3 - <<'PY'
import json
from bench.datasets import humaneval_prompts, mtbench_questions
from modeling.tokenizer import TextTokenizer
from modeling.weights import default_gguf_path

tok = TextTokenizer.from_file(default_gguf_path())
chat = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
bench = [tok.encode(p) for p in humaneval_prompts()[-5:]] + [chat(q) for q in mtbench_questions()[-5:]]
test = [tok.encode(p) for p in humaneval_prompts(10)] + [chat(q) for q in mtbench_questions(10)]
json.dump(dict(bench=bench, test=test), open(".devcarry/prompts.json", "w"))
PY
python3 -m bench.datasets  # HumanEval/MT-Bench texts for the device (it lacks those packages): .devcarry/h4/eval_texts.json.gz
du -sh $D/*
