"""A service's port is its own: a second service started on a port that one already listens on
must fail to start, not share it. gRPC turns SO_REUSEPORT on by default, and then the kernel
splits new connections between the two processes, so a stale or duplicate instance (or anyone
else running as the same user) silently receives part of the clients' requests. Break test
(session 4): a second gRPC server bound 127.0.0.1:<the orchestrator's port> without an error,
and requests of a running stack were answered "orchestrator is starting" by another process.
"""
from __future__ import annotations

import asyncio

import pytest

from serving.server import ServiceHost


@pytest.mark.parametrize("threads", [0, 2], ids=["aio (orchestrator)", "threaded (worker)"])
def test_a_second_service_cannot_bind_a_port_in_use(threads):
    async def main():
        first, second = ServiceHost(["specdec.v1.Orchestrator"], threads=threads), \
            ServiceHost(["specdec.v1.Orchestrator"], threads=threads)
        port = await first.start("127.0.0.1:0")
        try:
            with pytest.raises(RuntimeError):
                await second.start(f"127.0.0.1:{port}")
        finally:
            await first.server.stop(None)
            await second.server.stop(None)

    asyncio.run(main())
