"""Shared fixtures: the embedded model loaded in-process, the real engines behind the
in-process transport (``deploy.inprocess``), and the real three-service stack (separate
processes, real gRPC on loopback) started once per test session.

Tiers: ``python3 -m pytest`` runs the fast tier (CI); ``python3 -m pytest -m slow`` the full
losslessness matrix (see README)."""
from __future__ import annotations

import threading
import time

import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``cpu_slow`` tests join the slow tier on machines without CUDA (before ``-m`` selects)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cpu_slow"):
            item.add_marker(pytest.mark.slow)


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
    """The three services started as the compose file declares them (``deploy.compose_local``:
    commands, environments, health checks, start order); yields the ComposeStack.
    ``readiness_seen`` / ``liveness_seen``: the distinct grpc.health.v1 statuses per service, in
    order, polled every 50 ms while the stack started."""
    from deploy.compose_local import compose_stack
    from specdec_client.probe import check

    s = compose_stack(str(tmp_path_factory.mktemp("service-logs")))
    s.readiness_seen = {name: [] for name in s.ports}
    s.liveness_seen = {name: [] for name in s.ports}
    started = threading.Event()

    def record():
        while True:
            last = started.is_set()
            for name, port in s.ports.items():
                for seen, service in ((s.readiness_seen[name], s.ready_names[name]), (s.liveness_seen[name], "")):
                    st = check(f"127.0.0.1:{port}", service, timeout=1)
                    if st != "UNREACHABLE" and (not seen or seen[-1] != st):
                        seen.append(st)
            if last:
                return
            time.sleep(0.05)

    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    try:
        s.up()
        started.set()
        recorder.join()
        yield s
    finally:
        started.set()
        s.stop()


@pytest.fixture(scope="session")
def client(stack):
    from specdec_client import SpecDecClient

    with SpecDecClient(stack.address, timeout=600) as c:
        yield c


@pytest.fixture(scope="session")
def engines(target_model):
    """(TargetEngine, DraftEngine) on the embedded target and the shipped drafter, float32 CPU,
    limits as the services' defaults (tree budget up to 64 here)."""
    from draft_service.engine import DraftEngine
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from modeling.dflash import DFlashDrafter
    from target_service.engine import TargetEngine

    drafter = DFlashDrafter.load(DEFAULT_DRAFTER_DIR).eval().requires_grad_(False)
    de = DraftEngine(drafter, target_model.model.embed_tokens.weight, target_model.lm_head.weight, max_tree_budget=64)
    te = TargetEngine(target_model, tuple(drafter.config.target_layer_ids), max_context=8192,
                      kv_pool_tokens=1 << 17, max_tree_budget=64)
    return te, de


@pytest.fixture(scope="session")
def inprocess(engines):
    """(target client, draft client) of the in-process transport over ``engines``."""
    from deploy.inprocess import InProcessDraft, InProcessTarget

    te, de = engines
    return InProcessTarget(te), InProcessDraft(de)
