"""Tensor parallel DeepSeek-V3 / Kimi-K2 target on CPU (gloo): TP=2 gives the same greedy
tokens as TP=1 and logits within 1e-5, through the rank-0 driver the target engine uses
(worker ranks mirror every call on their own latent-cache replicas), also inside the
orchestrator's round loop; a dead rank is reported; each rank loads only its share."""
from datetime import timedelta

import pytest
import torch

from deepseek_rounds import greedy_rounds
from deploy.inprocess import InProcessTarget
from modeling.deepseek_weights import load_deepseek
from scripts.make_tiny_deepseek import TINY, save_tiny
from target_service.engine import TargetEngine
from test_deepseek import one_thread  # noqa: F401  (autouse fixture: one torch thread)
from test_deepseek_pipeline import TAPS, generate, stack  # noqa: F401  (stack: module fixture)


def short_collective_timeout():
    """(worker_init, and rank 0 by monkeypatch) collectives time out after 5 s."""
    import modeling.tp

    modeling.tp.COLLECTIVE_TIMEOUT = timedelta(seconds=5)


def test_tp2_on_cpu(stack, monkeypatch):
    """One launch of two gloo ranks: (1) the same greedy tokens as TP=1 and logits within 1e-5
    through prefill, decodes, a tree verify and a multi-row commit; (2) the same greedy output
    in the orchestrator's round loop (AR and tree@16), also while another thread admits and
    releases requests (every rank-visible call is one step under the driver's lock); (3) idle
    longer than the collectives' timeout, the worker still serves (it waits for commands in a
    group of its own); (4) a stopped worker makes the next call fail after the collectives'
    timeout and leaves the driver marked out of step (reported by ``watch``: health NOT_SERVING);
    (5) a killed worker makes the next call raise ``RankDied`` (→ UNAVAILABLE)."""
    import os
    import signal
    import threading
    import time

    import modeling.tp
    from modeling.sampling import SamplingParams
    from modeling.tp import RankDied, launch

    path, target, draft = stack
    want_tokens, want_logits = greedy_rounds(load_deepseek(path))
    ref, _ = generate(target, draft, "autoregressive", 1, 30)
    short_collective_timeout()
    monkeypatch.setattr(modeling.tp, "COLLECTIVE_TIMEOUT", timedelta(seconds=5))
    driver = launch(str(path), 2, worker_init=short_collective_timeout)
    try:
        assert driver.alive()
        got_tokens, got_logits = greedy_rounds(driver)
        assert driver.model.model.layers[0].self_attn.h == 2  # really sharded
        assert driver.model.lm_head.weight.shape[0] == driver.cfg.vocab_size // 2
        assert got_tokens == want_tokens
        err = (got_logits - want_logits).abs().max().item()
        print(f"TP=2 vs TP=1 max |Δlogit| {err:.2e} over {len(got_logits)} rows")
        assert err <= 1e-5

        engine = TargetEngine(driver, TAPS, 512, 1 << 14, 16)
        tp = InProcessTarget(engine)
        assert generate(tp, draft, "autoregressive", 1, 30)[0] == ref

        stop, errors = threading.Event(), []

        def admit_and_release():  # another client's requests opening and closing meanwhile
            i = 0
            while not stop.is_set():
                try:
                    engine.prefill(f"other{i}", [7, 8, 9], 2, SamplingParams(), "autoregressive", 0)
                    engine.release([f"other{i}"])
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
                    return
                i += 1
        other = threading.Thread(target=admit_and_release)
        other.start()
        try:
            assert generate(tp, draft, "tree", 16, 30)[0] == ref
        finally:
            stop.set()
            other.join()
        assert not errors

        time.sleep(7)  # idle past the collectives' 5 s timeout: the worker still waits for its next command
        assert driver.alive() and generate(tp, draft, "tree", 16, 10)[0] == ref[:10]

        seen, fired = [], threading.Event()
        driver.watch(lambda reason: (seen.append(reason), fired.set()), interval=0.1)
        worker = driver._processes[0]  # the worker this test started
        os.kill(worker.pid, signal.SIGSTOP)  # alive but stuck: rank 0's collective times out
        try:
            with pytest.raises(RankDied, match="'logits' failed on rank 0.*out of step"):
                driver.logits(torch.zeros(1, driver.cfg.hidden_size))
            assert fired.wait(10) and "out of step" in seen[0] and not driver.alive()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        worker.kill()
        worker.join(10)
        with pytest.raises(RankDied, match=r"rank\(s\) \[1\] died"):
            driver.new_cache(8)
    finally:
        driver.stop()


def test_loader_reads_only_the_ranks_share(tmp_path):
    """A rank's weights straight from the loader equal the full model sharded afterwards."""
    from modeling.tp import shard_

    save_tiny(tmp_path, "deepseek_v3", "fp8")
    full = shard_(load_deepseek(tmp_path), 1, 2)
    part = load_deepseek(tmp_path, rank=1, world=2)
    want, got = dict(full.named_parameters()), dict(part.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert got["model.layers.1.self_attn.kv_b_proj.weight"].shape == (2 * 32, 32)  # 2 of 4 heads
    assert got["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 12)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) does not divide by 3"):
        load_deepseek(tmp_path, rank=0, world=3)
    from modeling.tp import launch

    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) does not divide by 3"):
        launch(str(tmp_path), 3)  # refused before any process starts
    import subprocess
    import sys
    import time

    t0 = time.monotonic()  # in a process of its own: the abandoned join keeps this one's default group until it times out
    r = subprocess.run([sys.executable, "-c", "import functools, os; from modeling.tp import launch; "
                        f"launch({str(tmp_path)!r}, 2, worker_init=functools.partial(os._exit, 3))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "RankDied: tensor-parallel rank 1 exited with code 3 before joining" in r.stderr
    assert time.monotonic() - t0 < 60  # not the store's 120 s timeout


def test_loader_keeps_fp8_shares_or_dequantises_unaligned_ones(tmp_path):
    """keep_fp8 under TP: every weight equals the dequantised rank share (tiny widths are not
    128-aligned, so attention shares fall back to dequantised; 128-row expert halves stay FP8)."""
    from modeling.deepseek_weights import FP8Linear

    save_tiny(tmp_path, dict(TINY["deepseek_v3"], moe_intermediate_size=256), "fp8")
    part = load_deepseek(tmp_path, rank=1, world=2)
    kept = load_deepseek(tmp_path, rank=1, world=2, keep_fp8=True)
    fp8 = {n for n, m in kept.named_modules() if isinstance(m, FP8Linear)}
    assert "model.layers.1.mlp.experts.0.gate_proj" in fp8 and "model.layers.1.self_attn.q_b_proj" not in fp8
    for name, m in part.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert torch.equal(kept.get_submodule(name).weight, m.weight), name
