"""deploy/compose: both variants pass a real compose parser (Debian's docker-compose, installed
by scripts/setup.sh), and the three services started as local processes with exactly the
commands, environments, health checks and start order that the resolved file declares
(``deploy.compose_local``) serve a generation through the SDK."""
from __future__ import annotations

import grpc
import pytest

from deploy.compose_local import BASE, GPU, compose_stack, resolve
from specdec_client import SpecDecClient, SpecDecError


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
    tuned = resolve(BASE, GPU, env={"SPECDEC_DTYPE": "float16", "SPECDEC_TARGET_GPUS": "2"})
    assert tuned["services"]["target"]["environment"]["SPECDEC_DTYPE"] == "float16"
    assert int(tuned["services"]["target"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 2


def test_rejected_by_the_parser(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(open(BASE).read().replace("condition: service_healthy", "condition: service_up"))
    with pytest.raises(RuntimeError, match="service_up"):
        resolve(str(bad))


def test_compose_stack_generates(tmp_path):
    # SPECDEC_MAX_TOKENS_LIMIT: shows that a variable set for the compose file reaches the service
    stack = compose_stack(str(tmp_path), env={"SPECDEC_MAX_TOKENS_LIMIT": "16"})
    try:
        stack.up()
        with SpecDecClient(stack.address, timeout=120) as c:
            r = c.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, mode="tree")
            assert r.completion_tokens > 0 and r.finish_reason in ("length", "stop") and r.stats.rounds > 0
            with pytest.raises(SpecDecError) as e:  # the limit set through the compose environment
                c.generate(prompt="hi", max_tokens=17)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details
    finally:
        stack.stop()
