"""/metrics (prometheus-client) on every service of the session stack: after generations the
orchestrator's spec-decode counters agree with what the clients received and with each other,
and the workers report their model work and KV use."""
from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PROMPT = [{"role": "user", "content": "Write one sentence about rivers."}]


def scrape(port: int) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} of one /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict, after: dict):
    def d(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)
    return d


def test_spec_decode_counters_are_consistent(stack, client):
    ports = stack.metrics_ports
    before = {n: scrape(p) for n, p in ports.items()}
    results = [client.generate(messages=PROMPT, max_tokens=12, mode=mode, tree_budget=8)
               for mode in ("tree", "chain", "autoregressive")]
    deadline = time.monotonic() + 30  # the workers release each request just after its last message
    while (after := {n: scrape(p) for n, p in ports.items()})["target"][("specdec:num_requests_running", ())]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    d = delta(before["orchestrator"], after["orchestrator"])
    n = len(results)
    rounds = sum(r.stats.rounds for r in results)
    spec_rounds = sum(r.stats.rounds for r in results[:2])
    accepted = sum((k - 1) * c for r in results for k, c in enumerate(r.stats.accept_length_histogram) if k)

    assert sum(d("specdec:requests_total", outcome=o) for o in ("length", "stop")) == n
    assert d("specdec:prompt_tokens_total") == sum(r.prompt_tokens for r in results)
    assert d("specdec:generation_tokens_total") == sum(r.completion_tokens for r in results)
    # generated = the prefill's first token + Σ tokens committed per round, per request
    assert d("specdec:generation_tokens_total") == n + d("specdec:spec_decode_accept_length_sum")
    assert d("specdec:spec_decode_accept_length_count") == rounds
    assert d("specdec:spec_decode_num_drafts_total") == spec_rounds
    assert d("specdec:spec_decode_num_accepted_tokens_total") == accepted
    assert 0 < accepted <= d("specdec:spec_decode_num_draft_tokens_total") <= 8 * spec_rounds
    assert d("specdec:time_to_first_token_seconds_count") == d("specdec:e2e_request_latency_seconds_count") == n
    assert d("specdec:inter_token_latency_seconds_count") > 0
    assert d("specdec:round_phase_seconds_count", phase="verify") == rounds
    assert d("specdec:round_phase_seconds_count", phase="draft") == spec_rounds
    tau = after["orchestrator"][("specdec:spec_decode_mean_accept_length", (("kind", "realised"),))]
    assert tau >= 1.0 and after["orchestrator"][("specdec:num_requests_running", ())] == 0

    t = delta(before["target"], after["target"])
    assert t("specdec:worker_op_seconds_count", op="verify") == rounds
    assert t("specdec:worker_op_seconds_count", op="prefill") == n
    assert after["target"][("specdec:kv_cache_usage_perc", ())] == 0  # every request released its KV
    assert after["target"][("specdec:num_requests_running", ())] == 0
    assert delta(before["draft"], after["draft"])("specdec:worker_op_seconds_count", op="draft") == spec_rounds
    # each service exposes its own role's families only (newcomer: workers showed orchestrator counters as zeros)
    names = {n: {name for name, _ in page} for n, page in after.items()}
    assert not {x for x in names["target"] | names["draft"] if "spec_decode" in x or "requests_total" in x}
    assert not {x for x in names["orchestrator"] if "worker_op" in x or "kv_cache" in x}
