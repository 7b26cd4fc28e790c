"""Health moves NOT_SERVING → SERVING during start-up; reflection lists the services."""
import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2

from deploy.local import ROOT, free_port, health_status


def test_target_health_transitions_and_reflection():
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--port", str(port)], cwd=ROOT, env=env,
                            stderr=subprocess.DEVNULL)
    seen = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            s = health_status(address)
            if s is not None and (not seen or seen[-1] != s):
                seen.append(s)
            if s == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.05)
        assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]

        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

        with grpc.insecure_channel(address) as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"specdec.v1.TargetService", "grpc.health.v1.Health"} <= services
    finally:
        proc.terminate()
        proc.wait(30)
