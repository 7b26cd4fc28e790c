"""Admission on the target's Session (issue 14): while the KV pool is full an open waits for rows
— up to its RPC's deadline, or without one until the client cancels — instead of failing at
once; a request that can never fit is refused at once even while others wait; a cancelled or
timed-out waiter keeps nothing. A real target servicer (threaded gRPC host on loopback) over a
real engine with a 300-row pool."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

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


@pytest.fixture
def target(target_model):
    """(stub, engine) of a target service with a POOL-row KV pool, in this process."""
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
            yield target_pb2_grpc.TargetServiceStub(ch), engine
    finally:
        loop.run_until_complete(host.server.stop(grace=None))
        host.close()
        loop.close()


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

    d = Stream(stub, "d", 200)  # no deadline: waits until its client cancels
    time.sleep(0.2)
    d.call.cancel()
    assert isinstance(d.opened(5), grpc.RpcError)

    a.close()  # a's rows come back: b (still waiting) opens
    assert b.opened(10).opened.first_token >= 0
    assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (1, 204))  # b only: c, d kept nothing
    b.close()
    assert _until(lambda: (engine.live_requests, engine.reserved_tokens) == (0, 0))
