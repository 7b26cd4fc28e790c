"""Fuzzing the target's ``specdec.v2.TargetService/Session`` stream with hypothesis.

A case is one session, driven step by step (``st.data()``): an open (valid, or with one field
broken), then up to a few messages, each a valid verify built from the session's state (a
commit = a random root path of the pending tree, a random tree rooted at the pending bonus
token, parents/depths/budget up to the limit), a verify with exactly one fault, a message out
of order (open twice, an empty message, a verify first), an undecodable message, or a second
session on the same live id; then the stream ends (closed, cancelled or refused). A model of
the session (``TargetModel``: bonus, pending tree and samples, committed rows, KV capacity)
gives each message's expected status: OK, INVALID_ARGUMENT, FAILED_PRECONDITION or
RESOURCE_EXHAUSTED (a valid tree past the request's KV reservation). Replies are checked
against it (samples and edge probabilities per node, feature rows = the sample-consistent
path); nothing may stay on the target afterwards; the canary stays identical.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, strategies as st

from conftest import CALL_TIMEOUT, ci, slow
from modeling.acceptance import resolve
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import common_pb2 as v2, target_pb2
from streams import RawSession, code_of, run_leak_checked

VOCAB, MAX_CONTEXT, MAX_BUDGET, WIDTH = 49152, 8192, 64, 3 * 576
OK, INVALID, PRECONDITION, EXHAUSTED = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)
SESSION = "/specdec.v2.TargetService/Session"
MODES = {v2.MODE_AUTOREGRESSIVE: False, v2.MODE_CHAIN: True, v2.MODE_TREE: True}  # mode → speculative


@dataclass
class TargetModel:
    """What the target must hold for an open session."""
    prompt_len: int
    budget: int          # non-root nodes per tree (0 in autoregressive mode)
    speculative: bool
    greedy: bool
    capacity: int        # KV rows reserved: prompt + max_new_tokens + budget + 1
    bonus: int
    committed: int       # rows in the KV
    pending: tuple | None = None  # (tokens, parents, samples) of the last verified tree


# ---- open

def sampling(draw, bad: bool) -> tuple[common_pb2.SamplingParams, bool]:
    if not bad:
        greedy = draw(st.booleans())
        t = 0.0 if greedy else draw(st.floats(0.0625, 2.0, width=32))
        p = common_pb2.SamplingParams(temperature=t, top_k=draw(st.sampled_from([0, 0, 1, 5, VOCAB])),
                                      top_p=draw(st.sampled_from([0.0, 1.0, 0.9, 1e-45])),
                                      seed=draw(st.integers(0, 2 ** 64 - 1)))
        return p, greedy or p.top_k == 1
    field, value = draw(st.sampled_from([
        ("temperature", math.nan), ("temperature", -0.5), ("temperature", math.inf), ("top_k", -1),
        ("top_k", VOCAB + 1), ("top_p", 1.5), ("top_p", math.nan), ("top_p", -0.25), ("min_p", 0.1),
        ("repetition_penalty", 1.2), ("frequency_penalty", -1.0), ("presence_penalty", math.nan)]))
    p = common_pb2.SamplingParams(temperature=0.7)
    setattr(p, field, value)
    return p, False


OPEN_FAULTS = ["prompt_empty", "prompt_token", "max_new", "context", "sampling", "mode", "budget"]


def draw_open(data) -> tuple[target_pb2.TargetMessage, str | None, TargetModel | None]:
    """(message, fault or None, the model if it must open)."""
    draw = data.draw
    fault = draw(st.one_of(st.none(), st.none(), st.none(), st.sampled_from(OPEN_FAULTS)))
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
    max_new = draw(st.one_of(st.integers(1, 4), st.integers(1, 64)))
    mode = draw(st.sampled_from(list(MODES)))
    budget = draw(st.one_of(st.integers(1, 6), st.integers(1, MAX_BUDGET))) if MODES[mode] else \
        draw(st.one_of(st.just(0), st.integers(-2 ** 31, 2 ** 31 - 1)))  # ignored in autoregressive mode
    params, greedy = sampling(draw, fault == "sampling")
    if fault == "prompt_empty":
        prompt = []
    elif fault == "prompt_token":
        prompt[draw(st.integers(0, len(prompt) - 1))] = draw(st.sampled_from([-1, VOCAB, 2 ** 31 - 1, -2 ** 31]))
    elif fault == "max_new":
        max_new = draw(st.sampled_from([0, -1, -2 ** 31]))
    elif fault == "context":
        max_new = draw(st.integers(MAX_CONTEXT - len(prompt) + 1, MAX_CONTEXT))
    elif fault == "mode":
        mode = draw(st.one_of(st.just(v2.MODE_UNSPECIFIED), st.integers(4, 2 ** 31 - 1), st.integers(-2 ** 31, -1)))
    elif fault == "budget":
        mode = draw(st.sampled_from([v2.MODE_CHAIN, v2.MODE_TREE]))
        budget = draw(st.sampled_from([0, -1, MAX_BUDGET + 1, 2 ** 31 - 1]))
    msg = target_pb2.TargetMessage(open=target_pb2.TargetOpen(prompt_tokens=prompt, max_new_tokens=max_new,
                                                              sampling=params, mode=mode, tree_budget=budget))
    if fault:
        return msg, fault, None
    spec = MODES[mode]
    b = budget if spec else 0
    return msg, None, TargetModel(len(prompt), b, spec, greedy, len(prompt) + max_new + b + 1, -1, len(prompt))


# ---- verify

def random_tree(draw, root: int, nodes: int) -> tuple[list[int], list[int]]:
    """A valid tree: ``nodes`` nodes below ``root``, parents before children, distinct sibling tokens."""
    tokens, parents, seen = [root], [-1], set()
    shape = draw(st.sampled_from(["chain", "bushy", "random"]))
    for i in range(1, nodes + 1):
        p = i - 1 if shape == "chain" else 0 if shape == "bushy" else draw(st.integers(0, i - 1))
        t = draw(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 20), st.sampled_from([0, VOCAB - 1])))
        while (p, t) in seen:
            t = (t + 1) % VOCAB
        seen.add((p, t))
        tokens.append(t)
        parents.append(p)
    return tokens, parents


def root_path(parents: list[int], v: int) -> list[int]:
    path = [v]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


VERIFY_FAULTS = ["commit_unexpected", "commit_missing", "commit_root", "commit_not_path", "tree_empty",
                 "length_mismatch", "over_budget", "root_parent", "root_token", "parent_range", "token_range",
                 "sibling_repeat"]


def draw_verify(data, m: TargetModel, fault: str | None):
    """(message, expected code, commit, tokens, parents) for a verify on model ``m`` with at most
    one ``fault`` (a fault that does not apply to this state is replaced by a valid message)."""
    draw = data.draw
    if m.pending is None:
        commit, bonus = [], m.bonus
    else:
        ptok, ppar, psam = m.pending
        commit = root_path(ppar, draw(st.integers(0, len(ptok) - 1)))
        bonus = psam[commit[-1]]
    nodes = draw(st.one_of(st.integers(0, min(m.budget, 4)), st.integers(0, min(m.budget, 4)), st.integers(0, m.budget),
                           st.just(m.budget)))
    tokens, parents = random_tree(draw, bonus, nodes)
    code = OK
    if fault == "commit_unexpected" and m.pending is None:
        commit, code = [0], PRECONDITION
    elif fault == "commit_missing" and m.pending is not None:
        commit, code = [], PRECONDITION
    elif fault == "commit_root" and m.pending is not None:
        commit, code = [draw(st.sampled_from([1, -1, len(m.pending[0]), 2 ** 31 - 1]))] + commit[1:], INVALID
    elif fault == "commit_not_path" and m.pending is not None:
        ppar = m.pending[1]
        wrong = [j for j in range(1, len(ppar)) if ppar[j] != commit[-1]] + [len(ppar), -1, 0]
        commit, code = commit + [draw(st.sampled_from(wrong))], INVALID
    elif fault == "tree_empty":
        tokens, parents, code = [], [], INVALID
    elif fault == "length_mismatch":
        parents, code = parents + [0] if draw(st.booleans()) else parents[:-1], INVALID
    elif fault == "over_budget":
        tokens, parents = random_tree(draw, bonus, m.budget + draw(st.integers(1, 3)))
        code = INVALID
    elif fault == "root_parent":
        parents, code = [draw(st.sampled_from([0, 1, -2, 2 ** 31 - 1]))] + parents[1:], INVALID
    elif fault == "root_token":
        tokens, code = [(bonus + draw(st.integers(1, VOCAB - 1))) % VOCAB] + tokens[1:], PRECONDITION
    elif fault in ("parent_range", "token_range", "sibling_repeat") and len(tokens) >= 3:
        i = draw(st.integers(2 if fault == "sibling_repeat" else 1, len(tokens) - 1))
        if fault == "parent_range":
            parents[i] = draw(st.sampled_from([i, i + 1, -1, -2 ** 31, 2 ** 31 - 1]))
        elif fault == "token_range":
            tokens[i] = draw(st.sampled_from([-1, VOCAB, 2 ** 31 - 1, -2 ** 31]))
        else:  # make node i a sibling of an earlier node with the same token
            j = draw(st.integers(1, i - 1))
            parents[i], tokens[i] = parents[j], tokens[j]
            parents[i + 1:] = [p if p != i else j for p in parents[i + 1:]]  # keep i's children valid
        code = INVALID
    if code == OK and m.committed + len(commit) + len(tokens) > m.capacity:
        code = EXHAUSTED
    msg = target_pb2.TargetMessage(verify=target_pb2.TargetVerify(
        commit=commit, tree=common_pb2.TokenTree(tokens=tokens, parents=parents)))
    return msg, code, commit, tokens, parents


# ---- reply checks

def check_features(t: common_pb2.Tensor, rows: int) -> None:
    assert t.dtype == "float32" and list(t.shape) == [rows, WIDTH] and len(t.data) == rows * WIDTH * 4


def check_verified(m: TargetModel, tokens, parents, r: target_pb2.TargetReply) -> list[int]:
    v = r.verified
    n = len(tokens)
    samples, edge = list(v.samples), list(v.edge_probs)
    assert len(samples) == n and all(0 <= s < VOCAB for s in samples)
    assert len(edge) == n and edge[0] == 1.0 and all(-1e-6 <= e <= 1 + 1e-6 for e in edge)
    if m.greedy:
        assert edge == [1.0] + [float(tokens[i] == samples[parents[i]]) for i in range(1, n)]
    path, _ = resolve(tokens, parents, samples)
    if m.speculative:
        assert list(v.feature_nodes) == path
        check_features(v.context_features, len(path))
    else:
        assert list(v.feature_nodes) == [] and not v.HasField("context_features")
    return samples


# ---- one session

STEPS = ["verify", "verify", "verify", "fault", "fault", "open_again", "empty", "garbage", "duplicate", "end"]


def run_session(lb, channel, data) -> None:
    draw = data.draw
    wid = uuid.uuid4().hex
    s = RawSession(channel, SESSION, target_pb2.TargetReply, wid, CALL_TIMEOUT)
    first = draw(st.sampled_from(["open"] * 8 + ["verify", "empty"]))
    if first != "open":  # out of order: nothing is open yet
        msg = target_pb2.TargetMessage() if first == "empty" else target_pb2.TargetMessage(
            verify=target_pb2.TargetVerify(tree=common_pb2.TokenTree(tokens=[1], parents=[-1])))
        code, details, _ = code_of(lambda: s.send(msg))
        assert code == PRECONDITION, (code, details)
        return
    msg, fault, m = draw_open(data)
    code, details, r = code_of(lambda: s.send(msg))
    if fault:
        assert code == INVALID, (fault, code, details)
        return
    assert code == OK, (code, details)
    o = r.opened
    assert 0 <= o.first_token < VOCAB
    if m.speculative:
        check_features(o.context_features, m.prompt_len)
    else:
        assert not o.HasField("context_features")
    m.bonus = o.first_token
    for _ in range(draw(st.integers(0, 5))):
        step = draw(st.sampled_from(STEPS))
        if step == "end":
            break
        if step == "duplicate":  # a second session on the live id is refused and frees nothing
            other = RawSession(channel, SESSION, target_pb2.TargetReply, wid, CALL_TIMEOUT)
            code, details, _ = code_of(lambda: other.send(draw_open(data)[0]))
            assert code == INVALID, (code, details)
            continue
        if step in ("open_again", "empty", "garbage"):
            raw = {"open_again": msg.SerializeToString(), "empty": b"", "garbage": b"\x12\xff\x01"}[step]
            code, details, _ = code_of(lambda: s.send(raw))
            assert code == (INVALID if step == "garbage" else PRECONDITION), (step, code, details)
            return
        fault = draw(st.sampled_from(VERIFY_FAULTS)) if step == "fault" else None
        vmsg, expected, commit, tokens, parents = draw_verify(data, m, fault)
        code, details, r = code_of(lambda: s.send(vmsg))
        assert code == expected, (fault, code, details)
        if code != OK:
            return
        if commit:
            m.committed += len(commit)
        m.pending = (tokens, parents, check_verified(m, tokens, parents, r))
    if draw(st.booleans()):
        s.close()
    else:
        s.cancel()


def _run(lb, channel, data):
    assert (lb.target_engine.vocab_size, lb.target_engine.max_context) == (VOCAB, MAX_CONTEXT)
    run_leak_checked(lb, lambda: run_session(lb, channel, data), "target")


@ci(50)
@given(data=st.data())
def test_fuzz_target_session(loopback, channels, canary, data):
    _run(loopback, channels["target"], data)


@pytest.mark.slow
@slow(3000)
@given(data=st.data())
def test_fuzz_target_session_slow(loopback, channels, canary, data):
    _run(loopback, channels["target"], data)
