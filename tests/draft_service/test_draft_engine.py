"""Draft engine (no gRPC): context sync, modes, limits, no state leaking between requests."""
import pytest
import torch

from draft_service.engine import DraftEngine
from modeling.defaults import drafter_config
from modeling.dflash import DFlashDrafter
from modeling.errors import FailedPrecondition, InvalidRequest


def test_draft_context_sync_and_modes(target_bundle):
    cfg, state = target_bundle
    dc = drafter_config(cfg, fresh=True)
    de = DraftEngine(DFlashDrafter.random(dc).eval(), state["model.embed_tokens.weight"],
                     state["model.embed_tokens.weight"], max_tree_budget=64)
    w = de.feature_width
    toks, parents = de.draft("r", torch.randn(5, w), 0, 7, "tree", 10)  # binds mode and tree budget
    assert len(toks) == 11 and toks[0] == 7 and parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i)
    toks, parents = de.draft("r", torch.randn(2, w), 5, 9)  # later calls: features + bonus only
    assert len(toks) == 11 and toks[0] == 9
    with pytest.raises(FailedPrecondition, match="context_start must be 7"):
        de.draft("r", torch.randn(1, w), 3, 9)
    with pytest.raises(InvalidRequest, match="context_features"):
        de.draft("r", torch.randn(1, w + 1), 7, 9)
    with pytest.raises(InvalidRequest, match="tree_budget"):
        de.draft("new", torch.randn(1, w), 0, 9, "tree", 65)
    with pytest.raises(InvalidRequest, match="mode"):
        de.draft("new", torch.randn(1, w), 0, 9, "beam", 4)
    toks, parents = de.draft("c", torch.randn(2, w), 0, 9, "chain")
    assert len(toks) == dc.block_size and parents == list(range(-1, dc.block_size - 1))
    assert de.release(["c"]) == 1
    assert de.release(["r", "never"]) == 1 and de.live_requests == 0
    # Same inputs on a fresh request → same tree (no state leaks between requests).
    a = de.draft("x", torch.ones(3, w), 0, 11, "tree", 8)
    de.release(["x"])
    assert de.draft("y", torch.ones(3, w), 0, 11, "tree", 8) == a
