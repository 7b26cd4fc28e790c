"""``python -m target_service --tp 2`` on a tiny Kimi-K2-structured checkpoint (CPU, gloo):
readiness turns SERVING after the warm-up, and readiness and liveness NOT_SERVING once a worker
rank dies."""
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from scripts.make_tiny_deepseek import save_tiny

SERVICE = "specdec.v2.TargetService"


def readiness(port: int, service: str = SERVICE) -> int:
    """Health status of ``service`` (the empty name is liveness)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def children(pid: int) -> list[int]:
    """Child process ids of pid that run multiprocessing workers (Linux /proc)."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"spawn_main" in (p / "cmdline").read_bytes():
                out.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def wait_for(cond, seconds: float):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def target_service(tmp_path, *flags):
    """``python -m target_service`` on a tiny Kimi-K2-structured FP8 checkpoint with ``flags``; yields
    (process, events: the JSON log lines so far, port: the listening port or None), stopped on exit."""
    save_tiny(tmp_path / "ckpt", "kimi_k2", "fp8")
    log = open(tmp_path / "target.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(tmp_path / "ckpt"), "--taps", "0,2",
                             "--port", "0", *flags], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def events():
        log.seek(0)
        return [json.loads(x) for x in log if x.startswith("{")]

    def port():
        return next((x["port"] for x in events() if x.get("event") == "listening"), None)

    try:
        assert wait_for(lambda: port() is not None, 120), "never listened"
        yield proc, events, port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tp2_service_health_follows_its_ranks(tmp_path):
    from grpc_health.v1 import health_pb2

    with target_service(tmp_path, "--tp", "2") as (proc, _, port):
        serving = health_pb2.HealthCheckResponse.SERVING
        assert wait_for(lambda: readiness(port()) == serving, 180), "never SERVING"
        workers = children(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert wait_for(lambda: readiness(port()) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert readiness(port(), "") == health_pb2.HealthCheckResponse.NOT_SERVING  # liveness too: restart me
        import grpc

        from specdec_proto.v2 import common_pb2 as v2, target_pb2, target_pb2_grpc

        opening = target_pb2.TargetMessage(open=target_pb2.TargetOpen(prompt_tokens=[1, 2, 3], max_new_tokens=4,
                                                                     mode=v2.MODE_AUTOREGRESSIVE))
        with grpc.insecure_channel(f"127.0.0.1:{port()}") as channel:
            call = target_pb2_grpc.TargetServiceStub(channel).Session(
                iter([opening]), metadata=(("x-worker-id", "w"),), timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                next(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()  # a request after: retry elsewhere


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a GPU")
def test_one_gpu_service_verifies_a_deepseek_target_from_cuda_graphs(tmp_path):
    """``python -m target_service`` on one GPU with a tiny Kimi-K2-structured checkpoint takes the
    fast path (it captures verify graphs), warms up through it and turns SERVING."""
    from grpc_health.v1 import health_pb2

    with target_service(tmp_path, "--device", "cuda") as (_, events, port):
        assert wait_for(lambda: readiness(port()) == health_pb2.HealthCheckResponse.SERVING, 300), "never SERVING"
        assert any(x.get("event") == "captured verify graphs" for x in events())
