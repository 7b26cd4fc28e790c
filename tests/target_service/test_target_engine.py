"""Engine-level limits and state handling (no gRPC): KV pool, context sync, wire codec."""
import pytest
import torch

from draft_service.engine import DraftEngine
from modeling.defaults import drafter_config
from modeling.dflash import DFlashDrafter
from modeling.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, UnknownRequest
from modeling.sampling import SamplingParams
from target_service.engine import TargetEngine

G = SamplingParams()


def test_kv_pool_exhaustion_is_resource_exhausted(target_model):
    e = TargetEngine(target_model, (), max_context=256, kv_pool_tokens=300, max_tree_nodes=16)
    e.prefill("a", [1, 2, 3], 100, G)
    with pytest.raises(ResourceExhausted, match="kv_pool_tokens"):
        e.prefill("b", [1, 2, 3], 200, G)
    assert e.release(["a"]) == 1
    e.prefill("b", [1, 2, 3], 200, G)  # fits once "a" is freed
    with pytest.raises(InvalidRequest, match="already live"):
        e.prefill("b", [1], 1, G)
    with pytest.raises(UnknownRequest):
        e.verify("zzz", [1], [-1], G)
    with pytest.raises(InvalidRequest, match="max_tree_nodes"):
        e.verify("b", [0] + list(range(1, 18)), [-1] + [0] * 17, G)
    with pytest.raises(InvalidRequest, match="repeats a sibling"):
        bonus = e._requests["b"].bonus
        e.verify("b", [bonus, 5, 5], [-1, 0, 0], G)
    with pytest.raises(FailedPrecondition, match="pending bonus"):
        e.verify("b", [bonus + 1], [-1], G)


def test_draft_context_sync_and_modes(target_bundle):
    cfg, state = target_bundle
    dc = drafter_config(cfg, fresh=True)
    de = DraftEngine(DFlashDrafter.random(dc).eval(), state["model.embed_tokens.weight"],
                     state["model.embed_tokens.weight"], max_budget=64)
    w = de.feature_width
    toks, parents = de.draft("r", torch.randn(5, w), 0, 7, "tree", 10)
    assert len(toks) == 11 and toks[0] == 7 and parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i)
    toks, parents = de.draft("r", torch.randn(2, w), 5, 9, "chain", 0)
    assert len(toks) == dc.block_size and parents == list(range(-1, dc.block_size - 1))
    with pytest.raises(FailedPrecondition, match="context_start must be 7"):
        de.draft("r", torch.randn(1, w), 3, 9, "chain", 0)
    with pytest.raises(InvalidRequest, match="budget"):
        de.draft("r", torch.randn(1, w), 7, 9, "tree", 65)
    with pytest.raises(InvalidRequest, match="mode"):
        de.draft("r", torch.randn(1, w), 7, 9, "beam", 4)
    with pytest.raises(InvalidRequest, match="context_features"):
        de.draft("r", torch.randn(1, w + 1), 7, 9, "tree", 4)
    assert de.release(["r", "never"]) == 1 and de.live_requests == 0
    # Same inputs on a fresh request → same tree (no state leaks between requests).
    a = de.draft("x", torch.ones(3, w), 0, 11, "tree", 8)
    de.release(["x"])
    assert de.draft("y", torch.ones(3, w), 0, 11, "tree", 8) == a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_codec_roundtrip(dtype):
    from serving.tensors import from_proto, to_proto

    t = torch.randn(3, 5).to(dtype)
    assert torch.equal(from_proto(to_proto(t)), t)
    msg = to_proto(t)
    msg.shape[:] = [4, 5]
    with pytest.raises(InvalidRequest, match="bytes do not match"):
        from_proto(msg, "context_features")


def test_generated_code_matches_protos():
    import subprocess
    import sys

    from deploy.local import ROOT

    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_release_before_prefill_keeps_nothing(target_model):
    e = TargetEngine(target_model, (), max_context=64, kv_pool_tokens=1000, max_tree_nodes=4)
    assert e.release(["late"]) == 0  # the caller gave up while its prefill was still queued
    e.prefill("late", [1, 2, 3], 4, G)
    assert e.live_requests == 0 and e.reserved_tokens == 0


def test_tensor_shape_overflow_is_invalid():
    from serving.tensors import to_proto, from_proto

    msg = to_proto(torch.zeros(2, 2))
    msg.shape[:] = [2 ** 62 + 1, 4]
    with pytest.raises(InvalidRequest):
        from_proto(msg)
