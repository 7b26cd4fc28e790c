"""Prometheus metrics of the three services (prometheus-client), names in one place.

Names follow vLLM's (``vllm:`` → ``specdec:``) where the concept is the same, so dashboards
carry over: ``specdec:spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens``,
``specdec:time_to_first_token_seconds``, ``specdec:inter_token_latency_seconds``,
``specdec:e2e_request_latency_seconds``, ``specdec:prompt_tokens`` / ``generation_tokens``,
``specdec:num_requests_running``, ``specdec:kv_cache_usage_perc``. Counters get prometheus'
``_total`` suffix in the exposition. Each service serves its registry on ``--metrics-port``,
holding only its role's families (a worker shows no orchestrator counters stuck at zero).

Terms (plans/0004): a round drafts a tree of ``tree_budget`` nodes below the root, accepts
some of them (accepted drafts) and commits accepted + 1 (the bonus) tokens. Generated tokens
= 1 (the prefill's first token) + Σ tokens emitted per round.
"""
from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0)
_REQUEST = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_NOT_YET = dict(registry=None)  # families are exposed by the role that fills them (``use_orchestrator``, ``watch_engine``)

# orchestrator: requests
REQUESTS = Counter("specdec:requests", "Finished requests by outcome (finish reason or gRPC status code)",
                   ["outcome"], **_NOT_YET)
RUNNING = Gauge("specdec:num_requests_running", "Requests in flight on this service", multiprocess_mode="livesum",
                **_NOT_YET)  # (multiprocess: the orchestrator's shards, serving.shards)
PROMPT_TOKENS = Counter("specdec:prompt_tokens", "Prompt tokens of started generations", **_NOT_YET)
GENERATION_TOKENS = Counter("specdec:generation_tokens", "Tokens generated (emitted to clients)", **_NOT_YET)
TTFT = Histogram("specdec:time_to_first_token_seconds", "Request arrival to the first streamed token",
                 buckets=_LATENCY, **_NOT_YET)
ITL = Histogram("specdec:inter_token_latency_seconds",
                "Time between consecutive streamed chunks (one chunk per round: accepted drafts + bonus)",
                buckets=_LATENCY, **_NOT_YET)
E2E = Histogram("specdec:e2e_request_latency_seconds", "Request arrival to its final message", buckets=_REQUEST,
                **_NOT_YET)
# orchestrator: speculative decoding
NUM_DRAFTS = Counter("specdec:spec_decode_num_drafts", "Rounds that verified a drafted tree", **_NOT_YET)
NUM_DRAFT_TOKENS = Counter("specdec:spec_decode_num_draft_tokens", "Drafted tree nodes (below the root) verified",
                           **_NOT_YET)
NUM_ACCEPTED_TOKENS = Counter("specdec:spec_decode_num_accepted_tokens",
                              "Accepted drafts (tree nodes on the accepted path)", **_NOT_YET)
ACCEPT_LENGTH = Histogram("specdec:spec_decode_accept_length", "Tokens committed per round (accepted drafts + 1)",
                          buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32), **_NOT_YET)
TAU = Gauge("specdec:spec_decode_mean_accept_length", "τ since start: tokens committed per verify forward, "
            "realised, or expected from the target's edge probabilities (Σ_v P(path to v) + 1)", ["kind"],
            multiprocess_mode="liveall", **_NOT_YET)
ROUND_SECONDS = Histogram("specdec:round_phase_seconds", "Worker calls as the orchestrator waits for them "
                          "(prefill, draft, verify): model work + wire + queueing", ["phase"], buckets=_LATENCY,
                          **_NOT_YET)
# workers
WORKER_SECONDS = Histogram("specdec:worker_op_seconds", "Per message on a worker (prefill, verify, draft): model "
                           "work, and for verify and draft the wait for the message's batch", ["op"],
                           buckets=_LATENCY, **_NOT_YET)
BATCH_SIZE = Histogram("specdec:worker_batch_size", "Messages (requests) per engine call of a worker's step batcher "
                       "(verify, draft)", ["op"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
                       **_NOT_YET)
BATCH_SECONDS = Histogram("specdec:worker_batch_seconds", "Engine call per batch of a worker's step batcher (verify, "
                          "draft): model work for all its messages", ["op"], buckets=_LATENCY, **_NOT_YET)
KV_USAGE = Gauge("specdec:kv_cache_usage_perc", "KV rows reserved by live requests / KV pool size (0..1)", **_NOT_YET)
KV_RESERVED = Gauge("specdec:kv_cache_reserved_tokens", "KV rows reserved by live requests", **_NOT_YET)

ORCHESTRATOR = (REQUESTS, RUNNING, PROMPT_TOKENS, GENERATION_TOKENS, TTFT, ITL, E2E, NUM_DRAFTS, NUM_DRAFT_TOKENS,
                NUM_ACCEPTED_TOKENS, ACCEPT_LENGTH, TAU, ROUND_SECONDS)
_exposed: set = set()


def expose(*families) -> None:
    """Add ``families`` to the default registry (served on /metrics), each once per process."""
    for fam in families:
        if id(fam) not in _exposed:
            REGISTRY.register(fam)
            _exposed.add(id(fam))


def serve_metrics(port: int, host: str = "0.0.0.0") -> int:
    """Serve /metrics over HTTP on ``port`` (0 = off); returns the port."""
    if port:
        start_http_server(port, addr=host)
    return port


def use_orchestrator() -> None:
    """Expose the orchestrator's families (requests, tokens, latencies, spec-decode counters)."""
    expose(*ORCHESTRATOR)


def watch_engine(ref: dict, kv: bool = False) -> None:
    """Expose a worker's families: time per message and per batch, batch sizes, and the live
    requests of the engine in ``ref["engine"]`` (once it is loaded) and, with ``kv`` (the
    target), its KV use, read at each scrape."""
    def read(fn):
        return lambda: fn(ref["engine"]) if "engine" in ref else 0.0

    RUNNING.set_function(read(lambda e: e.live_requests))
    expose(RUNNING, WORKER_SECONDS, BATCH_SIZE, BATCH_SECONDS)
    if kv:
        KV_USAGE.set_function(read(lambda e: e.reserved_tokens / e.kv_pool_tokens))
        KV_RESERVED.set_function(read(lambda e: e.reserved_tokens))
        expose(KV_USAGE, KV_RESERVED)


_deferred = threading.local()  # this thread's observations not yet made: [(observe, value), …]


def defer(observe, value) -> None:
    """``observe(value)`` (a histogram's ``observe``) at this thread's next ``flush``. The workers
    time a round's message (and its batch) as it runs but observe after its reply was sent, while
    they would wait for the next message anyway: off the round's critical path (three observations
    a verify, 2.9 µs on the VM, against 0.2 µs each to defer one). Same families, same values."""
    try:
        _deferred.items.append((observe, value))
    except AttributeError:
        _deferred.items = [(observe, value)]


def flush() -> None:
    """Make this thread's deferred observations (a worker's session: after each reply, and when it ends)."""
    items = getattr(_deferred, "items", None)
    if items:
        _deferred.items = []
        for observe, value in items:
            observe(value)
