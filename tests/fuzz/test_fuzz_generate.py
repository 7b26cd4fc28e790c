"""Fuzzing the public ``specdec.v1.Orchestrator/Generate`` with hypothesis.

Each case is a GenerateRequest drawn field by field around the documented limits (prompts as
text, chat or token ids: empty, unicode, special-token text, over the character limit, over
max_context; max_tokens; modes incl. unknown enum values; tree_budget; sampling params incl.
NaN/inf/negative and the unsupported options; stop lists; stop_token_ids; seeds; request ids),
sometimes sent as raw bytes holding invalid UTF-8 in a string field, sometimes with a tiny
client deadline. An independent oracle (``violations``) lists the limits a case breaks:
none → the request must succeed (the stream ends with one ``Final`` that agrees with the
deltas; a long generation is cancelled after its first message); some → INVALID_ARGUMENT
whose details name one of them. Every call is bounded by a deadline; the services must keep
serving, hold nothing afterwards, and the canary (a concurrent greedy request) must stay
token-identical to its autoregressive reference.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import given, strategies as st

from conftest import CALL_TIMEOUT, ci, slow
from specdec_proto.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

MAX_CONTEXT, MAX_TOKENS, MAX_BUDGET, VOCAB = 8192, 4096, 64, 49152
MAX_STOP, MAX_STOP_CHARS, MAX_CHARS = 16, 256, 32 * 8192
INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
#: Valid requests asking for more tokens than this are cancelled after their first message.
RUN_TO_END = 3


def f32(x: float) -> float:
    """x as a protobuf float field carries it."""
    return struct.unpack("<f", struct.pack("<f", x))[0] if math.isfinite(x) and abs(x) < 3.4e38 else x


@dataclass
class Case:
    prompt: tuple          # ("text", str) | ("chat", [(role, content)]) | ("ids", list) | ("ids_fill", n) | ("none",)
    max_tokens: int
    mode: int
    tree_budget: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    unsupported: dict      # min_p / penalties
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    request_id: str
    bad_utf8: tuple | None = None  # (field number path, raw bytes) appended to the serialized request
    timeout: float = CALL_TIMEOUT
    notes: list = field(default_factory=list)

    def message(self) -> orchestrator_pb2.GenerateRequest:
        req = orchestrator_pb2.GenerateRequest(
            max_tokens=self.max_tokens, mode=self.mode, tree_budget=self.tree_budget, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, request_id=self.request_id,
            sampling=common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                               seed=self.seed, **self.unsupported))
        kind = self.prompt[0]
        if kind == "text":
            req.text = self.prompt[1]
        elif kind == "chat":
            req.chat.SetInParent()
            req.chat.messages.extend(orchestrator_pb2.ChatMessage(role=r, content=c) for r, c in self.prompt[1])
        elif kind == "ids":
            req.token_ids.ids.extend(self.prompt[1])
        elif kind == "ids_fill":
            req.token_ids.ids.extend([1] * self.prompt[1])
        return req

    def wire_bytes(self) -> bytes:
        raw = self.message().SerializeToString()
        if self.bad_utf8:
            path, payload = self.bad_utf8
            for number in reversed(path):  # wrap innermost first: (2, 1, 2) = chat.messages[].content
                payload = _field(number, payload)
            raw += payload
        return raw


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


# ---- strategies

def _text(max_size: int = 24):
    # any code point but surrogates (protobuf strings are UTF-8); some chat-template / special text
    return st.one_of(st.text(max_size=max_size),
                     st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\x00", "\u202e", "🙂" * 3,
                                      "\ufeff", "a\r\nb", "{{ x }}", "{% raw %}"]))


VALID_ROLES = st.sampled_from(["user", "system", "assistant"])
GOOD = dict(
    prompt=st.one_of(
        st.tuples(st.just("text"), st.text(min_size=1, max_size=48)),
        st.tuples(st.just("text"), _text(12).map(lambda t: "Say: " + t)),
        st.tuples(st.just("chat"), st.lists(st.tuples(VALID_ROLES, _text(24)), min_size=1, max_size=3)),
        st.tuples(st.just("ids"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16))),
    max_tokens=st.one_of(*[st.integers(1, RUN_TO_END)] * 4, st.integers(1, MAX_TOKENS), st.just(MAX_TOKENS)),
    mode=st.sampled_from([0, 1, 2, 3]),
    tree_budget=st.one_of(st.integers(0, MAX_BUDGET), st.sampled_from([0, 1, MAX_BUDGET])),
    temperature=st.one_of(st.just(0.0), st.just(0.0), st.floats(0, 2, width=32), st.sampled_from([-0.0, 1e-45, 3.4e38])),
    top_k=st.one_of(st.just(0), st.just(0), st.integers(0, 64), st.sampled_from([1, VOCAB])),
    top_p=st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1, width=32), st.sampled_from([-0.0, 1e-45])),
    unsupported=st.one_of(st.just({}), st.just({}), st.just({"repetition_penalty": 1.0}),
                          st.just({"min_p": 0.0, "presence_penalty": -0.0})),
    stop=st.one_of(st.just([]), st.lists(_text(6).filter(bool), max_size=3),
                   st.just(["z"] * MAX_STOP), st.just(["s" * MAX_STOP_CHARS])),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    request_id=st.one_of(st.just(""), st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
                         st.just("r" * 128)),
    bad_utf8=st.none(),
)
BAD = dict(
    prompt=st.one_of(
        st.just(("text", "")), st.just(("chat", [])), st.just(("ids", [])), st.just(("none",)),
        st.tuples(st.just("text"), st.integers(MAX_CHARS + 1, MAX_CHARS + 40).map(lambda n: "x" * n)),
        st.tuples(st.just("chat"), st.integers(MAX_CHARS + 1, MAX_CHARS + 10).map(lambda n: [("user", "y" * n)])),
        st.tuples(st.just("chat"), st.lists(st.tuples(st.sampled_from(["wizard", "", "User", "tool"]), _text(8)),
                                            min_size=1, max_size=2)),
        st.tuples(st.just("ids"), st.lists(st.sampled_from([-1, VOCAB, VOCAB + 1, 2 ** 31 - 1, -2 ** 31]),
                                           min_size=1, max_size=3)),
        st.tuples(st.just("ids_fill"), st.integers(MAX_CONTEXT - 8, MAX_CONTEXT + 8)),  # with max_tokens: > max_context
        st.tuples(st.just("text"), st.integers(MAX_CONTEXT, MAX_CONTEXT + 100).map(lambda n: " hello" * n))),
    max_tokens=st.one_of(st.sampled_from([0, -1, MAX_TOKENS + 1, 2 ** 31 - 1, -2 ** 31]),
                         st.integers(MAX_TOKENS + 1, 2 ** 31 - 1), st.integers(-2 ** 31, 0)),
    mode=st.one_of(st.integers(4, 2 ** 31 - 1), st.integers(-2 ** 31, -1), st.sampled_from([4, -1])),
    tree_budget=st.one_of(st.integers(MAX_BUDGET + 1, 2 ** 31 - 1), st.integers(-2 ** 31, -1),
                          st.sampled_from([MAX_BUDGET + 1, -1])),
    temperature=st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1e-45]),
                          st.floats(max_value=-1.0, width=32)),
    top_k=st.one_of(st.integers(-2 ** 31, -1), st.integers(VOCAB + 1, 2 ** 31 - 1)),
    top_p=st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 1.0000001, 1.5, -1e-45]),
                    st.floats(min_value=2.0, width=32), st.floats(max_value=-1.0, width=32)),
    unsupported=st.dictionaries(st.sampled_from(["min_p", "repetition_penalty", "frequency_penalty",
                                                 "presence_penalty"]),
                                st.floats(width=32).filter(lambda x: x not in (0.0, 1.0)), min_size=1, max_size=2),
    stop=st.one_of(st.just([""]), st.just(["a", ""]), st.just(["z"] * (MAX_STOP + 1)),
                   st.just(["s" * (MAX_STOP_CHARS + 1)])),
    stop_token_ids=st.lists(st.one_of(st.integers(-2 ** 31, -1), st.integers(VOCAB, 2 ** 31 - 1)), min_size=1,
                            max_size=2),
    request_id=st.one_of(st.just("r" * 129), st.text(min_size=129, max_size=140), st.just("a\nb"), st.just("\x00"),
                         st.just("tab\there"), st.just("¡"), st.just("id-é"), st.just("🙂")),
    bad_utf8=st.tuples(st.sampled_from([(1,), (5,), (11,), (2, 1, 2), (2, 1, 1)]),
                       st.tuples(_text(6), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf",
                                                            b"\xf4\x90\x80\x80"]))
                       .map(lambda t: t[0].encode() + t[1])),
)
FIELDS = sorted(BAD)


@st.composite
def cases(draw) -> Case:
    """A valid request with no, one or a few fields broken (the oracle judges the result)."""
    broken = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(FIELDS), min_size=1, max_size=1),
                            st.sets(st.sampled_from(FIELDS), min_size=1, max_size=1),
                            st.sets(st.sampled_from(FIELDS), min_size=2, max_size=4)))
    v = {f: draw((BAD if f in broken else GOOD)[f]) for f in FIELDS}
    if v["prompt"][0] == "ids_fill":  # over max_context together with max_tokens (valid would mean a huge prefill)
        v["max_tokens"] = draw(st.integers(max(1, MAX_CONTEXT - v["prompt"][1] + 1), max(8, MAX_CONTEXT - v["prompt"][1] + 8)))
    return Case(seed=draw(st.one_of(st.none(), st.integers(0, 2 ** 64 - 1))), ignore_eos=draw(st.booleans()),
                timeout=draw(st.one_of(*[st.just(CALL_TIMEOUT)] * 15, st.sampled_from([0.001, 0.02, 0.2]))), **v)


# ---- the oracle

def prompt_tokens(case: Case, tok) -> int | None:
    """Token count of the prompt as the orchestrator would tokenize it (None: refused before)."""
    kind = case.prompt[0]
    if kind == "text":
        return len(tok.encode(case.prompt[1])) if len(case.prompt[1]) <= MAX_CHARS else None
    if kind == "chat":
        msgs = case.prompt[1]
        if sum(len(c) for _, c in msgs) > MAX_CHARS or not msgs or any(r not in ("system", "user", "assistant")
                                                                         for r, _ in msgs):
            return None
        return len(tok.encode(tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs])))
    if kind == "ids":
        return len(case.prompt[1])
    if kind == "ids_fill":
        return case.prompt[1]
    return None


def violations(case: Case, tok) -> list[str]:
    """The documented limits this case breaks, each as a word the refusal's details must hold."""
    if case.bad_utf8:
        return ["UTF-8"]
    v = []
    if len(case.request_id) > 128 or not (case.request_id.isascii() and case.request_id.isprintable()):
        v.append("request_id")
    kind = case.prompt[0]
    if kind == "none":
        v.append("prompt")
    elif kind == "text" and len(case.prompt[1]) > MAX_CHARS or kind == "chat" and sum(
            len(c) for _, c in case.prompt[1]) > MAX_CHARS:
        v.append("characters")
    elif kind == "chat" and not case.prompt[1]:
        v.append("messages")
    elif kind == "chat" and any(r not in ("system", "user", "assistant") for r, _ in case.prompt[1]):
        v.append("role")
    elif kind == "ids" and any(not 0 <= t < VOCAB for t in case.prompt[1]):
        v.append("token_ids")
    n = prompt_tokens(case, tok)
    if n == 0:
        v.append("prompt")
    if n is not None and n >= MAX_CONTEXT:
        v.append("max_context")
    if not 1 <= case.max_tokens <= MAX_TOKENS:
        v.append("max_tokens")
    elif n is not None and n + case.max_tokens > MAX_CONTEXT:
        v.append("max_context")
    if case.mode not in (0, 1, 2, 3):
        v.append("mode")
    if not 1 <= (case.tree_budget or 32) <= MAX_BUDGET:
        v.append("tree_budget")
    if len(case.stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in case.stop):
        v.append("stop")
    if any(not 0 <= t < VOCAB for t in case.stop_token_ids):
        v.append("stop_token_ids")
    for name, value in case.unsupported.items():
        if not (value == 0 or name == "repetition_penalty" and value == 1):
            v.append(f"sampling.{name}")
    t, p = f32(case.temperature), f32(case.top_p) or 1.0
    if math.isnan(t) or math.isinf(t) or t < 0:
        v.append("sampling.temperature")
    if not 0 <= case.top_k <= VOCAB:
        v.append("sampling.top_k")
    if math.isnan(p) or not 0 < p <= 1:
        v.append("sampling.top_p")
    return v


# ---- one case against the served API

def check_case(lb, tok, stub, raw_call, case: Case) -> None:
    expected = violations(case, tok)
    tiny_deadline = case.timeout < CALL_TIMEOUT
    cancel_early = not expected and case.max_tokens > RUN_TO_END
    responses = []
    try:
        call = raw_call(case.wire_bytes(), timeout=case.timeout) if case.bad_utf8 else \
            stub.Generate(case.message(), timeout=case.timeout)
        for r in call:
            responses.append(r)
            if cancel_early:
                call.cancel()
                break
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    if tiny_deadline and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return
    if expected:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, expected)
        assert any(word in details for word in expected), (details, expected)
        return
    assert code == grpc.StatusCode.OK, (code, details)
    if cancel_early:
        assert responses, "an accepted request sends its first message before it is cancelled"
        return
    *deltas, last = responses
    assert last.WhichOneof("event") == "final" and all(d.WhichOneof("event") == "delta" for d in deltas)
    ids = [t for d in deltas for t in d.delta.token_ids]
    text = "".join(d.delta.text for d in deltas)
    f = last.final
    assert f.usage.completion_tokens == len(ids) and 1 <= len(ids) <= case.max_tokens
    assert f.finish_reason in ("stop", "length")
    assert f.finish_reason == "stop" or len(ids) == case.max_tokens
    assert f.usage.prompt_tokens == prompt_tokens(case, tok)
    assert all(0 <= t < VOCAB for t in ids)
    assert not any(s in text for s in case.stop if s), (text, case.stop)
    if case.request_id:
        assert f.request_id == case.request_id
    if f.finish_reason == "stop" and not case.stop:
        stops = set(case.stop_token_ids) | (set() if case.ignore_eos else set(lb.target_engine.model.cfg.eos_token_ids))
        assert ids[-1] in stops, (ids, stops)


@pytest.fixture(scope="module")
def public(channels):
    """(Generate stub, Generate taking raw request bytes)."""
    ch = channels["orchestrator"]
    return orchestrator_pb2_grpc.OrchestratorStub(ch), ch.unary_stream(
        "/specdec.v1.Orchestrator/Generate", request_serializer=lambda b: b,
        response_deserializer=orchestrator_pb2.GenerateResponse.FromString)


def _run(loopback, tokenizer, public, case):
    assert (loopback.target_engine.max_context, loopback.target_engine.vocab_size) == (MAX_CONTEXT, VOCAB)
    stub, raw = public
    check_case(loopback, tokenizer, stub, raw, case)
    assert max(loopback.wait_at_most(1)) <= 1, ("worker state leaked (the canary holds at most one request)", loopback.held())


@ci(100)
@given(case=cases())
def test_fuzz_generate(loopback, tokenizer, public, canary, case):
    _run(loopback, tokenizer, public, case)


@pytest.mark.slow
@slow(4000)
@given(case=cases())
def test_fuzz_generate_slow(loopback, tokenizer, public, canary, case):
    _run(loopback, tokenizer, public, case)


def test_message_over_the_size_limit(loopback, channels, public):
    """A request over the services' 64 MB message limit is refused by gRPC itself with
    RESOURCE_EXHAUSTED, on the public API and on a worker stream; both keep serving."""
    from specdec_proto.v2 import draft_pb2
    from streams import RawSession, code_of

    stub, _ = public
    big = "x" * (65 * 2 ** 20)
    code, details, _ = code_of(lambda: list(stub.Generate(orchestrator_pb2.GenerateRequest(text=big, max_tokens=1),
                                                          timeout=CALL_TIMEOUT)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    s = RawSession(channels["draft"], "/specdec.v2.DraftService/Session", draft_pb2.DraftReply, "big", CALL_TIMEOUT)
    msg = draft_pb2.DraftMessage(context_features=common_pb2.Tensor(dtype="float32", shape=[65 * 2 ** 18],
                                                                   data=bytes(65 * 2 ** 20)))
    code, details, _ = code_of(lambda: s.send(msg))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    ids = [t for r in stub.Generate(orchestrator_pb2.GenerateRequest(text="hi", max_tokens=2), timeout=CALL_TIMEOUT)
           for t in r.delta.token_ids]
    assert len(ids) >= 1
    assert loopback.wait_idle() == (0, 0, 0)
