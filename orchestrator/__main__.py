"""python -m orchestrator — the public Generate API in front of the draft and target services."""
from __future__ import annotations

import dataclasses
import functools

from serving.datachannel import busy_poll_fields
from serving.launch import Role, check_spin_settings, env_flags, launch, parser
from serving.server import add_operation_flags


def parse_args(argv=None):
    p = parser("orchestrator", __doc__, port=50051)
    p.add_argument("--target", default="127.0.0.1:50061",
                   help="the target service's host:port (or unix:///path); the orchestrator waits for it "
                        "to be SERVING")
    p.add_argument("--draft", default="127.0.0.1:50062",
                   help="the draft service's host:port (or unix:///path); optional at start-up: until it is "
                        "ready, requests go on with one-token rounds")
    p.add_argument("--target-model", default="",
                   help="GGUF file or HF dir for the tokenizer; empty = embedded default")
    p.add_argument("--max-tokens", type=int, default=4096, help="per-request limit")
    p.add_argument("--default-budget", type=int, default=32,
                   help="tree budget of a request that asks for 0 (the cap, for an adaptive request)")
    p.add_argument("--tree-budget-policy", default="fixed", choices=["fixed", "adaptive"],
                   help="tree requests that name no budget_policy: 'fixed' drafts tree_budget nodes every round; "
                        "'adaptive' picks per round a one-token round or a tree of <= tree_budget nodes from the "
                        "live requests' acceptance and the cost model (orchestrator.budget)")
    p.add_argument("--cost-model", default="",
                   help="JSON cost table for the adaptive budget (python -m bench.cost_table writes one); empty = "
                        "the measured H200 table when the target runs on CUDA, the CPU table otherwise")
    p.add_argument("--replan", default="deferred", choices=["deferred", "inline"],
                   help="when the adaptive budget's planner re-plans: 'deferred' once a round's verify is sent (off "
                        "the round's critical path); 'inline' inside the next round's shape lookup (before its draft)")
    p.add_argument("--host-drift", default="common", choices=["common", "raw"],
                   help="how the adaptive budget's planner compares round times measured at different times: "
                        "'common' brings them to one host speed first (a slowdown of the whole host changes no "
                        "comparison; plans/0009 session 10); 'raw' compares them as measured (session 9)")
    p.add_argument("--adaptive-learn", default="on", choices=["on", "off"],
                   help="whether the adaptive budget's planner corrects its cost model by the round times it "
                        "measures ('on': trials of untried shapes and re-measurements included; plans/0009) or "
                        "plans from the cost model alone ('off': no trials — the diagnostic of plans/0009 "
                        "session 14)")
    p.add_argument("--worker-timeout", type=float, default=600.0,
                   help="seconds to wait for the target service to become SERVING (then exit 1)")
    p.add_argument("--max-message-mb", type=int, default=64,
                   help="largest gRPC message in MiB")
    p.add_argument("--draft-timeout-ms", type=float, default=2000.0,
                   help="a draft call slower than this falls back to a one-token round and counts as a draft "
                        "service failure (0 = no limit)")
    p.add_argument("--draft-replay-tokens", type=int, default=256,
                   help="context-feature rows each request keeps to seed a new draft session after a draft "
                        "service failure (memory: rows x taps x hidden x dtype bytes per request)")
    p.add_argument("--worker-ping-ms", type=int, default=1000,
                   help="keepalive ping on the worker links after this long without traffic")
    p.add_argument("--worker-ping-timeout-ms", type=int, default=2000,
                   help="a worker that does not answer a ping within this is hung: its link closes, in-flight "
                        "requests end UNAVAILABLE (target) or go on with one-token rounds (drafter); a worker "
                        "busy with a long forward still answers pings")
    p.add_argument("--worker-tls-ca", default="",
                   help="PEM CA that signed the workers' certificates: TLS on both worker links (empty = plain text)")
    p.add_argument("--worker-tls-cert", default="",
                   help="PEM client certificate for mutual TLS on the worker links (with --worker-tls-key)")
    p.add_argument("--worker-tls-key", default="", help="PEM private key of --worker-tls-cert")
    p.add_argument("--data-channel", default="auto", choices=["auto", "grpc", "socket"],
                   help="per-round messages to a worker: 'auto' through its data channel (a Unix socket it "
                        "advertises with --data-socket) when that answers from this host as that worker (same "
                        "user, its instance nonce) and accepts SPECDEC_DATA_TOKEN (set it to the workers' value "
                        "when they require one), else gRPC; 'grpc' always gRPC; 'socket' requires the data "
                        "channel of both workers (exit 1 at start otherwise); chosen again when a worker "
                        "restarts")
    p.add_argument("--steps", default="off", choices=["on", "off"],
                   help="'on': a request's rounds after its first go to each worker in one Steps stream per "
                        "process — one message per step carrying every due request's round (orchestrator.steps, "
                        "serving.steps) — instead of a message per request on its Session; 'off': per request")
    p.add_argument("--auth-token", default="",
                   help="require 'authorization: Bearer <token>' on every public call except health checks "
                        "(UNAUTHENTICATED otherwise); prefer SPECDEC_AUTH_TOKEN (flags show in ps)")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--processes", type=int, default=1,
                   help="orchestrator processes sharing --port (serving.shards): the kernel spreads client "
                        "connections over them, so N processes do N times the per-round host work of one; "
                        "/metrics on --metrics-port sums them. One client connection's streams stay on one process")
    add_operation_flags(p)
    env_flags(p, {"--host": "orchestrator_host", "--port": "orchestrator_port", "--target": "target_address",
                  "--draft": "draft_address", "--max-tokens": "max_tokens_limit"})
    args = p.parse_args(argv)
    check_spin_settings(p)
    if args.processes < 1:
        p.error(f"--processes must be >= 1 (got {args.processes})")
    if args.processes > 1 and args.host.startswith("unix:"):
        p.error("--processes > 1 needs a TCP --host (shards share a port; a unix socket path cannot be shared)")
    for action in p._actions:  # a value from the environment (SPECDEC_*) is not checked against choices by argparse
        value = getattr(args, action.dest, None)
        if action.choices and value not in action.choices:
            *first, last = action.choices
            p.error(f"{action.option_strings[-1]} must be {', '.join(first)} or {last}, got {value!r}")
    if args.cost_model:
        from orchestrator.adaptive import load_cost_model

        try:
            args.cost_table = load_cost_model(args.cost_model)
        except ValueError as e:
            p.error(f"--cost-model: {e}")
    return args


def register(host, state: dict) -> None:
    from orchestrator.servicer import OrchestratorServicer
    from specdec_proto.v1 import orchestrator_pb2_grpc

    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(state), host.server)


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str):
    """The tokenizer of ``path`` (GGUF or HF dir), loaded once per process (~8 s on 2 busy cores;
    in-process test servers start several orchestrators)."""
    from modeling.tokenizer import TextTokenizer

    return TextTokenizer.from_file(path)


async def prepare(args, host, state: dict, log):
    """Wait for the target (``--worker-timeout``; ``serving.launch.StartupError`` naming its
    address when it never becomes SERVING); the drafter is optional: when it is not ready yet
    the orchestrator starts with a draft outage (``orchestrator.fallback``: one-token rounds,
    speculation once it is up and fits the target). The servicer's state is filled by
    ``load_and_warm``."""
    from modeling.model_files import default_gguf_path
    from orchestrator.adaptive import CPU_COSTS, BudgetPlanner, default_cost_model
    from orchestrator.budget import H200_STEPS_COSTS, shared_by
    from orchestrator.fallback import DraftHealth
    from orchestrator.servicer import Limits
    from orchestrator.workers import (DataChannelError, DraftWorker, Pings, TargetWorker, WorkerTimeout, readiness,
                                      wait_serving)
    from serving.launch import StartupError
    from serving.security import channel_credentials
    from serving.shards import shard

    pings = Pings(args.worker_ping_ms, args.worker_ping_timeout_ms)
    tls = channel_credentials(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    steps = args.steps == "on"
    target = TargetWorker(args.target, args.max_message_mb, pings, tls, args.data_channel, steps)
    draft = DraftWorker(args.draft, args.max_message_mb, pings, tls, args.data_channel, steps)
    try:
        await wait_serving(target.channel, target.service, args.worker_timeout, log, "target service", args.target,
                           tls is not None)
        t_info = await target.info()
    except (WorkerTimeout, DataChannelError) as e:
        raise StartupError(str(e)) from None
    fitted: dict = {}

    async def draft_ready() -> bool:
        """The breaker's probe: the drafter is ready and fits the target (checked until it does;
        a misfit is logged once per distinct reason)."""
        ok, _ = await readiness(draft.channel, draft.service)
        if ok and "max_tree_budget" not in fitted:
            try:
                d_info = await draft.info()
            except DataChannelError as e:  # (--data-channel socket, a drafter found later without one)
                d_info, misfit = None, str(e)
            else:
                misfit = _misfit(t_info, d_info)
            if misfit:
                if fitted.get("misfit") != misfit:
                    log.error(f"draft service at {args.draft} does not fit the target: {misfit}; speculation stays off")
                fitted["misfit"] = misfit
                return False
            fitted.update(max_tree_budget=d_info.max_tree_budget, name=d_info.model_name)
            if "limits" in state:
                state["limits"] = dataclasses.replace(
                    state["limits"], max_tree_budget=min(t_info.max_tree_budget, d_info.max_tree_budget))
        return ok

    ok, why = await readiness(draft.channel, draft.service)
    if ok:
        try:
            misfit = _misfit(t_info, await draft.info())
        except DataChannelError as e:
            raise StartupError(str(e)) from None
        if misfit:
            raise StartupError(f"draft service at {args.draft} does not fit the target: {misfit}")
        ok = await draft_ready()

    health = DraftHealth(draft_ready, round_timeout=args.draft_timeout_ms / 1000 or None,
                         replay_rows=args.draft_replay_tokens)
    if not ok:  # start in an outage: one-token rounds until the drafter is found ready
        health.failed(health.epoch, f"draft service at {args.draft} not ready at start-up ({why})")

    def load_and_warm():
        state["tokenizer"] = load_tokenizer(args.target_model or default_gguf_path())
        state["target"], state["draft"] = target, draft
        state["draft_health"] = health
        cost = getattr(args, "cost_table", None) or default_cost_model(t_info.device, steps)
        # a shard plans its share of the workers' step (budget.shared_by) — with the GPU tables, whose host terms
        # are the orchestrator's Python; the CPU tables' host_ms holds the workers' per-request forward (shared)
        processes = (shard() or (0, 1))[1] if t_info.device.startswith("cuda") else 1
        state["planner"] = BudgetPlanner(shared_by(cost, processes), defer=args.replan == "deferred",
                                         common_mode=args.host_drift == "common", learn=args.adaptive_learn == "on")
        state["limits"] = Limits(
            max_context=t_info.max_context, max_tokens=min(args.max_tokens, t_info.max_context - 1),
            max_tree_budget=min(t_info.max_tree_budget, fitted.get("max_tree_budget", t_info.max_tree_budget)),
            default_tree_budget=args.default_budget,
            vocab_size=t_info.vocab_size, eos_token_ids=tuple(t_info.eos_token_ids),
            budget_policy=args.tree_budget_policy)
        log.info("connected", target=t_info.model_name, drafter=fitted.get("name", f"not ready ({args.draft})"),
                 tree_budget_policy=args.tree_budget_policy, steps=args.steps, replan=args.replan,
                 host_drift=args.host_drift,
                 adaptive_learn=args.adaptive_learn,
                 cost_model=args.cost_model or {CPU_COSTS: "CPU", H200_STEPS_COSTS: "H200 steps"}.get(cost, "H200"),
                 planned_as_share_of=processes,
                 **busy_poll_fields())

    async def warm_round():
        from orchestrator.generation import GenerationRequest, generate

        import grpc
        import structlog

        req = GenerationRequest("warmup", state["tokenizer"].encode("Hello"), max_tokens=4, mode="tree", tree_budget=4)
        try:  # (the workers log the round under request id "warmup", not an empty one)
            with structlog.contextvars.bound_contextvars(request_id="warmup"):
                async for _ in generate(req, state["tokenizer"], target, draft, state["draft_health"], state["planner"]):
                    pass
        except grpc.aio.AioRpcError as e:
            raise StartupError(f"the warm-up request failed: {e.code().name}: {e.details()}"
                               + ("; set SPECDEC_DATA_TOKEN to the workers' value"
                                  if e.code() == grpc.StatusCode.UNAUTHENTICATED else "")) from None

    return load_and_warm, warm_round


async def follow(host, state: dict, log) -> None:
    """Readiness follows the workers (``orchestrator.workers.follow_workers``)."""
    from orchestrator.workers import follow_workers

    await follow_workers(host, state["target"], state["draft"], log, state=state, health=state["draft_health"])


def _misfit(t_info, d_info) -> str:
    """Why the drafter cannot draft for the target ("" when it can): vocabulary, hidden size and
    tapped layers must agree."""
    if (t_info.vocab_size, t_info.hidden_size) != (d_info.vocab_size, d_info.hidden_size):
        return (f"drafter (vocab {d_info.vocab_size}, hidden {d_info.hidden_size}) does not fit the "
                f"target (vocab {t_info.vocab_size}, hidden {t_info.hidden_size})")
    if list(t_info.taps) != list(d_info.taps):
        return f"target taps {list(t_info.taps)} != drafter taps {list(d_info.taps)}"
    return ""


ROLE = Role("orchestrator", "specdec.v1.Orchestrator", register, prepare, follow)

def main(argv=None) -> None:
    """Serve (``serving.launch``), or with ``--processes N`` > 1 supervise N shards on one port
    (``serving.shards``)."""
    args = parse_args(argv)
    if args.processes == 1:
        launch(ROLE, args)
        return
    import sys

    from orchestrator.adaptive import PLAN_RATE, ROUND_SHAPES
    from serving.logs import configure
    from serving.metrics import ORCHESTRATOR
    from serving.shards import supervise

    log = configure("orchestrator", args.log_level)
    names = [family._name for family in (*ORCHESTRATOR, PLAN_RATE, ROUND_SHAPES)]
    sys.exit(supervise("orchestrator", sys.argv[1:] if argv is None else list(argv), args.processes, args.host,
                       args.port, args.metrics_port, args.drain_seconds, log, names))


if __name__ == "__main__":
    main()
