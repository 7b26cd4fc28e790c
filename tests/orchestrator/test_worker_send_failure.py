"""A worker that dies while the orchestrator is sending to it must end the request UNAVAILABLE
naming the worker. gRPC's asyncio client reports a write that failed in its own core as INTERNAL
"Internal error from Core" (CI after session 25: tests/deploy/test_reliability.py's target killed
mid-generation came back INTERNAL once); ``_Sessions.exchange`` maps that to UNAVAILABLE.

The peer here is a real gRPC server process echoing a bidirectional stream (the transport is what
is under test, not a service's logic), SIGKILLed between two exchanges; the orchestrator's
``TargetWorker`` then exchanges on the same stream until it fails. The client's event loop is kept
from seeing the connection close until the peer is gone, so the next write fails in gRPC's core
(INTERNAL every time in 12 tries before the fix; with a read first, UNAVAILABLE).
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import grpc

from orchestrator.workers import TargetWorker

ECHO_SERVER = textwrap.dedent("""
    import time
    from concurrent import futures
    import grpc
    def echo(requests, context):
        yield from requests
    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    time.sleep(600)
""")


async def _exchange_until_the_dead_peer_fails_it() -> grpc.aio.AioRpcError:
    server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    worker = TargetWorker(f"127.0.0.1:{server.stdout.readline().strip()}", data_channel="grpc")
    try:
        call = worker.channel.stream_stream("/test.Echo/Chat")()
        assert await worker.exchange(call, b"x" * 1000, "verify") == b"x" * 1000
        server.kill()
        server.wait()  # (blocking: the client's event loop has not seen the connection close yet)
        for _ in range(1000):
            await worker.exchange(call, b"y" * 100_000, "verify")
        raise AssertionError("a dead peer answered 1000 exchanges")
    except grpc.aio.AioRpcError as e:
        try:  # the stream has ended with that status: an exchange on it now reports it again (the call's own status)
            await worker.exchange(call, b"z", "verify")
        except grpc.aio.AioRpcError as again:
            assert (again.code(), again.details()) == (e.code(), e.details())
        return e
    finally:
        server.kill()
        server.wait()
        await worker.channel.close()


def test_a_worker_killed_while_we_send_is_unavailable_naming_it():
    async def run():
        return [await _exchange_until_the_dead_peer_fails_it() for _ in range(3)]
    for e in asyncio.run(run()):
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        assert e.details().startswith("target service at 127.0.0.1:") and ", verify: " in e.details(), e.details()
