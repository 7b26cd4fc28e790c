"""python -m draft_service — serve the DFlash drafter (default: the shipped one for SmolLM2)."""
from __future__ import annotations

import argparse

from modeling.dflash import DEFAULT_DRAFT_WINDOW
from serving.datachannel import add_data_socket_flag
from serving.launch import Role, env_flags, launch, parse_checked, parser
from serving.server import BATCHING_BOUNDS, add_batching_flags, add_operation_flags, check_batching


def parse_args(argv=None):
    p = parser("draft_service", __doc__, port=50062)
    p.add_argument("--target-model", default="",
                   help="GGUF file or HF dir of the target (its embedding + LM head); empty = default")
    p.add_argument("--drafter", default="",
                   help="DFlash checkpoint dir; empty = shipped one, or 'random' for a seeded random drafter")
    p.add_argument("--seed", type=int, default=0, help="seed of the random drafter")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU: drafter block forward + DDTree build replayed from CUDA graphs per budget bucket "
                        "(--no-graphs: the same fused kernels, eager); CPU always runs the eager torch drafter")
    p.add_argument("--context-pool-tokens", type=int, default=1 << 16,
                   help="on a GPU: drafter context rows of all live requests together")
    p.add_argument("--draft-window", type=int, default=DEFAULT_DRAFT_WINDOW,
                   help="the drafter attends only to the last >= W context rows (whole pages of 128; "
                        "0 = the whole context; default measured on the H200, modeling.dflash."
                        "DEFAULT_DRAFT_WINDOW); the output stays lossless, only the drafts change")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (1: per-round work is small; more threads oversubscribe "
                        "a CPU shared with the other services)")
    p.add_argument("--max-budget", dest="max_tree_budget", type=int, default=512,
                   help="most non-root nodes of a draft tree per request (max_tree_budget)")
    add_batching_flags(p, "draft")
    p.add_argument("--max-message-mb", type=int, default=64,
                   help="largest gRPC message in MiB")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR")
    add_operation_flags(p)
    add_data_socket_flag(p)
    env_flags(p, {"--host": "draft_host", "--port": "draft_port", "--seed": "drafter_seed"})
    return check_batching(p, parse_checked(p, argv, {"--context-pool-tokens": 1, "--threads": 1, "--max-budget": 1,
                                   "--draft-window": 0, "--max-message-mb": 1, **BATCHING_BOUNDS}))


def register(host, ref: dict) -> None:
    from draft_service.servicer import DraftServicer
    from specdec_proto.v2 import draft_pb2, draft_pb2_grpc

    servicer = DraftServicer(host, ref)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, host.server)
    ref["session"] = (servicer, draft_pb2.DraftMessage)  # for the data channel (serving.datachannel)
    ref["steps"] = draft_pb2.DraftStep


async def prepare(args, host, ref: dict, log):
    from serving.server import pick_device

    host.set_batching(args.max_batch, args.batch_wait_us / 1e6, args.max_sessions)

    def load_and_warm():
        import pathlib

        import torch

        from draft_service.engine import DraftEngine
        from modeling.defaults import DEFAULT_DRAFTER_DIR, drafter_config
        from modeling.dflash import DFlashDrafter
        from modeling.weights import load_embedding_and_head

        device, dtype = pick_device(args.device, args.dtype)
        torch.set_num_threads(args.threads)
        cfg, embed, head = load_embedding_and_head(args.target_model or None)
        directory = pathlib.Path(args.drafter) if args.drafter not in ("", "random") else DEFAULT_DRAFTER_DIR
        if args.drafter != "random" and (directory / "config.json").exists():
            drafter, label = DFlashDrafter.load(directory), str(directory)
        elif args.drafter not in ("", "random"):
            raise FileNotFoundError(f"--drafter {directory} has no config.json")
        else:  # no trained drafter shipped yet, or asked for: seeded random weights
            drafter, label = DFlashDrafter.random(drafter_config(cfg, fresh=True), args.seed), f"random(seed={args.seed})"
        drafter = drafter.to(device, dtype).eval().requires_grad_(False)
        fast = "off" if device.type != "cuda" else ("graphs" if args.graphs else "eager")
        engine = DraftEngine(drafter, embed.to(device, dtype), head.to(device, dtype), args.max_tree_budget, name=label,
                             fast=fast, context_pool_tokens=args.context_pool_tokens, window=args.draft_window)
        if fast == "graphs":
            log.info("captured draft graphs", buckets=engine.fast.buckets,
                     seconds=round(engine.fast.capture_seconds, 2))
        width = engine.feature_width
        engine.draft("warmup", torch.zeros(4, width), 0, 1, "tree", 8)
        engine.release(["warmup"])
        ref["engine"] = engine
        log.info("loaded", drafter=label, device=str(device), taps=list(drafter.config.target_layer_ids),
                 draft_window=args.draft_window)

    return load_and_warm, None


ROLE = Role("draft", "specdec.v2.DraftService", register, prepare)

if __name__ == "__main__":
    launch(ROLE, parse_args())
