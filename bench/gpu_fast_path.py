"""GPU fast path (issue 8): verify-forward timings, bf16 exactness and throughput in one run.

python -m bench.gpu_fast_path --gguf PATH [--prompts-file F] [--max-tokens 128] [--out DIR]

On one CUDA device, in-process (engines + the orchestrator's own round loop, no gRPC):
1. verify forward time per tree size: eager torch path (``--fast off``), row-invariant Triton
   path without graphs, and CUDA-graph replay (CUDA events, median of 20);
2. draft forward and DDTree build time at budget 64;
3. greedy output of chain and tree@{1,4,16,64,256,512} against autoregressive, bf16, on the
   bench prompts (5 HumanEval + 5 MT-Bench, --max-tokens) and the 20 test prompts (64 tokens);
4. tokens/s, τ and ms per round (draft / verify / other) at T=0 and T=0.7 (seeded);
5. the peer: transformers' Llama with a static cache + torch.compile on the same prompts.
Prints tables and writes gpu_fast_path.json / throughput_h200.md to --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

TREE_BUDGETS = (1, 4, 16, 64, 256, 512)


def cuda_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() by CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def load(gguf: str, fast: str):
    from draft_service.engine import DraftEngine
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from modeling.dflash import DFlashDrafter
    from modeling.llama import LlamaModel
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import load_target
    from target_service.engine import TargetEngine

    dev, dt = torch.device("cuda"), torch.bfloat16
    cfg, state = load_target(gguf)
    model = LlamaModel.from_state_dict(cfg, state, dev, dt)
    drafter = DFlashDrafter.load(DEFAULT_DRAFTER_DIR).to(dev, dt).eval().requires_grad_(False)
    embed = model.model.embed_tokens.weight
    t0 = time.perf_counter()
    target = TargetEngine(model, drafter.config.target_layer_ids, 8192, 1 << 16, 512, fast=fast)
    capture = time.perf_counter() - t0
    draft = DraftEngine(drafter, embed, model.lm_head.weight, 512, fast=fast)
    print("draft graphs captured in", draft.fast.capture_seconds if draft.fast else None, flush=True)
    return cfg, state, model, TextTokenizer.from_file(gguf), target, draft, capture


def verify_timings(model, target) -> list[dict]:
    """Forward-only time of one tree verify at a 300-token prefix, per tree size and path."""
    from modeling.llama import tree_mask
    from modeling.sampling import SamplingParams
    from modeling.tree import tree_ancestors, visibility
    from target_service.engine import TargetEngine

    rows = []
    engines = {f: TargetEngine(model, target.taps, 8192, 1 << 14, 512, fast=f) for f in ("off", "eager")}
    engines["graphs"] = target
    prompt = list(range(100, 400))
    for e in engines.values():
        e.prefill("t", prompt, 600, SamplingParams(), "tree", 512)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 17, 33, 65, 129, 257, 513):
        parents = [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=g)
        depths, anc = tree_ancestors(parents)
        pos = 300 + torch.from_numpy(depths).cuda()
        row = dict(rows=n)
        for name, e in engines.items():
            cache = e._requests["t"].cache
            if name == "off":
                mask = tree_mask(300, torch.from_numpy(visibility(depths, anc)).cuda())
                tok = tokens.cuda()
                fn = lambda: model.logits(model(tok, pos, cache, mask, target.taps)[0])
            else:  # includes sending the inputs (one host → device copy)
                fn = lambda e=e, cache=cache: e._tree_forward(tokens.tolist(), depths, anc, cache.base, 300)
            with torch.inference_mode():
                row[name] = round(cuda_ms(fn), 3)
                if name == "graphs":  # the replay alone (inputs already on the device)
                    graph = e._tree_forward.graphs[e._tree_forward.bucket(n)][0]
                    row["replay_only"] = round(cuda_ms(graph.replay), 3)
        row["graphs_vs_eager_triton"] = round(row["eager"] / row["graphs"], 2)
        row["graphs_vs_torch"] = round(row["off"] / row["graphs"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for e in engines.values():
        e.release(["t"])
    return rows


def draft_timings(draft) -> list[dict]:
    """One draft call (3 new context rows appended, block forward, tree build, host copy) at a
    300-row context, per budget: eager engine vs the graphed engine; and the tree build alone
    inside a CUDA graph (µs) from the drafter's float32 logits [1, 7, V]: the ranked top-K
    log-probs (``draft_service.fast_draft.ranked_log_probs``: the fused top-K kernel up to K 64)
    + the best-first kernel (``specdec_kernels.ddtree_build``), what the propose graph runs at the
    bucket's capacity, vs the batched torch builder."""
    from bench.kernel_tiles import per_launch_ms
    from draft_service.ddtree import build_chain, build_ddtree
    from draft_service.engine import DraftEngine
    from draft_service.fast_draft import ranked_log_probs
    from specdec_kernels.ddtree_build import build_ddtree_topk

    graph_us = lambda fn: 1000 * per_launch_ms(fn, 10)  # noqa: E731 (inside one CUDA graph: no launch gaps)

    eager = DraftEngine(draft.drafter, draft.embed, draft.lm_head, 512)
    w, rows = draft.feature_width, []
    for mode, budget in [("chain", 1), ("tree", 4), ("tree", 16), ("tree", 64), ("tree", 256), ("tree", 512)]:
        row = dict(mode=mode, budget=budget)
        for name, e in (("eager", eager), ("graphs", draft)):
            with torch.inference_mode():
                e.draft("d", torch.zeros(300, w), 0, 5, mode, budget)
                start = [300]

                def call(e=e, start=start):
                    e.draft("d", torch.zeros(3, w), start[0], 5)
                    start[0] += 3
                row[name] = round(cuda_ms(call), 3)
            e.release(["d"])
        graphs = draft.fast.graphs if draft.fast else {}
        if graphs:  # a round's one replay (context append + block forward + tree build), and without the append
            key = ("chain", 0) if mode == "chain" else ("tree", next(b for b in draft.fast.buckets if b >= budget))
            row["round_replay"] = round(cuda_ms(graphs[("append", key)][0].replay), 3)
            row["propose_replay"] = round(cuda_ms(graphs[key][0].replay), 3)
        logits = torch.randn(1, draft.cfg.block_size - 1, draft.cfg.vocab_size, device="cuda")
        root = torch.tensor([5], device="cuda")
        row["ddtree_build_eager"] = round(cuda_ms(lambda: build_ddtree(logits, root, budget)), 3)
        D, V = logits.shape[1:]
        cap = D if mode == "chain" else next(b for b in draft.fast.buckets if b >= budget) if draft.fast else budget
        k, nodes = (1, torch.tensor([D], device="cuda")) if mode == "chain" else (min(cap, V), torch.tensor([budget], device="cuda"))
        with torch.inference_mode():
            row["tree_build_fused_us"] = round(graph_us(
                lambda: build_ddtree_topk(*ranked_log_probs(logits, k), root, nodes, cap)), 1)
            row["tree_build_torch_us"] = round(graph_us(
                lambda: build_chain(logits, root, visibility=False) if mode == "chain"
                else build_ddtree(logits, root, budget, visibility=False)), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_mode(tok, target, draft, prompts, mode, budget, max_tokens, temperature=0.0):
    from deploy.inprocess import InProcessDraft, InProcessTarget, run
    from modeling.sampling import SamplingParams
    from orchestrator.generation import GenerationRequest

    class TimedTarget(InProcessTarget):  # prefill time, so "other" is the per-round remainder
        async def prefill(self, *a, **k):
            t = time.perf_counter()
            out = await super().prefill(*a, **k)
            st["prefill"] += time.perf_counter() - t
            return out

    outs, taus, st = [], [], dict(rounds=0, draft=0.0, verify=0.0, tokens=0, prefill=0.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        sp = SamplingParams(temperature, 0, 1.0, 1000 + i)
        req = GenerationRequest(f"{mode}{budget}-{i}", ids, max_tokens, mode=mode, tree_budget=budget or 1,
                                stop_token_ids=set(), sampling=sp)
        r = run(req, tok, TimedTarget(target), InProcessDraft(draft))
        s = r.finished.stats
        outs.append(r.token_ids)
        taus.append(s.mean_accept_length)
        st["rounds"] += s.rounds
        st["draft"] += s.draft_seconds
        st["verify"] += s.verify_seconds
        st["tokens"] += len(r.token_ids)
    wall = time.perf_counter() - t0
    ms = lambda x: round(1000 * x / max(st["rounds"], 1), 3)
    return outs, dict(mode=mode, budget=budget, temperature=temperature, tokens=st["tokens"],
                      seconds=round(wall, 3), tokens_per_s=round(st["tokens"] / wall, 1),
                      tau=round(sum(taus) / len(taus), 3), ms_draft=ms(st["draft"]), ms_verify=ms(st["verify"]),
                      ms_other=ms(wall - st["draft"] - st["verify"] - st["prefill"]),  # loop, wire glue, detokenize
                      ms_prefill_per_request=round(1000 * st["prefill"] / len(prompts), 3))


def peer_tokens_per_s(cfg, state, prompts, max_tokens) -> dict:
    """transformers LlamaForCausalLM (same weights, bf16) with a static cache, whose decoding
    forward generate() compiles with torch.compile."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(state, strict=False)
    hf = hf.to("cuda", torch.bfloat16).eval()
    # A static cache makes generate() compile the decoding forward itself (transformers'
    # CompileConfig: inductor, CUDA graphs); a hand-compiled forward trips over its graph outputs.
    hf.generation_config.cache_implementation = "static"
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    t0 = time.perf_counter()
    with torch.no_grad():
        for ids in prompts[:2]:  # compile + warm up
            hf.generate(torch.tensor([ids], device="cuda"), **kw)
    warm = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    with torch.no_grad():
        for ids in prompts:
            n += hf.generate(torch.tensor([ids], device="cuda"), **kw).shape[1] - len(ids)
    torch.cuda.synchronize()
    return dict(mode="transformers static cache + torch.compile", tokens=n,
                tokens_per_s=round(n / (time.perf_counter() - t0), 1), warmup_s=round(warm, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts-file", default="")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip", default="", help="comma list of: verify,draft,exact,sampled,peer")
    args = ap.parse_args(argv)
    skip = set(args.skip.split(","))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = dict(device=torch.cuda.get_device_name(), dtype="bfloat16", torch=torch.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))

    def save():
        (out / "gpu_fast_path.json").write_text(json.dumps(res, indent=1))

    cfg, state, model, tok, target, draft, capture_s = load(args.gguf, "graphs")
    res["graph_capture_s"] = round(capture_s, 2)
    res["draft_graph_capture_s"] = round(draft.fast.capture_seconds, 2)
    res["graph_buckets"] = target._tree_forward.buckets
    from draft_service.fast_draft import FUSED_TOPK
    res["drafter_topk"] = "fused (specdec_kernels.topk_logprobs, K <= 64)" if FUSED_TOPK else "log_softmax + torch.topk"
    print("capture", capture_s, flush=True)
    prompts = json.loads(pathlib.Path(args.prompts_file).read_text())
    bench, test = prompts["bench"], prompts["test"]
    if "verify" not in skip:
        res["verify_ms"] = verify_timings(model, target)
        save()
    if "draft" not in skip:
        res["draft_ms"] = draft_timings(draft)
        save()
    modes = [("autoregressive", 0), ("chain", 0)] + [("tree", b) for b in TREE_BUDGETS]
    res["greedy"], res["identical"] = [], {}
    if "exact" not in skip:
        for name, ps, n in (("bench", bench, args.max_tokens), ("test", test, 64)):
            ref = None
            for mode, budget in modes:
                outs, row = run_mode(tok, target, draft, ps, mode, budget, n)
                ref = ref or outs
                same = sum(a == b for a, b in zip(outs, ref))
                row.update(prompts=name, identical_prompts=f"{same}/{len(ps)}")
                res["greedy"].append(row)
                print(json.dumps(row), flush=True)
                save()
    if "sampled" not in skip:
        res["sampled"] = []
        ref = None
        for mode, budget in [("autoregressive", 0), ("chain", 0), ("tree", 64), ("tree", 256)]:
            outs, row = run_mode(tok, target, draft, bench, mode, budget, args.max_tokens, 0.7)
            ref = ref or outs
            row["identical_prompts"] = f"{sum(a == b for a, b in zip(outs, ref))}/{len(bench)}"
            res["sampled"].append(row)
            print(json.dumps(row), flush=True)
            save()
    if "peer" not in skip:
        try:
            res["peer"] = peer_tokens_per_s(cfg, state, bench, args.max_tokens)
        except Exception as e:  # the peer must not cost the rest of the run
            res["peer"] = dict(mode="transformers static cache + torch.compile", error=repr(e)[:500],
                               tokens_per_s=None, warmup_s=None)
        print(json.dumps(res["peer"]), flush=True)
        save()
    (out / "throughput_h200.md").write_text(report(res))
    print(report(res))
    return 0


def report(res: dict) -> str:
    lines = [f"# GPU fast path on {res['device']} ({res['dtype']}, torch {res['torch']}, {res['date']})", "",
             f"CUDA graphs: {len(res.get('graph_buckets', []))} buckets captured in {res.get('graph_capture_s')} s. "
             f"Drafter top-K: {res.get('drafter_topk', 'log_softmax + torch.topk')}.", ""]
    if "verify_ms" in res:
        lines += ["## Verify forward (ms, median of 20, prefix 300)", "",
                  "| rows | torch eager | Triton eager | graphs (incl. input copy) | replay alone | graphs vs Triton eager "
                  "| graphs vs torch |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rows']} | {r['off']} | {r['eager']} | {r['graphs']} | {r.get('replay_only', '-')} | "
                  f"{r['graphs_vs_eager_triton']}× | {r['graphs_vs_torch']}× |" for r in res["verify_ms"]]
    if "draft_ms" in res:
        lines += ["", "## Draft call (ms, median of 20; append 3 context rows at 300, block forward, tree build, "
                      "host copy; tree build alone in µs inside a CUDA graph, from the drafter's float32 logits [1, 7, V]: "
                      "top-K log-probs (fused kernel up to K 64) + best-first kernel, as the propose graph runs it, "
                      "vs the batched torch builder)", "",
                  "| mode | budget | eager | graphs | append + block + tree-build replay | block + tree-build replay "
                  "| DDTree build alone (eager) | tree build fused, graph (µs) | torch builder, graph (µs) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['budget']} | {r['eager']} | {r['graphs']} | {r.get('round_replay', r.get('append_replay', '-'))} | "
                  f"{r.get('propose_replay', '-')} | {r['ddtree_build_eager']} | {r.get('tree_build_fused_us', '-')} | "
                  f"{r.get('tree_build_torch_us', '-')} |" for r in res["draft_ms"]]
        lines.append("")
    for key, title in (("greedy", "Greedy (T=0)"), ("sampled", "Sampled (T=0.7, seeded)")):
        if res.get(key):
            lines += [f"## {title}", "", "| prompts | mode | budget | tok/s | τ | ms/round draft | verify | other | "
                      "prefill ms/request | identical to AR |", "|---|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r.get('prompts', 'bench')} | {r['mode']} | {r['budget'] or '-'} | {r['tokens_per_s']} | "
                      f"{r['tau']} | {r['ms_draft']} | {r['ms_verify']} | {r['ms_other']} | "
                      f"{r.get('ms_prefill_per_request', '-')} | {r['identical_prompts']} |" for r in res[key]]
            lines.append("")
    if "peer" in res:
        lines += [f"Peer: {res['peer']['mode']}: **{res['peer']['tokens_per_s']} tok/s** "
                  f"(same bench prompts and tokens; warm-up/compile {res['peer']['warmup_s']} s)."]
    bench_rows = [r for r in res.get("greedy", []) if r.get("prompts") == "bench"]
    if bench_rows:
        ar = next(r for r in bench_rows if r["mode"] == "autoregressive")["tokens_per_s"]
        best = max((r for r in bench_rows if r["mode"] != "autoregressive"), key=lambda r: r["tokens_per_s"])
        peer = (res.get("peer") or {}).get("tokens_per_s")
        lines += ["", f"Best speculative mode (greedy, bench prompts): {best['mode']} {best['budget'] or ''} "
                      f"{best['tokens_per_s']} tok/s = {best['tokens_per_s'] / ar:.2f}× our autoregressive ({ar} tok/s)"
                      + (f", {best['tokens_per_s'] / peer:.2f}× the peer; our autoregressive = {ar / peer:.2f}× the peer."
                         if peer else ".")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
