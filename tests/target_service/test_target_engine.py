"""Target engine limits and state handling (no gRPC): KV pool, tree checks, early release."""
import pytest
import torch

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


def test_release_before_prefill_keeps_nothing(target_model):
    e = TargetEngine(target_model, (), max_context=64, kv_pool_tokens=1000, max_tree_nodes=4)
    assert e.release(["late"]) == 0  # the caller gave up while its prefill was still queued
    e.prefill("late", [1, 2, 3], 4, G)
    assert e.live_requests == 0 and e.reserved_tokens == 0
