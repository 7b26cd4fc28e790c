"""Run the services of ``deploy/compose/docker-compose.yml`` as local processes, exactly as the
file declares them: the configuration resolved by a real compose parser (Debian's
``docker-compose config``: interpolated, merged, schema-checked), each service's command and
environment, its health check as the readiness test, and ``depends_on: service_healthy`` as
the start order. Used by the tests, so CI checks what a compose deployment would run.

Two translations from containers to local processes, and only these: a value ``<service>:<port>``
(a host on the compose network) becomes ``127.0.0.1:<port>``, and ``python`` is this
interpreter. Ports come from the file's own ``${SPECDEC_*_PORT}`` variables (set them to free
ports in ``env``)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import yaml

from deploy.local import ROOT, Stack

COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
BASE = os.path.join(COMPOSE_DIR, "docker-compose.yml")
GPU = os.path.join(COMPOSE_DIR, "docker-compose.gpu.yml")


def resolve(*files: str, env: dict | None = None) -> dict:
    """The compose configuration as ``docker-compose config`` resolves it with ``env`` added to
    this process's environment. Raises RuntimeError when the parser is missing or rejects it."""
    exe = shutil.which("docker-compose")
    if not exe:
        raise RuntimeError("docker-compose not installed: run scripts/setup.sh")
    args = [exe, "--project-directory", COMPOSE_DIR] + [a for f in files or (BASE,) for a in ("-f", f)] + ["config"]
    r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode:
        raise RuntimeError(f"docker-compose config failed: {r.stderr}")
    return yaml.safe_load(r.stdout)


def local_argv(argv: list[str]) -> list[str]:
    return [sys.executable, *argv[1:]] if argv[0] == "python" else list(argv)


def start_order(services: dict) -> list[str]:
    """Service names, each after everything it depends on."""
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order and set(s.get("depends_on", {})) <= set(order)]
        if not ready:
            raise ValueError("depends_on has a cycle")
        order += ready
    return order


class ComposeStack(Stack):
    """A ``deploy.local.Stack`` started from a resolved compose configuration."""

    def __init__(self, services: dict, ports: dict[str, int], log_dir: str | None = None):
        super().__init__(ports, log_dir=log_dir)
        self.services = services
        names = "|".join(map(re.escape, services))
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
        base["PYTHONPATH"] = ROOT + os.pathsep + base.get("PYTHONPATH", "")  # the image installs the package
        base["PYTHONUNBUFFERED"] = "1"  # the image's ENV
        self.envs = {n: {**base, **{k: re.sub(rf"^({names}):(\d+)$", r"127.0.0.1:\2", str(v))
                                    for k, v in s.get("environment", {}).items()}} for n, s in services.items()}

    @property
    def ready_names(self) -> dict[str, str]:
        """Service → the grpc.health.v1 service name its health check asks (readiness)."""
        return {n: s["healthcheck"]["test"][-1] for n, s in self.services.items()}

    @property
    def metrics_ports(self) -> dict[str, int]:
        return {n: int(e["SPECDEC_METRICS_PORT"]) for n, e in self.envs.items()}

    def healthy(self, name: str) -> bool:
        """Run the service's health check command once; True when it exits 0."""
        test = self.services[name]["healthcheck"]["test"]
        if test[0] != "CMD":
            raise ValueError(f"{name}: health check {test[0]} is not supported here")
        return subprocess.run(local_argv(test[1:]), env=self.envs[name], cwd=ROOT, capture_output=True).returncode == 0

    def wait_healthy(self, name: str, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(name):
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}; logs in {self.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after {timeout}s")
            time.sleep(0.5)

    def start(self, name: str) -> None:
        out = open(os.path.join(self.log_dir, f"{name}.log"), "a") if self.log_dir else None
        self.procs[name] = subprocess.Popen(local_argv(self.services[name]["command"]), cwd=ROOT,
                                            env=self.envs[name], stdout=out, stderr=out)

    def up(self, timeout: float = 900.0) -> "ComposeStack":
        """Start every service once the services it depends on are healthy, then wait until
        all are healthy."""
        for name in start_order(self.services):
            for dep in self.services[name].get("depends_on", {}):
                self.wait_healthy(dep, timeout)
            self.start(name)
        for name in self.services:
            self.wait_healthy(name, timeout)
        return self


def compose_stack(log_dir: str | None = None, env: dict | None = None, files: tuple[str, ...] = (BASE,)) -> ComposeStack:
    """Resolve the compose file with every ``SPECDEC_<SERVICE>_PORT`` and
    ``SPECDEC_<SERVICE>_METRICS_PORT`` set to a free port (plus ``env``) and return the stack,
    not started (call ``up()``)."""
    from deploy.local import free_port

    names = ("target", "draft", "orchestrator")
    ports = {f"SPECDEC_{n.upper()}{kind}_PORT": str(free_port()) for n in names for kind in ("", "_METRICS")}
    services = resolve(*files, env={**ports, **(env or {})})["services"]
    ports = {n: int(s["environment"][f"SPECDEC_{n.upper()}_PORT"]) for n, s in services.items()}
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    return ComposeStack(services, ports, log_dir)
