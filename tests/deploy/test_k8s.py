"""deploy/k8s: every manifest passes kubernetes-validate's strict schema check, and the
Deployments probe what the services report: liveness = grpc.health.v1 "" (the server),
readiness = the service's full name, the same names the compose health checks ask."""
from __future__ import annotations

import glob
import os

import kubernetes_validate
import pytest
import yaml

from deploy.local import ROOT

K8S = os.path.join(ROOT, "deploy", "k8s")
VERSION = "1.32.0"
READY = {"target": "specdec.v2.TargetService", "draft": "specdec.v2.DraftService",
         "orchestrator": "specdec.v1.Orchestrator"}


def resources() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(path) as f:
            out += [d for d in yaml.safe_load_all(f) if d]
    return out


def test_strict_schema():
    docs = resources()
    assert {d["kind"] for d in docs} == {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service"}
    for d in docs:
        kubernetes_validate.validate(d, VERSION, strict=True)  # raises ValidationError
    bad = next(d for d in resources() if d["kind"] == "Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_probes_ports_and_gpus():
    docs = resources()
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert ("ConfigMap", "specdec-flags") in by and ("PersistentVolumeClaim", "specdec-models") in by
    compose = yaml.safe_load(open(os.path.join(ROOT, "deploy", "compose", "docker-compose.yml")))
    flags = by["ConfigMap", "specdec-flags"]["data"]
    for name, service in READY.items():
        (c,) = by["Deployment", f"specdec-{name}"]["spec"]["template"]["spec"]["containers"]
        port = c["ports"][0]["containerPort"]
        assert c["readinessProbe"]["grpc"] == c["startupProbe"]["grpc"] == {"port": port, "service": service}
        assert c["livenessProbe"]["grpc"] == {"port": port}
        assert c["envFrom"] == [{"configMapRef": {"name": "specdec-flags"}}]
        assert compose["services"][name]["healthcheck"]["test"][-1] == service
        svc = by["Service", f"specdec-{name}"]["spec"]
        assert svc["ports"][0]["port"] == port and svc["ports"][0]["targetPort"] == "grpc"
        assert {"name": "metrics", "containerPort": int(flags["SPECDEC_METRICS_PORT"])} in c["ports"]
        pod = by["Deployment", f"specdec-{name}"]["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == flags["SPECDEC_METRICS_PORT"]
        assert float(flags["SPECDEC_DRAIN_SECONDS"]) < pod["spec"]["terminationGracePeriodSeconds"]
        gpus = c["resources"].get("requests", {}).get("nvidia.com/gpu")
        assert (gpus == c["resources"]["limits"]["nvidia.com/gpu"] == 1) if name != "orchestrator" else gpus is None
