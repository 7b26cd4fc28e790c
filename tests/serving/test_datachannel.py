"""The data channel (``serving.datachannel``): the workers' Session streams over Unix sockets.

Real threaded gRPC hosts with the real servicers over the real engines (``engines``), each also
serving its data channel; the orchestrator's real clients (``orchestrator.workers``) and round
loop (``orchestrator.generation``). Output through the data channel is plain greedy and equal,
token for token, to the gRPC path's (seeded sampling too); errors, cancellation, the host's
limits, the drain and the token behave as over gRPC. Framing: a property test."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lossless_reference import greedy_divergences
from modeling.sampling import SamplingParams
from orchestrator.generation import Finished, GenerationRequest, generate
from orchestrator.workers import DataChannelError, DraftWorker, SocketCall, TargetWorker
from protocol import wire
from protocol.types import Mode
from serving import datachannel as dc
from serving.server import DRAINING, GRACE_OVER, ServiceHost
from specdec_proto.v2 import target_pb2


# ---- framing

@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([dc.OPEN, dc.MESSAGE, dc.END, dc.ERROR]), st.binary(max_size=300)),
                max_size=8), st.integers(1, 64))
def test_frames_read_back_whole_however_the_bytes_are_cut(frames, cut):
    """Frames written back to back come out whole and in order from ``read_frame`` and from the
    client's ``_Frames`` protocol, whatever chunks the bytes arrive in; a truncated stream
    reads as its end."""
    import io

    from orchestrator.workers import _Frames

    data = b"".join(dc.frame(k, p) for k, p in frames)
    f = io.BytesIO(data)
    assert [dc.read_frame(f, 1 << 20) for _ in frames] == frames and dc.read_frame(f, 1 << 20) is None
    if data:
        assert dc.read_frame(io.BytesIO(data[:-1]), 1 << 20) in (None, *frames[:-1])

    class Sink:
        def __init__(self):
            self.got = []

        def frame(self, kind, payload):
            self.got.append((kind, payload))

    sink = Sink()
    proto = _Frames(sink)
    for i in range(0, len(data), cut):
        proto.data_received(data[i:i + cut])
    assert sink.got == frames and not proto.buf


def test_a_frame_over_the_limit_is_refused():
    import io

    with pytest.raises(dc.FrameTooLarge, match="larger than max"):
        dc.read_frame(io.BytesIO(dc.frame(dc.MESSAGE, b"x" * 101)), 100)


# ---- workers with data channels

class Workers:
    """The target and draft hosts (gRPC on loopback + data channel each)."""

    def __init__(self, engines, tmp):
        import draft_service.__main__ as draft_main
        import target_service.__main__ as target_main

        self.te, self.de = engines
        self.hosts = {"target": ServiceHost([target_main.ROLE.service]), "draft": ServiceHost([draft_main.ROLE.service])}
        self.refs = {"target": {"engine": self.te}, "draft": {"engine": self.de}}
        target_main.register(self.hosts["target"], self.refs["target"])
        draft_main.register(self.hosts["draft"], self.refs["draft"])
        self.paths = {n: os.path.join(tmp, f"{n}.sock") for n in self.hosts}
        self.channels = {}

    async def start(self):
        from types import SimpleNamespace

        self.addresses = {}
        for n, h in self.hosts.items():
            self.addresses[n] = f"127.0.0.1:{await h.start('127.0.0.1:0')}"
            await h.set_status(True)
            self.channels[n] = dc.serve_data_channel(SimpleNamespace(data_socket=self.paths[n]), h, self.refs[n])

    def clients(self, channel: str = "socket") -> tuple[TargetWorker, DraftWorker]:
        return (TargetWorker(self.addresses["target"], data_channel=channel),
                DraftWorker(self.addresses["draft"], data_channel=channel))

    def wait_idle(self, timeout: float = 10.0) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        while (now := (self.te.live_requests, self.de.live_requests)) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        return now


@pytest.fixture(scope="module")
def workers(engines, tmp_path_factory):
    w = Workers(engines, str(tmp_path_factory.mktemp("data")))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(w.start())
    yield w
    for c in w.channels.values():
        c.close()
    for h in w.hosts.values():
        loop.run_until_complete(h.server.stop(grace=None))
        h.close()
    loop.close()


async def _generate(w: Workers, tok, channel: str, prompt, mode, budget, max_tokens=8, sampling=SamplingParams()):
    target, draft = w.clients(channel)
    await target.info()
    await draft.info()
    assert bool(target.data_socket) == bool(draft.data_socket) == (channel == "socket")
    req = GenerationRequest("dc", prompt, max_tokens, mode=mode, tree_budget=budget or 1, sampling=sampling)
    out, fin = [], None
    async for ev in generate(req, tok, target, draft if mode != "autoregressive" else None):
        if isinstance(ev, Finished):
            fin = ev
        else:
            out += ev.token_ids
    return out, fin


# the fast tier keeps tree@16 (CI time); every greedy mode runs in the slow tier
GREEDY = [pytest.param("autoregressive", 0, marks=pytest.mark.slow), pytest.param("chain", 0, marks=pytest.mark.slow),
          ("tree", 16)]


@pytest.mark.parametrize("mode,budget", GREEDY, ids=["autoregressive", "chain", "tree16"])
def test_greedy_through_the_data_channel_is_plain_greedy(workers, tokenizer, target_model, mode, budget):
    """Every token through the data channel is the target's plain greedy choice; both workers
    hold nothing afterwards."""
    prompt = tokenizer.encode("def fibonacci(n):")
    out, fin = asyncio.run(_generate(workers, tokenizer, "socket", prompt, mode, budget, 12))
    assert len(out) == fin.completion_tokens == 12 and fin.finish_reason == "length"
    assert greedy_divergences(target_model, prompt, out) == (None, 0)
    assert workers.wait_idle() == (0, 0)


def test_seeded_sampling_through_the_data_channel_equals_the_grpc_path(workers, tokenizer):
    """The same seeded tree@4 request through gRPC and through the data channel: identical
    tokens and identical round statistics (the same protobufs, another transport)."""
    prompt = tokenizer.encode("Tell me a story about a lighthouse.")
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    via_grpc = asyncio.run(_generate(workers, tokenizer, "grpc", prompt, "tree", 4, 8, sampling))
    via_socket = asyncio.run(_generate(workers, tokenizer, "socket", prompt, "tree", 4, 8, sampling))
    assert via_socket[0] == via_grpc[0] and len(via_socket[0]) == 8
    assert via_socket[1].stats.histogram == via_grpc[1].stats.histogram
    assert workers.wait_idle() == (0, 0)


# ---- errors, cancellation, limits, drain, token: the same as over gRPC

async def _exchange_error(target: TargetWorker, msg) -> grpc.aio.AioRpcError:
    worker_id = "bad-" + os.urandom(4).hex()
    call = target.open(worker_id)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await target.exchange(call, msg, "prefill")
    await target.release(worker_id, abort=True)
    return e.value


@pytest.mark.parametrize("case", ["bad_sampling", "verify_first"])
def test_a_bad_message_gets_the_grpc_paths_status_and_message(workers, case):
    msgs = {"bad_sampling": wire.target_open([1, 2, 3], 4, SamplingParams(temperature=-1.0), Mode.TREE, 4),
            "verify_first": wire.target_verify([5], [-1], None)}

    async def both():
        out = []
        for channel in ("grpc", "socket"):
            target, _ = workers.clients(channel)
            await target.info()
            out.append(await _exchange_error(target, msgs[case]))
        return out
    via_grpc, via_socket = asyncio.run(both())
    assert via_socket.code() == via_grpc.code() and via_socket.details() == via_grpc.details()
    assert via_socket.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert workers.wait_idle() == (0, 0)


def _raw_session(path: str, metadata=(), messages: list[bytes] = (), end=False) -> list[tuple[int, bytes]]:
    """Frames the worker sends back to OPEN + ``messages`` (+ END), until it closes."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(dc.frame(dc.OPEN, json.dumps({"metadata": list(metadata), "timeout": 30}).encode())
                  + b"".join(dc.frame(dc.MESSAGE, m) for m in messages) + (dc.frame(dc.END) if end else b""))
        f, got = s.makefile("rb"), []
        while (fr := dc.read_frame(f, 1 << 26)) is not None:
            got.append(fr)
        return got


def test_an_unparsable_message_is_invalid_argument(workers):
    got = _raw_session(workers.paths["target"], messages=[b"\xff\xff\xff"])
    code, details = dc.parse_error(got[-1][1])
    assert got[-1][0] == dc.ERROR and code == grpc.StatusCode.INVALID_ARGUMENT and details


def test_cancel_and_disconnect_free_the_request_on_both_workers(workers, tokenizer):
    """A request cancelled mid-stream (the orchestrator's abort: the socket closed) and a
    client that just goes away (its socket closed by the OS) leave nothing on either worker."""
    prompt = tokenizer.encode("Write a long essay about rivers.")

    async def cancelled():
        target, draft = workers.clients()
        await target.info()
        await draft.info()
        req = GenerationRequest("dc-cancel", prompt, 400, mode="tree", tree_budget=8)
        agen = generate(req, tokenizer, target, draft)
        await agen.__anext__()
        await agen.__anext__()
        assert workers.te.live_requests == 1 and workers.de.live_requests == 1
        await agen.aclose()  # the round loop's cancellation path: both sessions aborted
    asyncio.run(cancelled())
    assert workers.wait_idle() == (0, 0)

    open_msg = wire.target_open(prompt, 64, SamplingParams(), Mode.AUTOREGRESSIVE, 0).SerializeToString()
    s = socket.socket(socket.AF_UNIX)
    s.connect(workers.paths["target"])
    s.sendall(dc.frame(dc.OPEN, b'{"metadata": [["x-worker-id", "gone"]]}') + dc.frame(dc.MESSAGE, open_msg))
    assert dc.read_frame(s.makefile("rb"), 1 << 26)[0] == dc.MESSAGE and workers.te.live_requests == 1
    s.close()  # no END: a cancel
    assert workers.wait_idle() == (0, 0)


def test_max_sessions_refused_with_resource_exhausted(workers):
    host = workers.hosts["target"]
    saved = host.max_sessions
    host.max_sessions = host.sessions
    try:
        got = _raw_session(workers.paths["target"])
    finally:
        host.max_sessions = saved
    code, details = dc.parse_error(got[-1][1])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in details and "--max-sessions" in details


def test_drain_refuses_new_sessions_and_ends_open_ones_after_the_grace(workers, tokenizer):
    host = workers.hosts["target"]
    open_msg = wire.target_open(tokenizer.encode("hi"), 8, SamplingParams(), Mode.AUTOREGRESSIVE, 0)

    async def run():
        target, _ = workers.clients()
        await target.info()
        call = target.open("drain-open")
        first = await target.exchange(call, open_msg, "prefill")
        host.draining = True
        refused = await _exchange_error(target, open_msg)
        host.grace_over = True
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await target.exchange(call, wire.target_verify([first.opened.first_token], [-1], None), "verify")
        await target.release("drain-open")
        return refused, ended.value
    try:
        refused, ended = asyncio.run(run())
    finally:
        host.draining = host.grace_over = False
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and DRAINING in refused.details()
    assert ended.code() == grpc.StatusCode.UNAVAILABLE and GRACE_OVER in ended.details()
    assert workers.wait_idle() == (0, 0)


def test_a_worker_that_requires_a_token_refuses_a_missing_or_wrong_one(workers, tmp_path, tokenizer):
    path = str(tmp_path / "t.sock")
    servicer, request_type = workers.refs["target"]["session"]
    ch = dc.DataChannel(workers.hosts["target"], servicer.Session, request_type, path, token="s3cret")
    ch.start()
    try:
        open_msg = wire.target_open(tokenizer.encode("hi"), 2, SamplingParams(), Mode.AUTOREGRESSIVE, 0)
        for md, why in (((), "missing bearer token"), ((("authorization", "Bearer nope"),), "wrong bearer token")):
            code, details = dc.parse_error(_raw_session(path, md, [open_msg.SerializeToString()])[-1][1])
            assert code == grpc.StatusCode.UNAUTHENTICATED and why in details
        got = _raw_session(path, (("authorization", "Bearer s3cret"),), [open_msg.SerializeToString()], end=True)
        assert [k for k, _ in got] == [dc.MESSAGE, dc.END]
        assert target_pb2.TargetReply.FromString(got[0][1]).HasField("opened")
    finally:
        ch.close()
    assert not os.path.exists(path) and workers.wait_idle() == (0, 0)


def test_the_session_deadline_frees_the_request_on_the_worker(workers, tokenizer):
    """A session opened with a 0.5 s deadline and then left alone: the worker ends it
    DEADLINE_EXCEEDED and frees the request by itself."""
    async def run():
        target, _ = workers.clients()
        await target.info()
        call = target.open("deadline", timeout=0.5)
        await target.exchange(call, wire.target_open(tokenizer.encode("hi"), 8, SamplingParams(),
                                                     Mode.AUTOREGRESSIVE, 0), "prefill")
        assert workers.te.live_requests == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        return e.value
    e = asyncio.run(run())
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert workers.wait_idle() == (0, 0)


def test_auto_falls_back_to_grpc_and_socket_requires_the_channel(workers, tokenizer):
    """``auto`` on a worker whose advertised path is not on this host uses gRPC (and works);
    ``socket`` refuses it at ``info()`` naming the flag."""
    servicer = workers.refs["target"]["session"][0]
    saved, servicer.data_socket = servicer.data_socket, "/nonexistent/elsewhere.sock"
    try:
        async def run():
            target, _ = workers.clients("auto")
            await target.info()
            assert target.data_socket == ""
            out = []
            req = GenerationRequest("auto", tokenizer.encode("hi"), 4, mode="autoregressive")
            async for ev in generate(req, tokenizer, target, None):
                out.append(ev)
            strict, _ = workers.clients("socket")
            with pytest.raises(DataChannelError, match="--data-channel socket.*not found on this host"):
                await strict.info()
            return out
        assert isinstance(asyncio.run(run())[-1], Finished)
    finally:
        servicer.data_socket = saved


def test_socket_call_reports_a_worker_that_is_gone(tmp_path):
    """Connecting to a path nobody serves: UNAVAILABLE naming the path (the round loop's
    fallback then treats it as a worker outage)."""
    async def run():
        call = SocketCall(str(tmp_path / "none.sock"), (), None, target_pb2.TargetReply)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.write(target_pb2.TargetMessage())
        return e.value
    e = asyncio.run(run())
    assert e.code() == grpc.StatusCode.UNAVAILABLE and "none.sock" in e.details()



@pytest.mark.slow  # (a process start: ~5 s)
def test_a_data_socket_that_cannot_be_bound_is_one_clean_error_line(tmp_path):
    """``--data-socket`` in a directory that does not exist: exit 1 with one error line naming
    the flag and the path (no traceback), before any model is loaded."""
    import subprocess
    import sys

    from deploy.local import ROOT

    path = str(tmp_path / "missing" / "d.sock")
    r = subprocess.run([sys.executable, "-m", "draft_service", "--port", "0", "--data-socket", path], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"--data-socket {path}" in r.stderr


# ---- a hung worker (three real processes)

def _live(address: str) -> int:
    from specdec_proto.v1 import common_pb2
    from specdec_proto.v2 import target_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetInfo(common_pb2.InfoRequest(), timeout=10).live_requests


@pytest.mark.slow
def test_a_hung_target_ends_exchanges_on_the_data_channel_unavailable(tmp_path):
    """``deploy.local``'s stack with the data channel (as the README starts it); the target
    SIGSTOPped with a request in flight: it ends UNAVAILABLE within about one liveness interval
    + timeout (1 s + 2 s), naming the target and the missed ping (break test: without the
    probe it waits for the client's 60 s deadline); after SIGCONT the target frees it."""
    import signal
    import threading

    from deploy.local import start_stack
    from specdec_client import SpecDecClient, SpecDecError

    stack = start_stack(log_dir=str(tmp_path / "logs"), data_channel=True)
    try:
        stack.wait_serving()
        log = (tmp_path / "logs" / "orchestrator.log").read_text()
        assert log.count('"channel": "socket"') >= 2, "the orchestrator did not pick the data channel"
        target = f"127.0.0.1:{stack.ports['target']}"
        outcome = {}

        def run():
            with SpecDecClient(stack.address, timeout=60) as c:
                try:
                    c.generate(prompt="Write a long story.", max_tokens=2000, ignore_eos=True, mode="tree",
                               tree_budget=8)
                except SpecDecError as e:
                    outcome["error"] = e
            outcome["ended"] = time.monotonic()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while _live(target) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.procs["target"].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            t.join(60)
        finally:
            stack.procs["target"].send_signal(signal.SIGCONT)
        e = outcome.get("error")
        assert e is not None and e.code == grpc.StatusCode.UNAVAILABLE, outcome
        assert "target service at" in e.details and "keepalive ping" in e.details, e.details
        assert outcome["ended"] - stopped < 6, f"failed {outcome['ended'] - stopped:.1f} s after the hang"
        deadline = time.monotonic() + 30
        while _live(target) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _live(target) == 0
    finally:
        stack.stop()
