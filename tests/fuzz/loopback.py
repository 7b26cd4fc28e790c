"""The three services in this process on loopback ports: real servicers (``ServiceHost``, health,
the drain interceptor), real gRPC, the real engines of the ``engines`` fixture, and the real
orchestrator with its gRPC worker clients (``orchestrator.workers``). One event loop on a
background thread serves all three; tests call them with blocking stubs from the test thread.

Cheaper than the three-process stack (no second copy of the weights, no start-up of 3
interpreters) and closer than the in-process transport (every message crosses protobuf and
the servicers)."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import grpc

from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import draft_pb2_grpc, target_pb2_grpc


@dataclass
class Loopback:
    target: str          # addresses
    draft: str
    orchestrator: str
    target_engine: object
    draft_engine: object
    loop: asyncio.AbstractEventLoop

    def live(self) -> tuple[int, int, int]:
        """(target live requests, target reserved KV rows, drafter live contexts), over GetInfo."""
        with grpc.insecure_channel(self.target) as t, grpc.insecure_channel(self.draft) as d:
            ti = target_pb2_grpc.TargetServiceStub(t).GetInfo(common_pb2.InfoRequest(), timeout=10)
            di = draft_pb2_grpc.DraftServiceStub(d).GetInfo(common_pb2.InfoRequest(), timeout=10)
        return ti.live_requests, ti.kv_reserved_tokens, di.live_requests

    def wait_at_most(self, n: int, timeout: float = 30.0) -> tuple[int, int]:
        """Poll the engines until each holds at most ``n`` requests (``n`` = what concurrent
        healthy requests may hold) or ``timeout`` s passed; returns (target, drafter) counts."""
        import time

        deadline = time.monotonic() + timeout
        while max(now := (self.target_engine.live_requests, self.draft_engine.live_requests)) > n:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return now

    def held(self) -> dict:
        """Worker ids the engines hold now (for a leak's message)."""
        return dict(target=list(self.target_engine._requests), draft=list(self.draft_engine._ctx),
                    in_flight={n: h.in_flight for n, h in HOSTS.items()})

    def wait_idle(self, timeout: float = 30.0) -> tuple[int, int, int]:
        """Poll ``live()`` until nothing is held or ``timeout`` s passed; returns the last reading
        (a stream's end reaches the client a moment before the worker's release ran)."""
        import time

        deadline = time.monotonic() + timeout
        while (now := self.live()) != (0, 0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        return now


HOSTS: dict = {}


async def _serve(te, de):
    """Target and draft hosts over the engines, then the orchestrator exactly as its
    ``python -m orchestrator`` start-up prepares it (``orchestrator.__main__``: connect, check,
    load the tokenizer, warm-up round)."""
    import structlog

    import draft_service.__main__ as draft_main
    import orchestrator.__main__ as orchestrator_main
    import target_service.__main__ as target_main
    from serving.server import ServiceHost

    hosts = {"target": ServiceHost([target_main.ROLE.service]), "draft": ServiceHost([draft_main.ROLE.service]),
             "orchestrator": ServiceHost([orchestrator_main.ROLE.service])}
    target_main.register(hosts["target"], {"engine": te})
    draft_main.register(hosts["draft"], {"engine": de})
    state: dict = {}
    orchestrator_main.register(hosts["orchestrator"], state)
    ports = {n: await h.start("127.0.0.1:0") for n, h in hosts.items()}
    await hosts["target"].set_status(True)
    await hosts["draft"].set_status(True)
    args = orchestrator_main.parse_args(["--target", f"127.0.0.1:{ports['target']}",
                                         "--draft", f"127.0.0.1:{ports['draft']}", "--port", str(ports["orchestrator"])])
    load_and_warm, warm_async = await orchestrator_main.prepare(args, hosts["orchestrator"], state,
                                                                structlog.get_logger())
    await asyncio.to_thread(load_and_warm)
    if warm_async is not None:
        await warm_async()
    await hosts["orchestrator"].set_status(True)
    HOSTS.update(hosts)
    return hosts, ports


def start(te, de) -> tuple[Loopback, callable]:
    """Serve ``te``/``de`` (TargetEngine, DraftEngine) and an orchestrator over them; returns the
    ``Loopback`` and a stop function."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="loopback-servers")
    thread.start()
    hosts, ports = asyncio.run_coroutine_threadsafe(
        _serve(te, de), loop).result(120)
    lb = Loopback(*(f"127.0.0.1:{ports[n]}" for n in ("target", "draft", "orchestrator")), te, de, loop)

    def stop():
        async def down():
            for h in hosts.values():
                await h.server.stop(grace=None)
        asyncio.run_coroutine_threadsafe(down(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        for h in hosts.values():
            h.executor.shutdown(wait=False, cancel_futures=True)

    return lb, stop
