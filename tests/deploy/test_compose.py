"""deploy/compose: both variants pass a real compose parser (Debian's docker-compose, installed
by scripts/setup.sh), and the three services started as local processes with exactly the
commands, environments, health checks and start order that the resolved file declares
(``deploy.compose_local``; the session ``stack`` of every wire test) serve a generation
through the SDK."""
from __future__ import annotations

import pytest

from deploy.compose_local import BASE, GPU, resolve


def test_both_variants_validate():
    cpu, gpu = resolve(BASE), resolve(BASE, GPU)
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
    tuned = resolve(BASE, GPU, env={"SPECDEC_DTYPE": "float16", "SPECDEC_TP": "2"})
    assert tuned["services"]["target"]["environment"]["SPECDEC_DTYPE"] == "float16"
    assert tuned["services"]["target"]["environment"]["SPECDEC_TP"] == "2"
    assert int(tuned["services"]["target"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 2


def test_rejected_by_the_parser(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(open(BASE).read().replace("condition: service_healthy", "condition: service_up"))
    with pytest.raises(RuntimeError, match="service_up"):
        resolve(str(bad))


def test_session_stack_runs_what_compose_declares(stack, client):
    """The session stack (every wire test's) is the compose file's services run locally: the
    same commands, and its ports reached the services only through the compose environment."""
    for name, service in stack.services.items():
        assert stack.procs[name].args[1:] == service["command"][1:]
        assert stack.envs[name]["SPECDEC_METRICS_PORT"] == str(stack.metrics_ports[name])
    r = client.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, mode="tree")
    assert r.completion_tokens > 0 and r.finish_reason in ("length", "stop") and r.stats.rounds > 0
