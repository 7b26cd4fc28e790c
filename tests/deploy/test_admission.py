"""Admission on the target's Session (issue 14): while the KV pool is full an open waits for rows
— up to its RPC's deadline, or without one until the client cancels — instead of failing at
once; a request that can never fit is refused at once even while others wait; a cancelled or
timed-out waiter keeps nothing; however many opens wait, health checks and GetInfo still get
through (the host serves at most ``max_sessions`` streams, refusing more with RESOURCE_EXHAUSTED).
A real target servicer (threaded gRPC host on loopback) over a real engine with a 300-row pool."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import common_pb2 as v2, target_pb2, target_pb2_grpc

POOL = 300


def _open(max_new_tokens: int) -> target_pb2.TargetMessage:  # reserves 3 + max_new_tokens + 1 rows
    return target_pb2.TargetMessage(open=target_pb2.TargetOpen(prompt_tokens=[1, 2, 3], max_new_tokens=max_new_tokens,
                                                               mode=v2.MODE_AUTOREGRESSIVE))


class Stream:
    """A raw Session stream; ``opened()`` waits for the reply to its open (or its error)."""

    def __init__(self, stub, worker_id: str, max_new_tokens: int, timeout: float | None = None):
        self.q: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.q.get, None), metadata=(("x-worker-id", worker_id),), timeout=timeout)
        self.q.put(_open(max_new_tokens))
        self.reply: list = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            self.reply.append(next(self.call))
        except grpc.RpcError as e:
            self.reply.append(e)

    def opened(self, timeout: float = 30.0):
        self.thread.join(timeout)
        return self.reply[0] if self.reply else None

    def close(self):
        self.q.put(None)
        for _ in self.call:
            pass


@contextlib.contextmanager
def _served(target_model):
    """(stub, engine, channel, host) of a target service with a POOL-row KV pool, in this process."""
    import target_service.__main__ as target_main
    from serving.server import ServiceHost
    from target_service.engine import TargetEngine

    engine = TargetEngine(target_model, (1,), max_context=2048, kv_pool_tokens=POOL)
    loop = asyncio.new_event_loop()
    host = ServiceHost([target_main.ROLE.service])
    target_main.register(host, {"engine": engine})
    port = loop.run_until_complete(host.start("127.0.0.1:0"))
    loop.run_until_complete(host.set_status(True))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield target_pb2_grpc.TargetServiceStub(ch), engine, ch, host
    finally:
        loop.run_until_complete(host.server.stop(grace=None))
        host.close()
        loop.close()


@pytest.fixture
def target(target_model):
    """(stub, engine) of a target service with a POOL-row KV pool, in this process."""
    with _served(target_model) as (stub, engine, _, _):
        yield stub, engine


def _until(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_an_open_waits_for_rows_while_the_pool_is_full(target):
    stub, engine = target
    a = Stream(stub, "a", 200)  # 204 of 300 rows
    assert a.opened().opened.first_token >= 0 and engine.reserved_tokens == 204
    b = Stream(stub, "b", 200, timeout=60)  # does not fit now: waits
    time.sleep(0.3)
    assert b.reply == []

    never = Stream(stub, "never", 400)  # can never fit: refused at once, not queued behind b
    e = never.opened(5)
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "kv_pool_tokens" in e.details() and "300" in e.details()

    t0 = time.monotonic()
    c = Stream(stub, "c", 200, timeout=0.5)  # waits until its deadline, then ends
    e = c.opened(10)
    assert isinstance(e, grpc.RpcError) and e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                         grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert time.monotonic() - t0 < 5

    d = Stream(stub, "d", 200)  # no deadline (gRPC reports ~9.2e18 s left): waits until its client cancels
    time.sleep(0.3)
    assert d.reply == []  # still waiting, not failed
    d.call.cancel()
    e = d.opened(5)
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.CANCELLED

    a.close()  # a's rows come back: b (still waiting) opens
    assert b.opened(10).opened.first_token >= 0
    assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (1, 204))  # b only: c, d kept nothing
    b.close()
    assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (0, 0))


def test_a_wait_longer_than_threading_allows_is_a_wait(target_model):
    """The engine takes any wait_seconds, also one above threading.TIMEOUT_MAX (what a deadline-
    less RPC reports): the open waits and ends when its id is released, no OverflowError."""
    from protocol.types import UnknownRequest
    from modeling.sampling import SamplingParams
    from target_service.engine import TargetEngine

    engine = TargetEngine(target_model, (1,), max_context=2048, kv_pool_tokens=POOL)
    engine.prefill("a", [1, 2, 3], 200, SamplingParams())
    out = []
    t = threading.Thread(target=lambda: out.append(_raised(lambda: engine.prefill(
        "b", [1, 2, 3], 200, SamplingParams(), wait_seconds=9.223372035058688e18))))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and out == []  # waiting
    engine.release(["b"])
    t.join(5)
    assert isinstance(out[0], UnknownRequest) and "waiting for KV" in str(out[0])
    engine.release(["a"])
    assert (engine.live_requests, engine.reserved_tokens) == (0, 0)


def _raised(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_waiting_opens_leave_health_and_getinfo_answerable(target_model, monkeypatch):
    """A worker with 10 RPC slots and --max-sessions 6: one open holds the pool, 5 wait, the 4
    after them are refused at once with RESOURCE_EXHAUSTED naming max_sessions — and liveness,
    readiness and GetInfo still answer (without the limit, the waiting opens took every slot
    and health was refused: the worker looked dead)."""
    monkeypatch.setenv("SPECDEC_SESSION_THREADS", "10")
    monkeypatch.setenv("SPECDEC_MAX_SESSIONS", "6")
    with _served(target_model) as (stub, engine, ch, _):
        a = Stream(stub, "a", 200)
        assert a.opened().opened.first_token >= 0
        waiting = [Stream(stub, f"w{i}", 200, timeout=60) for i in range(5)]
        time.sleep(0.3)  # the 5 are in their handlers, waiting for rows
        refused = [Stream(stub, f"r{i}", 200, timeout=60) for i in range(4)]
        for r in refused:
            e = r.opened(5)
            assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_sessions 6" in e.details()
        assert all(w.reply == [] for w in waiting)  # still waiting for rows
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "specdec.v2.TargetService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert stub.GetInfo(common_pb2.InfoRequest(), timeout=5).live_requests == 1
        for w in waiting:
            w.call.cancel()
        a.close()
        assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (0, 0))


def test_a_gather_window_ends_when_a_request_leaves(target_model):
    """Verify window 1 s (--batch-wait-us 1000000): a and b verify together; then a's next verify
    waits for b, and b's stream ends 0.2 s later — its release wakes the window, which re-reads
    the live requests and runs a's verify then, not after the whole window."""
    from sessions import Session

    with _served(target_model) as (stub, engine, _, host):
        host.set_batching(64, 1.0)
        a, b = Session(stub, "a"), Session(stub, "b")
        bonus = {k: s.send(_open(20)).opened.first_token for k, s in (("a", a), ("b", b))}

        def verify(k, s, commit=()):
            return s.send(target_pb2.TargetMessage(verify=target_pb2.TargetVerify(
                tree=common_pb2.TokenTree(tokens=[bonus[k]], parents=[-1]), commit=list(commit)))).verified
        first = {}
        both = [threading.Thread(target=lambda k=k, s=s: first.setdefault(k, verify(k, s)))
                for k, s in (("a", a), ("b", b))]
        for t in both:
            t.start()
        for t in both:
            t.join(10)
        bonus["a"] = first["a"].samples[0]  # the next root: the sample after the committed bonus
        took = []

        def second():
            t0 = time.monotonic()
            verify("a", a, [0])
            took.append(time.monotonic() - t0)
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.2)
        assert took == []  # waiting for b's verify
        b.close()
        t.join(10)
        assert took and took[0] < 0.7  # ended by b's release, not by the 1 s window
        a.close()
        assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (0, 0))
