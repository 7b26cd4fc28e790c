"""python -m orchestrator — the public Generate API in front of the draft and target services."""
from __future__ import annotations

import argparse
import asyncio
import functools

from serving.launch import Role, launch
from serving.server import add_operation_flags, env_default as env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default=env("orchestrator_host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("orchestrator_port", 50051))
    p.add_argument("--target", default=env("target_address", "127.0.0.1:50061"))
    p.add_argument("--draft", default=env("draft_address", "127.0.0.1:50062"))
    p.add_argument("--target-model", default=env("target_model", ""),
                   help="GGUF file or HF dir for the tokenizer; empty = embedded default")
    p.add_argument("--max-tokens", type=int, default=env("max_tokens_limit", 4096), help="per-request limit")
    p.add_argument("--default-budget", type=int, default=env("default_budget", 32))
    p.add_argument("--worker-timeout", type=float, default=env("worker_timeout", 600.0),
                   help="seconds to wait for the workers to become SERVING")
    p.add_argument("--max-message-mb", type=int, default=env("max_message_mb", 64))
    p.add_argument("--draft-timeout-ms", type=float, default=env("draft_timeout_ms", 2000.0),
                   help="a draft call slower than this falls back to a one-token round and counts as a draft "
                        "service failure (0 = no limit)")
    p.add_argument("--draft-replay-tokens", type=int, default=env("draft_replay_tokens", 256),
                   help="context-feature rows each request keeps to seed a new draft session after a draft "
                        "service failure (memory: rows x taps x hidden x dtype bytes per request)")
    p.add_argument("--worker-ping-ms", type=int, default=env("worker_ping_ms", 1000),
                   help="keepalive ping on the worker links after this long without traffic")
    p.add_argument("--worker-ping-timeout-ms", type=int, default=env("worker_ping_timeout_ms", 2000),
                   help="a worker that does not answer a ping within this is hung: its link closes, in-flight "
                        "requests end UNAVAILABLE (target) or go on with one-token rounds (drafter); a worker "
                        "busy with a long forward still answers pings")
    p.add_argument("--worker-tls-ca", default=env("worker_tls_ca", ""),
                   help="PEM CA that signed the workers' certificates: TLS on both worker links (empty = plain text)")
    p.add_argument("--worker-tls-cert", default=env("worker_tls_cert", ""),
                   help="PEM client certificate for mutual TLS on the worker links (with --worker-tls-key)")
    p.add_argument("--worker-tls-key", default=env("worker_tls_key", ""), help="PEM private key of --worker-tls-cert")
    p.add_argument("--auth-token", default=env("auth_token", ""),
                   help="require 'authorization: Bearer <token>' on every public call except health checks "
                        "(UNAUTHENTICATED otherwise); prefer SPECDEC_AUTH_TOKEN (flags show in ps)")
    p.add_argument("--log-level", default=env("log_level", "INFO"))
    add_operation_flags(p)
    return p.parse_args(argv)


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
    """Wait for both workers, check they fit each other; the servicer's state is filled by
    ``load_and_warm``."""
    from modeling.model_files import default_gguf_path
    from orchestrator.fallback import DraftHealth
    from orchestrator.servicer import Limits
    from orchestrator.workers import DraftWorker, Pings, TargetWorker, is_ready, wait_serving
    from serving.security import channel_credentials

    pings = Pings(args.worker_ping_ms, args.worker_ping_timeout_ms)
    tls = channel_credentials(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    target = TargetWorker(args.target, args.max_message_mb, pings, tls)
    draft = DraftWorker(args.draft, args.max_message_mb, pings, tls)
    await asyncio.gather(wait_serving(target.channel, target.service, args.worker_timeout),
                         wait_serving(draft.channel, draft.service, args.worker_timeout))
    t_info, d_info = await target.info(), await draft.info()
    if (t_info.vocab_size, t_info.hidden_size) != (d_info.vocab_size, d_info.hidden_size):
        raise SystemExit(f"drafter (vocab {d_info.vocab_size}, hidden {d_info.hidden_size}) does not fit the "
                         f"target (vocab {t_info.vocab_size}, hidden {t_info.hidden_size})")
    if list(t_info.taps) != list(d_info.taps):
        raise SystemExit(f"target taps {list(t_info.taps)} != drafter taps {list(d_info.taps)}")

    def load_and_warm():
        state["tokenizer"] = load_tokenizer(args.target_model or default_gguf_path())
        state["target"], state["draft"] = target, draft
        state["draft_health"] = DraftHealth(lambda: is_ready(draft.channel, draft.service),
                                            round_timeout=args.draft_timeout_ms / 1000 or None,
                                            replay_rows=args.draft_replay_tokens)
        state["limits"] = Limits(
            max_context=t_info.max_context, max_tokens=min(args.max_tokens, t_info.max_context - 1),
            max_tree_budget=min(t_info.max_tree_budget, d_info.max_tree_budget),
            default_tree_budget=args.default_budget,
            vocab_size=t_info.vocab_size, eos_token_ids=tuple(t_info.eos_token_ids))
        log.info("connected", target=t_info.model_name, drafter=d_info.model_name)

    async def warm_round():
        from orchestrator.generation import GenerationRequest, generate

        req = GenerationRequest("warmup", state["tokenizer"].encode("Hello"), max_tokens=4, mode="tree", tree_budget=4)
        async for _ in generate(req, state["tokenizer"], target, draft, state["draft_health"]):
            pass

    return load_and_warm, warm_round


async def follow(host, state: dict, log) -> None:
    """Readiness follows the workers (``orchestrator.workers.follow_workers``)."""
    from orchestrator.workers import follow_workers

    await follow_workers(host, state["target"], state["draft"], log, state=state, health=state["draft_health"])


ROLE = Role("orchestrator", "specdec.v1.Orchestrator", register, prepare, follow)

if __name__ == "__main__":
    launch(ROLE, parse_args())
