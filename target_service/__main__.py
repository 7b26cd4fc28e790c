"""python -m target_service — serve a target: Llama family (default: embedded SmolLM2-135M) or a
DeepSeek-V3 / Kimi-K2 HF directory (chosen by its config.json model_type; --tp N ranks)."""
from __future__ import annotations

import argparse
import asyncio

from serving.datachannel import add_data_socket_flag
from serving.launch import Role, StartupError, env_flags, launch, parse_checked, parser
from serving.server import BATCHING_BOUNDS, add_batching_flags, add_operation_flags, check_batching


def parse_args(argv=None):
    p = parser("target_service", __doc__, port=50061)
    p.add_argument("--model", default="", help="GGUF file or HF dir; empty = embedded default")
    p.add_argument("--drafter", default="", help="drafter dir whose tapped layers to serve")
    p.add_argument("--taps", default="", help="comma-separated tapped layers (overrides --drafter)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="smallest prompt chunk a step carries (rows; the CPU path runs every chunk as pieces "
                        "of this size; a cancelled request stops between chunks)")
    p.add_argument("--step-tokens", type=int, default=512,
                   help="step token budget: rows of one target forward step, running streams' verify rows "
                        "first, then prefill chunks of new prompts in what is left (at least --prefill-chunk); "
                        "0 = no budget (a prompt's chunks fill whole steps)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on one GPU (Llama or DeepSeek target): verify with the row-invariant Triton forward "
                        "replayed from CUDA graphs (--no-graphs: the same forward, eager); CPU and --tp > 1 run "
                        "the per-request eager forward")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (1: per-round work is small; more threads oversubscribe "
                        "a CPU shared with the other services)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (DeepSeek-V3/Kimi-K2 targets; gloo on CPU, NCCL on GPU)")
    p.add_argument("--keep-fp8", action=argparse.BooleanOptionalAction, default=False,
                   help="DeepSeek-V3/Kimi-K2 FP8 checkpoints: keep linear weights FP8 in memory, dequantised "
                        "per forward (the real models do not fit dequantised at TP8 on 141 GB GPUs)")
    p.add_argument("--max-context", type=int, default=0, help="0 = model's")
    p.add_argument("--kv-pool-tokens", type=int, default=65536,
                   help="KV cache positions of all live requests together")
    p.add_argument("--max-tree-nodes", dest="max_tree_budget", type=int, default=512,
                   help="most non-root nodes of a draft tree per request (max_tree_budget)")
    add_batching_flags(p, "verify")
    p.add_argument("--max-message-mb", type=int, default=64,
                   help="largest gRPC message in MiB")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR")
    add_operation_flags(p)
    add_data_socket_flag(p)
    env_flags(p, {"--host": "target_host", "--port": "target_port", "--model": "target_model"})
    return check_batching(p, parse_checked(p, argv, {"--prefill-chunk": 1, "--step-tokens": 0, "--threads": 1, "--tp": 1, "--max-context": 0,
                                   "--kv-pool-tokens": 1, "--max-tree-nodes": 1, "--max-message-mb": 1,
                                   **BATCHING_BOUNDS}))


def register(host, ref: dict) -> None:
    from specdec_proto.v2 import target_pb2, target_pb2_grpc
    from target_service.servicer import TargetServicer

    servicer = TargetServicer(host, ref)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
    ref["session"] = (servicer, target_pb2.TargetMessage)  # for the data channel (serving.datachannel)
    ref["steps"] = target_pb2.TargetStep


async def prepare(args, host, ref: dict, log):
    from serving.server import pick_device

    host.set_batching(args.max_batch, args.batch_wait_us / 1e6, args.max_sessions)

    loop = asyncio.get_running_loop()

    def load(device, dtype):
        from modeling.deepseek import MODEL_TYPES
        from modeling.targets import load_target_model, model_type

        if args.tp > 1:  # ranks 1…N−1 in their own processes; a dead one fails liveness and readiness
            from modeling.tp import launch as launch_ranks

            if model_type(args.model) not in MODEL_TYPES:
                raise ValueError(f"--tp {args.tp} needs a DeepSeek-V3 / Kimi-K2 checkpoint directory (config.json "
                                 f"model_type one of {sorted(MODEL_TYPES)}); Llama targets run on one device")
            model = launch_ranks(args.model, args.tp, device.type, dtype, row_invariant=device.type == "cuda",
                                 keep_fp8=args.keep_fp8)
            model.watch(lambda reason: (log.error("tensor-parallel target lost", reason=reason),
                                      asyncio.run_coroutine_threadsafe(host.fail(), loop)))
            return model
        return load_target_model(args.model or None, device, dtype, keep_fp8=args.keep_fp8)

    def load_and_warm():
        import torch

        from modeling.defaults import drafter_config
        from modeling.llama import LlamaModel
        from modeling.sampling import SamplingParams
        from protocol.types import Unavailable
        from target_service.engine import TargetEngine

        device, dtype = pick_device(args.device, args.dtype)
        torch.set_num_threads(args.threads)
        try:
            model = load(device, dtype)
        except (ValueError, KeyError, OSError, Unavailable) as e:  # the checkpoint, the flags, a rank: one line, exit 1
            raise StartupError(f"cannot load the target {args.model or '(embedded default)'}: "
                               f"{type(e).__name__}: {e}") from e
            if not isinstance(model, LlamaModel) and device.type == "cuda":
                from modeling.deepseek_fast import row_invariant_

                row_invariant_(model)  # bf16 greedy exactness on the GPU (plans/0007)
        cfg = model.cfg
        taps = (tuple(int(t) for t in args.taps.split(",")) if args.taps
                else drafter_config(cfg, args.drafter or None).target_layer_ids)
        # one GPU: the fast path (paged KV, row-invariant kernels, CUDA graphs) for Llama and DeepSeek
        # targets alike; TP ranks run the per-request path (graph replay on every rank: plans/0010)
        fast = "off" if device.type != "cuda" or args.tp > 1 else ("graphs" if args.graphs else "eager")
        if fast == "graphs" and not isinstance(model, LlamaModel):
            from modeling.deepseek_fast import capturable

            if not capturable(model):
                log.warning("routed experts of mixed kinds run the per-expert loop (host syncs): verify eagerly")
                fast = "eager"
        engine = TargetEngine(model, taps, args.max_context or cfg.max_position_embeddings,
                              args.kv_pool_tokens, args.max_tree_budget, fast=fast, prefill_chunk=args.prefill_chunk,
                              step_tokens=args.step_tokens)
        if fast == "graphs":
            g = engine._tree_forward
            log.info("captured verify graphs", buckets=g.buckets, seconds=round(g.capture_seconds, 2))
        greedy = SamplingParams()
        first = engine.prefill("warmup", [1, 2, 3, 4], 8, greedy, "tree", 2).first_token
        engine.verify("warmup", [first, 5, 6], [-1, 0, 0])
        engine.release(["warmup"])
        ref["engine"] = engine
        log.info("loaded", model=cfg.name, device=str(device), dtype=str(dtype), taps=list(taps))

    return load_and_warm, None


ROLE = Role("target", "specdec.v2.TargetService", register, prepare)

if __name__ == "__main__":
    launch(ROLE, parse_args())
