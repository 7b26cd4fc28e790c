"""python -m specdec_client.probe: exit 0 for SERVING, 1 for NOT_SERVING or an unknown service,
2 when nothing answers — against real servers."""
from __future__ import annotations

import subprocess
import sys
import time

from deploy.local import ROOT, free_port
from specdec_client import probe


def run_probe(*args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "specdec_client.probe", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    return r.returncode, r.stdout.strip()


def test_serving_stack(stack):
    assert run_probe(stack.address, "specdec.v1.Orchestrator") == (0, "SERVING")
    assert probe.main([stack.address]) == 0  # "" = the server as a whole
    assert probe.main([f"127.0.0.1:{stack.ports['target']}", "specdec.v2.TargetService"]) == 0
    assert probe.check(stack.address, "no.such.Service") == "NOT_FOUND"
    assert probe.main([stack.address, "no.such.Service"]) == 1


def test_unreachable():
    assert run_probe(f"127.0.0.1:{free_port()}", "--timeout", "0.5") == (2, "UNREACHABLE")


def test_not_serving_while_workers_are_missing():
    """An orchestrator whose workers do not answer listens but is NOT_SERVING."""
    port = free_port()
    dead = f"127.0.0.1:{free_port()}"
    p = subprocess.Popen([sys.executable, "-m", "orchestrator", "--port", str(port), "--target", dead, "--draft", dead],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while (status := probe.check(f"127.0.0.1:{port}", "specdec.v1.Orchestrator")) == "UNREACHABLE":
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert status == "NOT_SERVING"
        assert run_probe(f"127.0.0.1:{port}", "specdec.v1.Orchestrator") == (1, "NOT_SERVING")
    finally:
        p.terminate()
        p.wait(30)
