"""deploy/compose: both variants pass a real compose parser (Debian's docker-compose, installed
by scripts/setup.sh), and the three services started as local processes with exactly the
commands, environments, health checks and start order that the resolved file declares serve a
generation through the SDK.

The one translation from containers to local processes: a service name used as a host
(``target:50061``) becomes 127.0.0.1, and ``python`` is this interpreter. Ports come from the
file's own ``${SPECDEC_*_PORT}`` variables, set to free ports here."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from deploy.local import ROOT, free_port
from specdec_client import SpecDecClient, SpecDecError

COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
BASE = os.path.join(COMPOSE_DIR, "docker-compose.yml")
GPU = os.path.join(COMPOSE_DIR, "docker-compose.gpu.yml")


def resolved(*files: str, env: dict | None = None) -> dict:
    """The compose configuration as ``docker-compose config`` resolves it (interpolated, merged,
    validated against the compose schema). Fails the test when the parser rejects a file."""
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose not installed: run scripts/setup.sh"
    args = [exe, "--project-directory", COMPOSE_DIR] + [a for f in files for a in ("-f", f)] + ["config"]
    r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_both_variants_validate():
    cpu, gpu = resolved(BASE), resolved(BASE, GPU)
    assert set(cpu["services"]) == set(gpu["services"]) == {"target", "draft", "orchestrator"}
    for name in ("target", "draft"):
        assert "deploy" not in cpu["services"][name]
        (dev,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert gpu["services"][name]["environment"]["SPECDEC_DEVICE"] == "cuda"
    for svc in cpu["services"].values():
        assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "specdec_client.probe"]
        assert svc["restart"] == "unless-stopped" and svc["stop_grace_period"]
        assert any(v.endswith(":/models:ro") for v in svc["volumes"])
    deps = cpu["services"]["orchestrator"]["depends_on"]
    assert deps == {"target": {"condition": "service_healthy"}, "draft": {"condition": "service_healthy"}}
    # flags follow the environment: a variable set in the shell reaches the service
    tuned = resolved(BASE, GPU, env={"SPECDEC_DTYPE": "float16", "SPECDEC_TARGET_GPUS": "2"})
    assert tuned["services"]["target"]["environment"]["SPECDEC_DTYPE"] == "float16"
    assert int(tuned["services"]["target"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 2


def _local(argv: list[str]) -> list[str]:
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def _start_order(services: dict) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        order += [n for n, s in services.items() if n not in order and set(s.get("depends_on", {})) <= set(order)]
    return order


def test_compose_stack_generates(tmp_path):
    ports = {"SPECDEC_TARGET_PORT": free_port(), "SPECDEC_DRAFT_PORT": free_port(),
             "SPECDEC_ORCHESTRATOR_PORT": free_port()}
    # SPECDEC_MAX_TOKENS_LIMIT: shows that a variable set for the compose file reaches the service
    services = resolved(BASE, env={**{k: str(v) for k, v in ports.items()}, "SPECDEC_MAX_TOKENS_LIMIT": "16"})["services"]
    names = "|".join(map(re.escape, services))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    base_env["PYTHONPATH"] = ROOT + os.pathsep + base_env.get("PYTHONPATH", "")  # the image installs the package
    base_env["PYTHONUNBUFFERED"] = "1"
    procs: dict[str, subprocess.Popen] = {}

    def healthy(name: str) -> bool:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(_local(test[1:]), env=envs[name], cwd=ROOT, capture_output=True).returncode == 0

    envs = {n: {**base_env, **{k: re.sub(rf"^({names}):(\d+)$", r"127.0.0.1:\2", str(v))
                              for k, v in s["environment"].items()}} for n, s in services.items()}
    try:
        for name in _start_order(services):
            for dep in services[name].get("depends_on", {}):  # condition: service_healthy
                deadline = time.monotonic() + 600
                while not healthy(dep):
                    assert procs[dep].poll() is None, f"{dep} exited; log: {tmp_path / dep}.log"
                    assert time.monotonic() < deadline, f"{dep} not healthy"
                    time.sleep(0.5)
            log = open(tmp_path / f"{name}.log", "w")
            procs[name] = subprocess.Popen(_local(services[name]["command"]), cwd=ROOT, env=envs[name],
                                           stdout=log, stderr=log)
        deadline = time.monotonic() + 600
        while not healthy("orchestrator"):
            assert procs["orchestrator"].poll() is None, f"orchestrator exited; log: {tmp_path}/orchestrator.log"
            assert time.monotonic() < deadline
            time.sleep(0.5)
        with SpecDecClient(f"127.0.0.1:{ports['SPECDEC_ORCHESTRATOR_PORT']}", timeout=120) as c:
            r = c.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, mode="tree")
            assert r.completion_tokens > 0 and r.finish_reason in ("length", "stop") and r.stats.rounds > 0
            with pytest.raises(SpecDecError) as e:  # the limit set through the compose environment
                c.generate(prompt="hi", max_tokens=17)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
