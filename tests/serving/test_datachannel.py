"""The data channel (``serving.datachannel``): the workers' Session streams over Unix sockets.

Real threaded gRPC hosts with the real servicers over the real engines (``engines``), each also
serving its data channel; the orchestrator's real clients (``orchestrator.workers``) and round
loop (``orchestrator.generation``). Output through the data channel is plain greedy and equal,
token for token, to the gRPC path's (seeded sampling too); errors, cancellation, the host's
limits, the drain and the token behave as over gRPC. Framing: a property test."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time

import grpc
import pytest
import structlog
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


def test_a_polling_reader_polls_then_blocks_and_reads_the_same_frames():
    """With busy-polling on (``SPECDEC_SPIN_US``) a session's reader polls its socket with
    non-blocking reads for the set time, then blocks as before; frames come out the same."""
    import threading

    class Counting:  # the socket, counting non-blocking reads (polls) and blocking ones
        def __init__(self, sock):
            self.sock, self.polls, self.blocking = sock, 0, 0

        def recv_into(self, b, n=0, flags=0):
            polled = bool(flags & socket.MSG_DONTWAIT)
            self.polls += polled
            self.blocking += not polled
            return self.sock.recv_into(b, n, flags)

        def _decref_socketios(self):
            pass
    a, b = socket.socketpair(socket.AF_UNIX)
    sock = Counting(b)
    conn = dc._Conn(sock, 1 << 20, polling=True)
    # polls for 50 ms (each failed poll yields the core: on a busy host a yield can last a time slice, so
    # the count is only "more than one"), then blocks until the frames come at 0.5 s
    conn.raw.spin = lambda: 0.05
    frames = [(dc.MESSAGE, os.urandom(100_000)), (dc.MESSAGE, b"small"), (dc.END, b"")]
    timer = threading.Timer(0.5, lambda: a.sendall(b"".join(dc.frame(k, p) for k, p in frames)))
    timer.start()
    try:
        assert [conn.recv() for _ in frames] == frames
        assert sock.polls > 1 and sock.blocking >= 1
    finally:
        timer.join()
        a.close()
        b.close()


@pytest.mark.parametrize("name,value", [("SPECDEC_SPIN_US", "abc"), ("SPECDEC_SPIN_US", "1e3"),
                                        ("SPECDEC_SPIN_US", "-5"), ("SPECDEC_SPIN_US", str(dc.MAX_SPIN_US + 1)),
                                        ("SPECDEC_SPIN_US", "1_000"), ("SPECDEC_SPIN_US", "+5"), ("SPECDEC_SPIN_US", "9" * 5000),
                                        ("SPECDEC_SPIN_MAX_LIVE", "x"), ("SPECDEC_SPIN_MAX_LIVE", "٣")])
def test_a_malformed_busy_polling_setting_stops_every_service_at_start(name, value, monkeypatch, capsys):
    """Breaker (session 7): a bad value crashed the workers with a traceback and an unbounded one
    burned a core per stalled session; now each service's flag parsing exits 2 naming the variable."""
    from draft_service.__main__ import parse_args as draft_args
    from orchestrator.__main__ import parse_args as orchestrator_args
    from target_service.__main__ import parse_args as target_args

    monkeypatch.setenv(name, value)
    for parse in (target_args, draft_args, orchestrator_args):
        with pytest.raises(SystemExit) as e:
            parse([])
        assert e.value.code == 2 and f"{name} must be an integer in [0, " in capsys.readouterr().err
    monkeypatch.setenv(name, "7")
    assert dc.spin_settings() == ((7e-6, 2) if name == "SPECDEC_SPIN_US" else (0.0, 7))


def test_busy_polling_is_on_by_default_only_where_cores_are_idle(monkeypatch):
    """``SPECDEC_SPIN_US`` unset (or ``auto``): polling on a host with >= 8 usable CPUs (a GPU host),
    off below (CI, a 2-core VM); an explicit value, 0 included, always wins; the live limit holds."""
    assert [dc.auto_spin_us(n) for n in (1, 2, 4, 7, 8, 16, 128)] == [0, 0, 0, 0, 1000, 1000, 1000]
    monkeypatch.delenv("SPECDEC_SPIN_MAX_LIVE", raising=False)
    for cpus, unset in ((2, 0.0), (16, 1e-3)):
        monkeypatch.setattr(dc, "usable_cpus", lambda cpus=cpus: cpus)
        monkeypatch.delenv("SPECDEC_SPIN_US", raising=False)
        assert dc.spin_settings() == (unset, 2)
        for value, want in (("", unset), (" auto", unset), ("AUTO", unset), ("0", 0.0), ("250", 250e-6)):
            monkeypatch.setenv("SPECDEC_SPIN_US", value)
            assert dc.spin_settings() == (want, 2), (cpus, value)
    monkeypatch.setenv("SPECDEC_SPIN_US", "autox")
    with pytest.raises(ValueError, match="SPECDEC_SPIN_US must be an integer in .* or auto"):
        dc.spin_settings()


def test_usable_cpus_is_the_affinity_capped_by_a_cgroup_quota(monkeypatch, tmp_path):
    import builtins

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    files = {}
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if str(path).startswith("/sys/fs/cgroup/") or (path == "/proc/self/cgroup" and path in files):
            if path not in files:
                raise FileNotFoundError(path)
            (tmp_path / "f").write_text(files[path])
            return real_open(tmp_path / "f", *a, **k)
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", fake_open)
    assert dc.usable_cpus() == 16  # no cgroup files
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    assert dc.usable_cpus() == 16
    files["/sys/fs/cgroup/cpu.max"] = "250000 100000\n"  # a 2.5-CPU container limit
    assert dc.usable_cpus() == 2
    del files["/sys/fs/cgroup/cpu.max"]
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"], files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "400000\n", "100000\n"
    assert dc.usable_cpus() == 4  # cgroup v1
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "-1\n"
    assert dc.usable_cpus() == 16
    # a nested v2 cgroup without its own namespace (systemd CPUQuota=, docker --cgroupns=host):
    # the quota sits on the process's own cgroup or one above it, not on the root (breaker, session 8)
    files["/proc/self/cgroup"] = "0::/system.slice/job.scope\n"
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    files["/sys/fs/cgroup/system.slice/job.scope/cpu.max"] = "200000 100000\n"
    assert dc.usable_cpus() == 2
    del files["/sys/fs/cgroup/system.slice/job.scope/cpu.max"]
    files["/sys/fs/cgroup/system.slice/cpu.max"] = "300000 100000\n"
    assert dc.usable_cpus() == 3


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

    def clients(self, channel: str = "socket", steps: bool = False) -> tuple[TargetWorker, DraftWorker]:
        return (TargetWorker(self.addresses["target"], data_channel=channel, steps=steps),
                DraftWorker(self.addresses["draft"], data_channel=channel, steps=steps))

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
    return await collect(req, tok, target, draft)


async def collect(req: GenerationRequest, tok, target, draft):
    """(tokens, Finished) of ``req`` run by the round loop over the clients (no drafter for autoregressive)."""
    out, fin = [], None
    async for ev in generate(req, tok, target, draft if req.mode.value != "autoregressive" else None):
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


def test_busy_polling_changes_nothing_but_the_waits(workers, tokenizer, monkeypatch):
    """With ``SPECDEC_SPIN_US`` (opt-in busy-polling: the workers' session threads poll their
    sockets, the orchestrator's event loop its selector, before sleeping) a seeded tree@4
    request through the data channel gives the same tokens and rounds as without, and the
    loop's selector was wrapped."""
    prompt = tokenizer.encode("Tell me a story about a lighthouse.")
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=99)
    spins = [c.spin_s for c in workers.channels.values()]
    monkeypatch.setenv("SPECDEC_SPIN_US", "0")  # the reference polls nowhere (unset: on where >= 8 CPUs)
    for c in workers.channels.values():
        c.spin_s = 0.0
    try:
        want = asyncio.run(_generate(workers, tokenizer, "socket", prompt, "tree", 4, 8, sampling))
    finally:
        for c, v in zip(workers.channels.values(), spins):
            c.spin_s = v

    async def polled():
        out = await _generate(workers, tokenizer, "socket", prompt, "tree", 4, 8, sampling)
        return out, asyncio.get_running_loop()._selector.select.__name__
    monkeypatch.setenv("SPECDEC_SPIN_US", "300")
    polled_for = {name: [] for name in workers.channels}  # what each worker's session threads were told to poll
    for name, c in workers.channels.items():
        c.spin_s = dc.spin_settings()[0]
        c._spin = (lambda c, seen: lambda: seen.append(type(c)._spin(c)) or seen[-1])(c, polled_for[name])
    try:
        got, select_name = asyncio.run(polled())
    finally:
        for c, v in zip(workers.channels.values(), spins):
            c.spin_s = v
            del c._spin
    assert select_name == "polling_select" and got[0] == want[0] and got[1].stats.histogram == want[1].stats.histogram
    assert all(seen and max(seen) == 300e-6 for seen in polled_for.values()), polled_for
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


def _raw_session(path: str, metadata=(), messages: list[bytes] = (), end=False, timeout=30,
                 open_payload: bytes | None = None, more: bytes = b"") -> list[tuple[int, bytes]]:
    """Frames the worker sends back to OPEN (``open_payload``, else ``metadata`` and ``timeout``)
    + ``messages`` (+ END) + ``more``, after its HELLO, until it closes (socket.timeout after
    10 s: a worker that never answers fails the test instead of hanging it)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        head = open_payload or json.dumps({"metadata": list(metadata), "timeout": timeout}).encode()
        s.sendall(dc.frame(dc.OPEN, head) + b"".join(dc.frame(dc.MESSAGE, m) for m in messages)
                  + (dc.frame(dc.END) if end else b"") + more)
        f, got = s.makefile("rb"), []
        while (fr := dc.read_frame(f, 1 << 26)) is not None:
            got.append(fr)
        assert got[0][0] == dc.HELLO, got[:1]
        return got[1:]


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
    f = s.makefile("rb")
    assert dc.read_frame(f, 1 << 26)[0] == dc.HELLO
    assert dc.read_frame(f, 1 << 26)[0] == dc.MESSAGE and workers.te.live_requests == 1
    f.close()
    s.close()  # no END: a cancel
    assert workers.wait_idle() == (0, 0)


def test_max_sessions_refused_with_resource_exhausted(workers):
    host = workers.hosts["target"]
    deadline = time.monotonic() + 5
    while host.sessions and time.monotonic() < deadline:  # (an earlier test's session may still be ending)
        time.sleep(0.01)
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



# ---- hardening (the session-6 breaker's findings)

def _error(got) -> tuple[grpc.StatusCode, str]:
    assert got and got[-1][0] == dc.ERROR, got
    return dc.parse_error(got[-1][1])


@pytest.mark.parametrize("timeout", ["NaN", "Infinity", "1" + "0" * 400, '"soon"'])
def test_an_open_frame_with_a_bad_timeout_is_invalid_argument_naming_it(workers, timeout):
    """NaN (the monitor busy-looped), infinity, a number too large for a float (the session
    thread died) and a string: INVALID_ARGUMENT naming the field."""
    code, details = _error(_raw_session(workers.paths["target"],
                                        open_payload=b'{"metadata": [], "timeout": %s}' % timeout.encode()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in details


def test_an_open_frame_nested_too_deeply_is_invalid_argument(workers):
    code, details = _error(_raw_session(workers.paths["target"], open_payload=b"[" * 100_000 + b"]" * 100_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "nested" in details


@pytest.mark.parametrize("timeout", [0, -1])
def test_an_expired_deadline_is_answered_without_running_the_work(workers, tokenizer, timeout):
    open_msg = wire.target_open(tokenizer.encode("hi"), 4, SamplingParams(), Mode.AUTOREGRESSIVE, 0)
    got = _raw_session(workers.paths["target"], messages=[open_msg.SerializeToString()], timeout=timeout)
    assert len(got) == 1 and _error(got)[0] == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("extra", [dc.frame(dc.OPEN, b"{}"), dc.frame(9, b"zz"), dc.frame(dc.ERROR, b"{}")],
                         ids=["second_open", "unknown_kind", "client_error"])
def test_a_protocol_violation_in_a_session_is_invalid_argument(workers, tokenizer, extra):
    open_msg = wire.target_open(tokenizer.encode("hi"), 4, SamplingParams(), Mode.AUTOREGRESSIVE, 0)
    got = _raw_session(workers.paths["target"], messages=[open_msg.SerializeToString()], more=extra)
    code, details = _error(got)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unexpected frame kind" in details
    assert workers.wait_idle() == (0, 0)


def test_connections_without_open_are_timed_out_and_limited(workers, monkeypatch):
    """Connections that send nothing: beyond ``MAX_OPENING`` refused at once (no thread);
    those admitted end INVALID_ARGUMENT after ``OPEN_TIMEOUT``."""
    monkeypatch.setattr(dc, "OPEN_TIMEOUT", 0.5)
    monkeypatch.setattr(dc, "MAX_OPENING", 2)
    silent = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    try:
        for s in silent:
            s.settimeout(10)
            s.connect(workers.paths["target"])
            time.sleep(0.05)  # (accepted in order)
        frames = [[], [], []]
        for got, s in zip(frames, silent):
            f = s.makefile("rb")
            while (fr := dc.read_frame(f, 1 << 20)) is not None:
                got.append(fr)
            f.close()
    finally:
        for s in silent:
            s.close()
    assert [k for k, _ in frames[2]] == [dc.HELLO, dc.ERROR]
    assert dc.parse_error(frames[2][1][1])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    for got in frames[:2]:
        code, details = dc.parse_error(got[-1][1])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no OPEN frame within 0.5 s" in details
    assert workers.channels["target"].opening == 0


def test_a_client_that_stops_reading_does_not_stop_the_deadlines(workers, tokenizer):
    """A client that sends a tree-mode open (its reply: the prompt's features, 64 rows x 6.9 KB,
    more than the socket holds) and never reads: past its deadline the worker frees the
    request anyway, and another session's deadline still ends it on time (the monitor waited
    on the stuck send before)."""
    import fcntl
    import termios

    prompt = (tokenizer.encode(" ".join(["river"] * 100)) * 2)[:64]
    open_msg = wire.target_open(prompt, 8, SamplingParams(), Mode.TREE, 4).SerializeToString()
    slow = socket.socket(socket.AF_UNIX)
    try:
        slow.connect(workers.paths["target"])
        slow.sendall(dc.frame(dc.OPEN, b'{"metadata": [], "timeout": 1.5}') + dc.frame(dc.MESSAGE, open_msg))
        deadline = time.monotonic() + 1.5
        queued = lambda: struct.unpack("i", fcntl.ioctl(slow, termios.FIONREAD, b"\0" * 4))[0]  # noqa: E731
        while queued() <= len(dc.frame(dc.HELLO, b"0" * 32)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() < deadline, "the prefill outlasted the deadline: nothing tested"
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.3)  # the reply's send is blocked; the deadline passed
        start = time.monotonic()
        code, _ = _error(_raw_session(workers.paths["target"], timeout=0.3))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 2
        assert workers.wait_idle(3) == (0, 0), "the slow session still holds its request"
    finally:
        slow.close()


@contextlib.contextmanager
def _target_channel(workers, path: str, token: str = ""):
    """A second data channel of the target at ``path`` (``token``), advertised in its GetInfo
    while open."""
    servicer, request_type = workers.refs["target"]["session"]
    ch = dc.DataChannel(workers.hosts["target"], servicer.Session, request_type, path, token=token)
    ch.start()
    saved = servicer.data_socket, servicer.data_nonce
    servicer.data_socket, servicer.data_nonce = path, ch.nonce
    try:
        yield ch
    finally:
        servicer.data_socket, servicer.data_nonce = saved
        ch.close()


async def _tokens(target: TargetWorker, tok, n=4) -> list[int]:
    out = []
    req = GenerationRequest("again", tok.encode("hi"), n, mode="autoregressive")
    async for ev in generate(req, tok, target, None):
        out += [] if isinstance(ev, Finished) else ev.token_ids
    return out


def test_a_worker_left_on_grpc_by_a_passing_refusal_gets_its_socket_back(workers):
    """Under "auto", a worker whose socket refused for a passing reason (e.g. its limit of
    connections waiting for OPEN, breaker 2) is left on gRPC; ``follow_workers`` chooses its
    channel again every ``rechoose_s`` and goes back to the socket (it stayed on gRPC until a
    restart before)."""
    from orchestrator.workers import follow_workers

    async def run():
        target, draft = workers.clients("auto")
        await target.info()
        path, nonce = target.data_socket, target.data_nonce
        target.choose_channel(path, nonce, "refused: connections waiting for OPEN (test)")
        assert target.data_socket == "" and target.left_on_grpc()
        follow = asyncio.ensure_future(follow_workers(ServiceHost(["specdec.v1.Orchestrator"]), target, draft,
                                                      structlog.get_logger(), period=0.05, rechoose_s=0.2))
        try:
            deadline = time.monotonic() + 5
            while target.data_socket != path and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            follow.cancel()
        assert target.data_socket == path and not target.left_on_grpc()
    asyncio.run(run())


def test_a_worker_restarted_without_its_socket_is_reached_over_grpc_then_its_new_socket(workers, tokenizer):
    """The target's data channel goes away (restarted without --data-socket: GetInfo advertises
    none): the orchestrator's next request re-reads GetInfo and goes over gRPC (it failed
    "cannot connect" forever before); the target back with a data channel (a new nonce) and
    readiness NOT_SERVING -> SERVING: ``follow_workers`` picks the new socket."""
    from orchestrator.workers import follow_workers

    servicer = workers.refs["target"]["session"][0]
    host, path = workers.hosts["target"], workers.paths["target"]

    async def run():
        target, draft = workers.clients("auto")
        await target.info()
        want = await _tokens(target, tokenizer)
        old_nonce = target.data_nonce
        assert target.data_socket == path and old_nonce
        workers.channels["target"].close()
        servicer.data_socket = servicer.data_nonce = ""
        assert await asyncio.wait_for(_tokens(target, tokenizer), 30) == want and target.data_socket == ""
        from types import SimpleNamespace

        workers.channels["target"] = dc.serve_data_channel(SimpleNamespace(data_socket=path), host,
                                                           workers.refs["target"])
        follow = asyncio.ensure_future(follow_workers(ServiceHost(["specdec.v1.Orchestrator"]), target, draft,
                                                      structlog.get_logger(), period=0.05))
        try:
            await asyncio.sleep(0.2)
            await host.set_status(False)
            await asyncio.sleep(0.2)
            await host.set_status(True)
            deadline = time.monotonic() + 5
            while target.data_socket != path and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            follow.cancel()
        assert target.data_socket == path and target.data_nonce not in ("", old_nonce)
        assert await _tokens(target, tokenizer) == want
    try:
        asyncio.run(run())
    finally:
        if workers.channels["target"].closed:
            from types import SimpleNamespace

            workers.channels["target"] = dc.serve_data_channel(SimpleNamespace(data_socket=path), host,
                                                               workers.refs["target"])
        asyncio.run(host.set_status(True))
    assert workers.wait_idle() == (0, 0)


def test_a_draft_refused_on_a_gone_socket_is_sent_over_grpc(workers, tokenizer):
    """The drafter's data socket went away (restarted without --data-socket: GetInfo advertises
    none): a request's first draft, refused on the socket before the drafter ran anything, is
    re-sent over gRPC (the target's counterpart is the restart test below): the request drafts
    every round (no fallback) and its output equals the socket run's."""
    servicer = workers.refs["draft"]["session"][0]
    host, path = workers.hosts["draft"], workers.paths["draft"]
    prompt = tokenizer.encode("def fibonacci(n):")

    async def run(draft):
        target = TargetWorker(workers.addresses["target"], data_channel="auto")
        await target.info()
        req = GenerationRequest("chunks", prompt, 8, mode="tree", tree_budget=4)
        out, fin = [], None
        async for ev in generate(req, tokenizer, target, draft):
            out, fin = (out, ev) if isinstance(ev, Finished) else (out + ev.token_ids, fin)
        return out, fin

    async def both():
        draft = DraftWorker(workers.addresses["draft"], data_channel="auto")
        await draft.info()
        assert draft.data_socket == path
        want = await run(draft)
        workers.channels["draft"].close()
        servicer.data_socket = servicer.data_nonce = ""
        return want, await run(draft), draft.data_socket
    try:
        (want, fin0), (got, fin), now = asyncio.run(both())
    finally:
        from types import SimpleNamespace

        workers.channels["draft"] = dc.serve_data_channel(SimpleNamespace(data_socket=path), host, workers.refs["draft"])
    assert now == "" and got == want and len(got) == 8
    assert fin.stats.fallback_rounds == fin0.stats.fallback_rounds == 0 and fin.stats.rounds == fin0.stats.rounds
    assert workers.wait_idle() == (0, 0)


def test_a_socket_that_is_not_the_workers_gets_neither_prompt_nor_token(workers, tokenizer, tmp_path, monkeypatch):
    """Another process serves the path the target advertised (a decoy that bound it after the
    target's socket went, or the path of another host's worker): its HELLO's nonce is not the
    target's, so it receives not one byte (before: the OPEN with the bearer token, then the
    prompt, and its replies became the output); the request goes over gRPC."""
    import threading

    monkeypatch.setenv("SPECDEC_DATA_TOKEN", "s3cret")
    path = str(tmp_path / "t.sock")
    received, conns = [], []

    def decoy(listener):
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            conns.append(c)
            c.sendall(dc.frame(dc.HELLO, b"not-the-target"))
            c.settimeout(1)
            try:
                while data := c.recv(65536):
                    received.append(data)
            except OSError:
                pass

    async def run(ch):
        target, _ = workers.clients("auto")
        await target.info()
        assert target.data_socket == path
        ch.close()  # the target's socket goes; another process binds the path
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen()
        threading.Thread(target=decoy, args=(listener,), daemon=True).start()
        try:
            out = await asyncio.wait_for(_tokens(target, tokenizer), 30)
        finally:
            listener.close()
        return out, target.data_socket
    try:
        with _target_channel(workers, path, "s3cret") as ch:
            out, chosen = asyncio.run(run(ch))
    finally:
        for c in conns:
            c.close()
    assert len(out) == 4 and chosen == "" and conns and received == []


def test_a_worker_that_refuses_our_token_is_used_over_grpc_under_auto(workers, tokenizer, tmp_path, monkeypatch):
    """The orchestrator without the workers' SPECDEC_DATA_TOKEN: ``auto`` goes over gRPC (the
    request works; the log's why names the setting); ``socket`` refuses to start naming it
    (before: the socket was chosen and every session failed UNAUTHENTICATED)."""
    monkeypatch.delenv("SPECDEC_DATA_TOKEN", raising=False)

    async def run():
        target, _ = workers.clients("auto")
        await target.info()
        assert target.data_socket == ""
        out = await _tokens(target, tokenizer)
        strict, _ = workers.clients("socket")
        with pytest.raises(DataChannelError, match="SPECDEC_DATA_TOKEN"):
            await strict.info()
        return out
    with _target_channel(workers, str(tmp_path / "t.sock"), "s3cret"):
        assert len(asyncio.run(run())) == 4
    assert workers.wait_idle() == (0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_socket_file_of_another_user_is_not_used(workers, tmp_path):
    """The advertised socket file belongs to another uid (a process of another user bound the
    path): not used, the why names the uid."""
    path = str(tmp_path / "t.sock")

    async def run(nonce):
        target, _ = workers.clients("auto")
        return await target.probe(path, nonce)
    with _target_channel(workers, path) as ch:
        os.chown(path, 65534, -1)
        assert "belongs to uid 65534" in asyncio.run(run(ch.nonce))


def test_an_orchestrator_without_the_workers_token_cannot_start_with_socket_only(workers, tmp_path, monkeypatch):
    """``python -m orchestrator --data-channel socket`` without the workers' SPECDEC_DATA_TOKEN:
    its start-up (``prepare``) ends with one StartupError naming the setting (exit 1, one log
    line; before: a traceback from the warm-up round's UNAUTHENTICATED)."""
    import orchestrator.__main__ as orchestrator_main
    from serving.launch import StartupError

    monkeypatch.delenv("SPECDEC_DATA_TOKEN", raising=False)
    args = orchestrator_main.parse_args(["--target", workers.addresses["target"], "--draft", workers.addresses["draft"],
                                         "--data-channel", "socket", "--worker-timeout", "5"])

    async def start():  # (the host's gRPC server needs the running loop)
        await orchestrator_main.prepare(args, ServiceHost(["specdec.v1.Orchestrator"]), {}, structlog.get_logger())
    with _target_channel(workers, str(tmp_path / "t.sock"), "s3cret"):
        with pytest.raises(StartupError, match="--data-channel socket: the target service .*SPECDEC_DATA_TOKEN"):
            asyncio.run(start())


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
