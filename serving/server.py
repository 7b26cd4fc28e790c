"""gRPC server construction: message limits, health (grpc.health.v1), reflection, the engine
thread. (Engine errors → status codes: ``protocol.wire``.)"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb * 2 ** 20
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


class ServiceHost:
    """An aio server with health + reflection, and one engine thread for blocking model work.

    ``health`` starts NOT_SERVING for "" and every service name; call ``set_serving()`` once
    the weights are loaded and a warm-up round ran.
    """

    def __init__(self, service_names: list[str], max_message_mb: int = 64):
        self.server = grpc.aio.server(options=channel_options(max_message_mb))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def set_status(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [""] + self.service_names:
            await self.health.set(name, status)

    async def start(self, address: str) -> int:
        """Bind (port 0 = any free port), start NOT_SERVING; returns the bound port."""
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"could not bind {address}")
        await self.set_status(False)
        await self.server.start()
        return port

    async def run_engine(self, fn, *args):
        """Run blocking engine work on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def env_default(name: str, default):
    """Value of environment variable SPECDEC_<NAME> (typed like ``default``), else ``default``."""
    import os

    raw = os.environ.get(f"SPECDEC_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(raw) if default is not None else raw


def pick_device(name: str, dtype: str = "auto"):
    """'auto' → cuda if available else cpu. Returns (torch.device, compute dtype); dtype
    'auto' = float32 on CPU, bfloat16 on GPU, else 'bfloat16' | 'float16' | 'float32'.
    Raises ValueError for another dtype name."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if dtype == "auto":
        return device, (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    return device, getattr(torch, dtype)


async def serve_forever(host: ServiceHost, log, load_and_warm, warm_async=None) -> None:
    """Run ``load_and_warm()`` (blocking) on the engine thread and ``await warm_async()`` if
    given, then report SERVING and wait until SIGINT/SIGTERM stops the server gracefully."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await host.run_engine(load_and_warm)
    if warm_async is not None:
        await warm_async()
    await host.set_status(True)
    log.info("serving")
    await stop.wait()
    log.info("stopping")
    await host.set_status(False)
    await host.server.stop(grace=2)
    host.executor.shutdown(wait=False, cancel_futures=True)
