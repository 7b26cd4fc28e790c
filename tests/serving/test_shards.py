"""A sharded orchestrator (``python -m orchestrator --processes N``, ``serving.shards``): N real
orchestrator processes on one port in front of the session stack's real workers. Client
connections spread over the shards, every answer is the single orchestrator's (greedy, lossless),
/metrics sums the shards, SIGTERM drains them all, a shard that dies takes the others down, and
a taken port starts nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.request import urlopen

import grpc
import pytest

from specdec_client.client import build_request
from specdec_client.probe import check
from specdec_proto.v1 import orchestrator_pb2_grpc

ORCH = "specdec.v1.Orchestrator"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three facts about whales:", "Once upon a time"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _channel(address: str) -> grpc.Channel:
    """A channel with its own TCP connection (gRPC shares one between equal channels of a process
    otherwise): each lands on a shard of the kernel's choosing."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _generate(address: str, prompt: str, mode: str) -> list[int]:
    with _channel(address) as ch:
        out = []
        for r in orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
                build_request(prompt, max_tokens=10, mode=mode, tree_budget=8, ignore_eos=True), timeout=300):
            if r.WhichOneof("event") == "delta":
                out += r.delta.token_ids
        return out


def _start(stack, tmp_path, processes: int, port: int, metrics: int):
    log = open(tmp_path / "orchestrator.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "--processes", str(processes), "--port", str(port),
                             "--metrics-port", str(metrics), "--target", f"127.0.0.1:{stack.ports['target']}",
                             "--draft", f"127.0.0.1:{stack.ports['draft']}", "--drain-seconds", "5"],
                            stdout=log, stderr=log)
    return proc, tmp_path / "orchestrator.log"


def _lines(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_all_serving(proc, address: str, log, timeout: float = 300.0) -> list[int]:
    """Until every shard has logged that it serves (and fresh connections find it SERVING);
    returns the shards' pids."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        lines = _lines(log)
        started = [x for x in lines if x.get("event") == "shards started"]
        serving = {x.get("shard") for x in lines if x.get("event") == "serving"}
        if started and len(serving) == len(started[0]["pids"]) and all(check(address, ORCH) == "SERVING"
                                                                      for _ in range(6)):
            return started[0]["pids"]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_shards_share_the_port_answer_as_one_and_drain(stack, tmp_path):
    port, metrics = _free_port(), _free_port()
    address = f"127.0.0.1:{port}"
    proc, log = _start(stack, tmp_path, 2, port, metrics)
    try:
        pids = _wait_all_serving(proc, address, log)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        want = {p: _generate(stack.address, p, "autoregressive") for p in PROMPTS}  # the single orchestrator
        got, errors = {}, []

        def one(k: int) -> None:
            try:
                got[k] = _generate(address, PROMPTS[k % len(PROMPTS)], "tree")
            except Exception as e:  # noqa: BLE001 — reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        assert all(got[k] == want[PROMPTS[k % len(PROMPTS)]] for k in range(16)), (got, want)
        served = {x["shard"] for x in _lines(log) if x.get("event") == "finished"}
        assert served == {"0/2", "1/2"}  # 16 connections all on one shard: p = 2^-15
        connected = [x for x in _lines(log) if x.get("event") == "connected"]
        assert sorted(x["shard"] for x in connected) == ["0/2", "1/2"]
        # CPU workers: the CPU table's host_ms is the workers' per-request forward, a shared cost — not
        # divided among the shards (budget.shared_by is for the GPU tables)
        assert all(x["planned_as_share_of"] == 1 for x in connected)
        text = urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert 'specdec:requests_total{outcome="length"} 16.0' in text, text
        assert "specdec:num_requests_running 0.0" in text
        assert "kv_cache" not in text  # only the orchestrator's families (the shards' files hold every import's)
        assert sum(line.startswith("specdec:spec_decode_mean_accept_length{") and 'kind="realised"' in line
                   for line in text.splitlines()) == 2  # one τ series per shard (pid label)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_shard_stops_the_orchestrator(stack, tmp_path):
    port = _free_port()
    proc, log = _start(stack, tmp_path, 2, port, 0)
    try:
        pids = _wait_all_serving(proc, f"127.0.0.1:{port}", log)
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(60) == 1
        assert not _alive(pids[1])
        assert any(x.get("event") == "a shard exited; stopping the others" for x in _lines(log))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_taken_port_starts_no_shard(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "orchestrator", "--processes", "2", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"--host 127.0.0.1 --port {port}" in r.stderr and "shards started" not in r.stderr


def test_a_second_supervisor_cannot_join_a_sharded_port(tmp_path):
    """The supervisor holds its port from the check on (a bound SO_REUSEPORT socket): a second
    supervisor on that port exits 1 while the first one's shards listen (break test: both started
    and the kernel split the clients between two orchestrators)."""
    first = subprocess.Popen([sys.executable, "-m", "orchestrator", "--processes", "2", "--port", "0",
                              "--target", "127.0.0.1:1", "--worker-timeout", "60"],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "first.log", "wb"))
    try:
        deadline = time.monotonic() + 60
        while not (started := [x for x in _lines(tmp_path / "first.log") if x.get("event") == "shards started"]):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        port = started[0]["port"]
        r = subprocess.run([sys.executable, "-m", "orchestrator", "--processes", "2", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and f"--port {port}" in r.stderr and "shards started" not in r.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)


def test_a_taken_metrics_port_starts_no_shard():
    with socket.create_server(("0.0.0.0", 0)) as taken:
        metrics = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "orchestrator", "--processes", "2", "--port", "0",
                            "--metrics-port", str(metrics)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"--metrics-port {metrics}" in r.stderr and "shards started" not in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0"], "--processes must be >= 1 (got 0)"),
    (["--processes", "2", "--host", "unix:///tmp/x.sock"], "--processes > 1 needs a TCP --host"),
])
def test_bad_process_counts_are_a_usage_error(argv, message, capsys):
    from orchestrator.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
