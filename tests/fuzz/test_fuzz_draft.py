"""Fuzzing the drafter's ``specdec.v2.DraftService/Session`` stream with hypothesis.

A case is one session driven step by step: messages carrying context-feature blobs (float32,
bfloat16 or float16; zeros, normal values, or raw random bytes incl. NaN/inf; 0..12 rows),
the context start and the bonus token, the first one binding mode and tree budget. Each
message is valid, or has exactly one fault (unknown dtype, byte count not matching the shape,
negative/wrong width/wrong rank shapes, bonus out of range, a context start out of sync or
past max_context, no or a bad ``open`` on the first message, a bad mode later, undecodable
bytes), or is a second session on the live id. The expected status per message:
INVALID_ARGUMENT / FAILED_PRECONDITION, else OK with a valid draft tree (rooted at the bonus,
parents before children, distinct sibling tokens, within the budget; a chain in chain mode).
Nothing may stay on the drafter afterwards; the canary stays identical.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import CALL_TIMEOUT, ci, slow
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import common_pb2 as v2, draft_pb2
from streams import RawSession, code_of, run_leak_checked

VOCAB, MAX_CONTEXT, MAX_BUDGET, BLOCK, WIDTH = 49152, 8192, 64, 8, 3 * 576
OK, INVALID, PRECONDITION = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
SESSION = "/specdec.v2.DraftService/Session"
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass
class DraftModel:
    mode: int = 0     # bound by the first message
    budget: int = 0
    length: int | None = None  # context rows held (None: no context yet)


def features(draw, rows: int, dtype: str, shape=None) -> common_pb2.Tensor:
    kind = draw(st.sampled_from(["zeros", "normal", "normal", "raw"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n = rows * WIDTH
    if kind == "raw":  # any bit pattern: NaN, inf, subnormals
        data = rng.integers(0, 256, size=n * np.dtype(_NP[dtype]).itemsize, dtype=np.uint8).tobytes()
    elif kind == "zeros":
        data = bytes(n * np.dtype(_NP[dtype]).itemsize)
    else:
        x = rng.normal(size=n).astype(np.float32)
        data = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() if dtype == "bfloat16" else \
            x.astype(_NP[dtype]).tobytes()
    return common_pb2.Tensor(dtype=dtype, shape=shape or [rows, WIDTH], data=data)


FAULTS = ["dtype", "bytes", "negative_shape", "width", "rank", "bonus", "start", "no_open", "mode", "budget"]


def draw_message(data, m: DraftModel, fault: str | None):
    """(message, expected code, the mode/budget it binds) for the next message on model ``m``."""
    draw = data.draw
    first = m.length is None
    rows = draw(st.one_of(st.integers(1, 4), st.integers(0, 12)))
    dtype = draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"]))
    start = 0 if first else m.length
    bonus = draw(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, VOCAB - 1])))
    mode = draw(st.sampled_from([v2.MODE_CHAIN, v2.MODE_TREE]))
    budget = draw(st.one_of(st.integers(1, 8), st.integers(1, MAX_BUDGET))) if mode == v2.MODE_TREE else \
        draw(st.one_of(st.just(0), st.integers(-2 ** 31, 2 ** 31 - 1)))  # not read in chain mode
    send_open = first or draw(st.integers(0, 4)) == 0  # a later open is ignored (if its mode is valid)
    code = OK
    feats = features(draw, rows, dtype)
    if fault == "dtype":
        feats.dtype, code = draw(st.sampled_from(["int8", "", "float64", "FLOAT32", "bf16", "float32 "])), INVALID
    elif fault == "bytes":
        cut = draw(st.integers(1, 7))
        feats.data, code = (feats.data[:-cut] if len(feats.data) >= cut and draw(st.booleans())
                            else feats.data + bytes(cut)), INVALID
    elif fault == "negative_shape":
        feats.shape[:], code = [-rows or -1, -WIDTH], INVALID
    elif fault == "width":
        w = WIDTH + draw(st.sampled_from([-1, 1, -WIDTH + 1, WIDTH]))
        feats = common_pb2.Tensor(dtype=dtype, shape=[1, w], data=bytes(w * np.dtype(_NP[dtype]).itemsize))
        code = INVALID
    elif fault == "rank":
        feats.shape[:] = draw(st.sampled_from([[rows * WIDTH], [1, rows, WIDTH], [rows, WIDTH, 1]]))
        code = INVALID
    elif fault == "bonus":
        bonus, code = draw(st.sampled_from([-1, VOCAB, 2 ** 31 - 1, -2 ** 31])), INVALID
    elif fault == "start":
        start = draw(st.one_of(st.integers(-5, 40), st.integers(MAX_CONTEXT - BLOCK - 12, MAX_CONTEXT + 5),
                               st.sampled_from([-2 ** 31, 2 ** 31 - 1])))
        if start == (0 if first else m.length):
            start += 1
        code = INVALID if start + rows + BLOCK > MAX_CONTEXT else PRECONDITION
    elif fault == "no_open" and first:
        send_open, code = False, PRECONDITION  # the session protocol: open first (as the target's)
    elif fault == "mode":  # first message: only CHAIN/TREE bind; later ones: an unknown enum value is refused
        mode, send_open = draw(st.sampled_from([v2.MODE_UNSPECIFIED, v2.MODE_AUTOREGRESSIVE, 4, -1])), True
        code = INVALID if first or mode not in (v2.MODE_AUTOREGRESSIVE, v2.MODE_CHAIN, v2.MODE_TREE) else OK
    elif fault == "budget" and first:
        mode, budget, code = v2.MODE_TREE, draw(st.sampled_from([0, -1, MAX_BUDGET + 1, 2 ** 31 - 1])), INVALID
    msg = draft_pb2.DraftMessage(context_features=feats, context_start=start, bonus_token=bonus)
    if send_open:
        msg.open.CopyFrom(draft_pb2.DraftOpen(mode=mode, tree_budget=budget))
    return msg, code, (mode, budget), rows


def check_tree(m: DraftModel, bonus: int, r: draft_pb2.DraftReply) -> None:
    tokens, parents = list(r.tree.tokens), list(r.tree.parents)
    n = len(tokens)
    assert n >= 1 and len(parents) == n and tokens[0] == bonus and parents[0] == -1
    assert all(0 <= parents[i] < i for i in range(1, n)) and all(0 <= t < VOCAB for t in tokens)
    assert len({(parents[i], tokens[i]) for i in range(1, n)}) == n - 1, "siblings repeat a token"
    if m.mode == v2.MODE_CHAIN:
        assert n <= BLOCK and parents == list(range(-1, n - 1))
    else:
        assert n - 1 <= m.budget


STEPS = ["draft", "draft", "draft", "fault", "fault", "garbage", "duplicate", "end"]


def run_session(lb, channel, data) -> None:
    draw = data.draw
    wid = uuid.uuid4().hex
    s = RawSession(channel, SESSION, draft_pb2.DraftReply, wid, CALL_TIMEOUT)
    m = DraftModel()
    for i in range(draw(st.integers(1, 5))):
        step = draw(st.sampled_from(STEPS)) if i else draw(st.sampled_from(["draft"] * 3 + ["fault"]))
        if step == "end":
            break
        if step == "duplicate":  # refused; the live session keeps its context
            other = RawSession(channel, SESSION, draft_pb2.DraftReply, wid, CALL_TIMEOUT)
            code, details, _ = code_of(lambda: other.send(draw_message(data, DraftModel(), None)[0]))
            assert code == INVALID, (code, details)
            continue
        if step == "garbage":
            raw = draw(st.sampled_from([b"\x12\xff\x01",  # context_features: truncated
                                        b"\x12\x05\x0a\x03\xff\xfe\xfd"]))  # dtype not UTF-8
            code, details, _ = code_of(lambda: s.send(raw))
            assert code == INVALID, (code, details)
            return
        fault = draw(st.sampled_from(FAULTS)) if step == "fault" else None
        msg, expected, (mode, budget), rows = draw_message(data, m, fault)
        code, details, r = code_of(lambda: s.send(msg))
        assert code == expected, (fault, code, details)
        if code != OK:
            return
        if m.length is None:
            m.mode, m.budget, m.length = mode, budget, 0
        m.length += rows
        check_tree(m, msg.bonus_token, r)
    if draw(st.booleans()):
        s.close()
    else:
        s.cancel()


def _run(lb, channel, data):
    de = lb.draft_engine
    assert (de.cfg.vocab_size, de.max_context, de.cfg.block_size, de.feature_width) == (VOCAB, MAX_CONTEXT, BLOCK, WIDTH)
    run_leak_checked(lb, lambda: run_session(lb, channel, data), "drafter")


@ci(60)
@given(data=st.data())
def test_fuzz_draft_session(loopback, channels, canary, data):
    _run(loopback, channels["draft"], data)


@pytest.mark.slow
@slow(3000)
@given(data=st.data())
def test_fuzz_draft_session_slow(loopback, channels, canary, data):
    _run(loopback, channels["draft"], data)
