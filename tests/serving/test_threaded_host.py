"""ServiceHost on gRPC's threaded server (the workers): handler threads call the engine
themselves, one engine call at a time; a stream's release reaches the engine as soon as the
RPC ends, even while its handler is still inside an engine call; health, drain and unix-socket
addresses work as on the aio host. Real gRPC servers and clients on loopback; the service is a
generic echo-like stream (the host is under test, not a model)."""
import asyncio
import tempfile
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.server import ServiceHost

SERVICE = "specdec.v2.TargetService"  # a worker name: the host picks the threaded server
METHOD = "/test.Host/Session"


class Engine:
    """Records overlapping calls and releases; ``call`` blocks while ``gate`` is clear."""

    def __init__(self):
        self.running = 0
        self.overlaps = 0
        self.released: list[tuple[str, bool]] = []  # (id, whether a call was running at release time)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def call(self, rid):
        self.running += 1
        self.overlaps += self.running > 1
        self.entered.set()
        self.gate.wait(10)
        time.sleep(0.002)
        self.running -= 1
        return rid

    def release(self, rid):
        self.released.append((rid, self.running > 0))


def serve(engine: Engine, address: str = "127.0.0.1:0"):
    """A threaded host with one stream method: each message → one engine call → reply."""
    host = ServiceHost([SERVICE])

    def session(requests, context):
        rid = dict(context.invocation_metadata())["x-id"]
        release = host.on_end(context, lambda: engine.release(rid))
        try:
            for msg in requests:
                yield host.call_engine(engine.call, rid).encode() + msg
        finally:
            release()

    host.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Host", {"Session": grpc.stream_stream_rpc_method_handler(session)}),))
    loop = asyncio.new_event_loop()
    port = loop.run_until_complete(host.start(address))
    loop.run_until_complete(host.set_status(True))
    target = address if address.startswith("unix:") else f"127.0.0.1:{port}"
    return host, loop, target


def stop(host, loop):
    loop.run_until_complete(host.server.stop(grace=None))
    host.close()
    loop.close()


def test_workers_are_threaded_and_the_orchestrator_is_not():
    assert ServiceHost([SERVICE]).threads > 0
    assert ServiceHost(["specdec.v2.TargetService", "specdec.v2.DraftService"]).threads > 0

    async def aio_hosts():  # grpc.aio servers are built inside a running event loop, as in serving
        return ServiceHost(["specdec.v1.Orchestrator"]).threads, ServiceHost([]).threads

    assert asyncio.run(aio_hosts()) == (0, 0)


def test_engine_calls_are_serialised_across_streams():
    engine = Engine()
    host, loop, address = serve(engine)
    try:
        with grpc.insecure_channel(address) as channel:
            def one(i):
                replies = channel.stream_stream(METHOD)(iter([b"a"] * 20), metadata=(("x-id", f"r{i}"),))
                assert [r for r in replies] == [f"r{i}a".encode()] * 20
            threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert engine.overlaps == 0
        time.sleep(0.1)
        assert sorted(r for r, _ in engine.released) == ["r0", "r1", "r2", "r3"]  # each stream released once
    finally:
        stop(host, loop)


def test_cancel_releases_while_the_handler_is_inside_an_engine_call():
    engine = Engine()
    host, loop, address = serve(engine)
    try:
        with grpc.insecure_channel(address) as channel:
            engine.gate.clear()  # the next engine call blocks (a long prefill)
            replies = channel.stream_stream(METHOD)(iter([b"a"]), metadata=(("x-id", "long"),))
            assert engine.entered.wait(5)
            replies.cancel()
            deadline = time.monotonic() + 5
            while not engine.released and time.monotonic() < deadline:
                time.sleep(0.01)
            # released while the call still ran: the engine can stop it (a prefill at its next chunk)
            assert engine.released == [("long", True)]
            engine.gate.set()
            time.sleep(0.1)
            assert engine.released == [("long", True)]  # once, not again from the handler's finally
    finally:
        engine.gate.set()
        stop(host, loop)


def test_deadline_releases_a_stream_waiting_for_its_next_message():
    engine, stall = Engine(), threading.Event()
    host, loop, address = serve(engine)
    try:
        with grpc.insecure_channel(address) as channel:
            def messages():
                yield b"a"
                stall.wait(5)  # the client stalls (a frozen orchestrator)
            replies = channel.stream_stream(METHOD)(messages(), metadata=(("x-id", "slow"),), timeout=0.3)
            assert next(replies) == b"slowa"
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 2
            while not engine.released and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.released == [("slow", False)]
    finally:
        stall.set()
        stop(host, loop)


def test_health_drain_and_a_unix_socket():
    engine = Engine()
    path = tempfile.mkdtemp(prefix="host_test_")
    host, loop, address = serve(engine, f"unix://{path}/w.sock")
    try:
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service=SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
            assert list(channel.stream_stream(METHOD)(iter([b"x"]), metadata=(("x-id", "u"),))) == [b"ux"]
            loop.run_until_complete(host.drain(0.1, _Log()))
            assert check(health_pb2.HealthCheckRequest(service=SERVICE)).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            assert check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                list(channel.stream_stream(METHOD)(iter([b"x"]), metadata=(("x-id", "late"),)))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    finally:
        stop(host, loop)


class _Log:
    def info(self, *a, **k):
        pass

    warning = info
