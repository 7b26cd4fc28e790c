"""Target engine limits and state handling (no gRPC): KV pool, tree checks, early release."""
import pytest
import torch

from modeling.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, UnknownRequest
from modeling.sampling import SamplingParams
from target_service.engine import TargetEngine

G = SamplingParams()


def test_kv_pool_reserves_the_requests_tree_budget(target_model):
    """KV reserved = prompt + max_new_tokens + the request's own tree budget + 1 (plans/0004)."""
    e = TargetEngine(target_model, (), max_context=256, kv_pool_tokens=300, max_tree_budget=16)
    e.prefill("a", [1, 2, 3], 100, G)  # autoregressive: no tree slack
    assert e.reserved_tokens == 104
    with pytest.raises(ResourceExhausted, match="kv_pool_tokens"):
        e.prefill("b", [1, 2, 3], 200, G)
    assert e.release(["a"]) == 1
    e.prefill("b", [1, 2, 3], 180, G, "tree", 16)  # fits once "a" is freed
    assert e.reserved_tokens == 3 + 180 + 16 + 1
    with pytest.raises(InvalidRequest, match="already live"):
        e.prefill("b", [1], 1, G)
    with pytest.raises(InvalidRequest, match="tree_budget"):
        e.prefill("c", [1], 1, G, "tree", 17)
    with pytest.raises(InvalidRequest, match="mode"):
        e.prefill("c", [1], 1, G, "beam", 4)
    with pytest.raises(UnknownRequest):
        e.verify("zzz", [1], [-1])
    bonus = e._requests["b"].bonus
    with pytest.raises(InvalidRequest, match="tree_budget"):
        e.verify("b", [bonus] + list(range(1, 18)), [-1] + [0] * 17)
    with pytest.raises(InvalidRequest, match="repeats a sibling"):
        e.verify("b", [bonus, 5, 5], [-1, 0, 0])
    with pytest.raises(FailedPrecondition, match="pending bonus"):
        e.verify("b", [bonus + 1], [-1])


def test_commit_rides_on_the_next_verify(target_model):
    """The target never commits on its own: the next verify must carry the accepted path of
    the pending tree; a refused message changes nothing."""
    e = TargetEngine(target_model, (1,), max_context=256, kv_pool_tokens=1000, max_tree_budget=8)
    first = e.prefill("r", [1, 2, 3, 4], 20, G, "tree", 4).first_token
    v = e.verify("r", [first, 7, 8, 9], [-1, 0, 0, 1])
    assert e._requests["r"].cache.length == 4  # nothing committed yet
    from modeling import acceptance
    path, bonus = acceptance.resolve([first, 7, 8, 9], [-1, 0, 0, 1], v.samples)
    assert v.feature_nodes == path and v.features.shape[0] == len(path)
    with pytest.raises(FailedPrecondition, match="commit"):
        e.verify("r", [bonus], [-1])
    with pytest.raises(InvalidRequest, match="root path"):
        e.verify("r", [bonus], [-1], [0, 3])  # node 3 hangs below node 1, not the root
    with pytest.raises(FailedPrecondition, match="pending bonus"):
        e.verify("r", [bonus + 1], [-1], path)
    assert e._requests["r"].cache.length == 4
    e.verify("r", [bonus], [-1], path)
    assert e._requests["r"].cache.length == 4 + len(path)


def test_release_before_prefill_keeps_nothing(target_model):
    e = TargetEngine(target_model, (), max_context=64, kv_pool_tokens=1000, max_tree_budget=4)
    assert e.release(["late"]) == 0  # the caller gave up while its prefill was still queued
    with pytest.raises(UnknownRequest, match="released during its prefill"):
        e.prefill("late", [1, 2, 3], 4, G)  # stops before its first chunk
    assert e.live_requests == 0 and e.reserved_tokens == 0


def test_chunked_prefill_equals_one_shot(target_model):
    """A prompt prefilled in 7-token chunks gives the first token, features and KV of a
    one-shot prefill (up to float rounding: other shapes)."""
    prompt = list(range(100, 150))
    outs = []
    for chunk in (7, 512):
        e = TargetEngine(target_model, (1, 14, 27), max_context=256, kv_pool_tokens=1000, prefill_chunk=chunk)
        outs.append((e.prefill("r", prompt, 4, G, "tree", 4), e._requests["r"].cache))
    (a, ca), (b, cb) = outs
    assert a.first_token == b.first_token and ca.length == cb.length == 50
    assert torch.allclose(a.features, b.features, rtol=1e-4, atol=1e-3)
    assert torch.allclose(ca.k[:, :50], cb.k[:, :50], rtol=1e-4, atol=1e-4)


def test_release_stops_a_prefill_between_chunks(target_model):
    """A release that arrives while a long prompt is being prefilled stops it at the next chunk
    boundary (before the end) and frees its KV; the engine then serves the next request."""
    import threading

    e = TargetEngine(target_model, (), max_context=4096, kv_pool_tokens=8192, prefill_chunk=8)
    started, errors = threading.Event(), []
    original = e.model.forward

    def forward(*a, **k):  # observe the first chunk, then let the release race the rest
        started.set()
        return original(*a, **k)

    e.model.forward = forward
    try:
        t = threading.Thread(target=lambda: errors.append(pytest.raises(UnknownRequest, e.prefill, "long",
                                                                           list(range(3000)), 4, G)))
        t.start()
        started.wait(60)
        assert e.release(["long"]) == 0  # not live yet: marked, its prefill stops between chunks
        t.join(120)
    finally:
        e.model.forward = original
    done = int(str(errors[0].value).split("after ")[1].split(" of")[0])
    assert 0 < done < 3000 and e.reserved_tokens == 0 and e.live_requests == 0
    assert e.prefill("next", [1, 2, 3], 4, G).first_token >= 0 and e.live_requests == 1


def test_admission_waits_for_room_and_refuses_what_can_never_fit(target_model):
    """A prefill that would fit the empty pool waits (up to wait_seconds) while other requests
    hold the rows and goes ahead once they are released; one that can never fit is refused at
    once, naming the sizes; the wait ends with ResourceExhausted after wait_seconds, or with
    UnknownRequest when its id is released meanwhile."""
    import threading

    e = TargetEngine(target_model, (), max_context=512, kv_pool_tokens=300, max_tree_budget=16)
    with pytest.raises(ResourceExhausted, match=r"never fit.*prompt_tokens \(3\).*max_new_tokens \(297\).*kv_pool_tokens 300"):
        e.prefill("huge", [1, 2, 3], 297, G, wait_seconds=30)
    e.prefill("a", [1, 2, 3], 100, G)  # 104 rows held
    with pytest.raises(ResourceExhausted, match="waited"):
        e.prefill("b", [1, 2, 3], 200, G, wait_seconds=0.05)
    with pytest.raises(ResourceExhausted, match="KV pool full"):
        e.prefill("b", [1, 2, 3], 200, G)  # no wait_seconds: refused at once, as before
    out = []
    waiter = threading.Thread(target=lambda: out.append(e.prefill("b", [1, 2, 3], 200, G, wait_seconds=60)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and e.live_requests == 1  # queued, not failed
    assert e.release(["a"]) == 1
    waiter.join(60)
    assert out and out[0].first_token >= 0 and e.live_requests == 1 and e.reserved_tokens == 204
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(
        pytest.raises(UnknownRequest, e.prefill, "c", [1, 2, 3], 200, G, wait_seconds=60)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    assert e.release(["c"]) == 0  # its caller gave up while it waited
    waiter.join(60)
    assert errors and "while waiting" in str(errors[0].value)
    assert e.release(["b"]) == 1 and e.reserved_tokens == 0 and e.live_requests == 0


def test_held_feature_rows_come_back_first_with_the_next_verify(target_model, monkeypatch):
    """``hold``: a verify keeps its path's feature rows (its reply carries none); the next verify
    without it returns them first, oldest first (``held_rows``), then its own path's — the rows a
    request that never held received, round by round; at most ``MAX_HELD_ROWS`` (the newest) are
    kept; an autoregressive request has no rows to hold. A prefill with ``hold`` keeps the prompt's
    rows the same way (its reply has none; they come first)."""
    import target_service.engine as engine

    e = TargetEngine(target_model, (1, 2), max_context=256, kv_pool_tokens=1024, max_tree_budget=4)
    prompt = [1, 9690, 198, 2683, 359, 253]

    prompt_rows = {}

    def one_token_rounds(rid, holds, hold_prompt=False):
        pre = e.prefill(rid, prompt, 16, G, "tree", 4, hold=hold_prompt)
        bonus, out, commit, prompt_rows[rid] = pre.first_token, [], None, pre.features
        for hold in holds:
            v = e.verify(rid, [bonus], [-1], commit, hold)
            out.append(v)
            commit, bonus = v.feature_nodes, v.samples[0]  # (a one-token tree: the path is its root)
        e.release([rid])
        return out

    plain = one_token_rounds("plain", [False] * 6)
    held = one_token_rounds("held", [True, True, True, False, True, False])
    assert [v.samples for v in held] == [v.samples for v in plain]
    assert [v.features is None for v in held] == [True, True, True, False, True, False]
    assert [v.held_rows for v in held] == [0, 0, 0, 3, 0, 1]
    assert torch.equal(held[3].features, torch.cat([v.features for v in plain[:4]]))
    assert torch.equal(held[5].features, torch.cat([v.features for v in plain[4:]]))
    opened = one_token_rounds("opened", [True, False, False], hold_prompt=True)
    assert prompt_rows["opened"] is None and opened[0].features is None
    assert [v.held_rows for v in opened] == [0, len(prompt) + 1, 0]
    assert torch.equal(opened[1].features, torch.cat([prompt_rows["plain"]] + [v.features for v in plain[:2]]))
    assert torch.equal(opened[2].features, plain[2].features)

    monkeypatch.setattr(engine, "MAX_HELD_ROWS", 2)
    capped = one_token_rounds("capped", [True, True, True, False])
    assert capped[3].held_rows == 2 and torch.equal(capped[3].features, torch.cat([v.features for v in plain[1:4]]))
    capped = one_token_rounds("capped-open", [False], hold_prompt=True)  # the prompt's newest 2 rows
    assert capped[0].held_rows == 2 and torch.equal(capped[0].features,
                                                    torch.cat([prompt_rows["plain"][-2:], plain[0].features]))

    v = e.verify("ar", [e.prefill("ar", prompt, 4, G, hold=True).first_token], [-1], None, True)
    assert v.features is None and v.held_rows == 0 and e._requests["ar"].held == []
    e.release(["ar"])
