"""A release never waits for model work (issue 11): while one request's verify forward runs,
another request's release returns at once (the engine's state lock is not held across the
forward) and frees its KV."""
import threading
import time

import torch

from modeling.sampling import SamplingParams
from target_service.engine import TargetEngine


def test_release_returns_while_another_requests_verify_runs(target_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a steady forward on the shared 2-core machine
    try:
        _check(target_model)
    finally:
        torch.set_num_threads(threads)


def _check(target_model):
    e = TargetEngine(target_model, (), max_context=2048, kv_pool_tokens=4096, max_tree_budget=128)
    e.prefill("long", list(range(100, 612)), 8, SamplingParams(), "tree", 128)
    e.prefill("short", [1, 2, 3], 4, SamplingParams())
    bonus = e._requests["long"].bonus
    tokens = [bonus] + [1000 + i for i in range(128)]  # a 129-row tree at a 512-token prefix
    parents = [-1] + [0] * 8 + [1 + (i - 8) // 15 for i in range(8, 128)]
    verify = threading.Thread(target=e.verify, args=("long", tokens, parents))
    verify.start()
    while not e._model_lock.locked():  # the verify holds the model: its forward is (about to be) running
        time.sleep(0.001)
    freed = e.release(["short"])
    still_running = e._model_lock.locked()  # the forward still holds the model
    verify.join()
    assert freed == 1 and e.live_requests == 1
    assert still_running, "the release waited for the other request's verify forward"
