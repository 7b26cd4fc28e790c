"""What one batched verify costs (issue 14; plans/0009 "What to measure", item 1): wall ms of
``TargetEngine.verify_batch`` over b requests' trees against b single-request ``verify`` calls,
per (batch, rows per request), CUDA graphs, bf16, the real target; and whether every batched
result equals its solo result bit for bit (samples, edge probabilities, features), and graph
replay equals the eager fast path.

python -m bench.batch_costs [--gguf PATH (default $SPECDEC_GGUF)] [--batches 1,4,16,64]
                            [--rows 1,5,17] [--context 300] [--rounds 20] [--max-forward-rows 1089]
                            [--modes greedy,mixed] [--tag h200] [--out bench/results]

Per (mode, b, rows): 2b requests open with the same ``--context``-token prompts (``b*`` and
``s*``); each round every request gets a random tree of ``rows`` rows (the same tree for b_i
and s_i) and the commit of its previous tree's walked path; the ``b*`` items run as one
``verify_batch`` call, the ``s*`` as b ``verify_batch([item])`` calls. mode "greedy": all
greedy; "mixed": every second request sampled (temperature 0.8, top-p 0.95, its own seed;
a forward's sampled trees are drawn together by one eager ``modeling.graphs.sample_trees_device``;
a batch of one replays its sampling graph). Times are host wall ms per call
(the call returns after its device → host copies), median and p90 over ``--rounds`` after 3
warm-up rounds. ``same``: every batched result == its solo result. Then the eager fast path
(no graphs) replays a mixed sequence at b=16 and b=4 and is compared with the graphs engine.
First, the paged KV's cost in the attention kernel alone: ``tree_attention`` over 128-row pages
from a shuffled free list against the contiguous layout holding the same K/V (the target's head
shapes, one layer; GPU µs per launch from a CUDA graph of 20 launches, 1/17/65 query rows of a
deep tree at prefixes 300 and 2000; outputs checked equal bit for bit).
Prints a table; writes batch_costs_<tag>.json and .md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tree(rows: int, bonus: int, vocab: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """A random tree of ``rows`` rows rooted at bonus (parents within the last 4 nodes, so
    trees are deep as DDTree's are); siblings' tokens distinct (tokens all distinct)."""
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=g)) for i in range(1, rows)]
    tokens = [bonus] + [int(t) for t in torch.randperm(vocab, generator=g)[:rows - 1]]
    return tokens, parents


def same(a, b) -> bool:
    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    return (a.samples == b.samples and a.edge_probs == b.edge_probs and a.feature_nodes == b.feature_nodes
            and ((a.features is None and b.features is None) or torch.equal(a.features, b.features)))


def open_requests(e, prefix: str, b: int, context: int, mode: str, budget: int, seed: int) -> dict:
    from modeling.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    bonus = {}
    for i in range(b):
        params = SamplingParams(0.8, 0, 0.95, 1000 + i) if mode == "mixed" and i % 2 else SamplingParams()
        prompt = torch.randint(0, e.vocab_size, (context,), generator=g).tolist()
        bonus[i] = e.prefill(f"{prefix}{i}", prompt, 64, params, "tree", budget).first_token
    return bonus


def measure(engines: dict, b: int, rows: int, mode: str, args, seed: int) -> dict:
    """Per round: the b* requests in one verify_batch on engines['graphs'], the s* one by one;
    other engines (eager) run the same batched sequence for the graphs ≡ eager check."""
    from modeling.acceptance import resolve
    from target_service.engine import VerifyItem

    budget = args.max_tree_budget
    state = {}
    for name, e in engines.items():
        for prefix in ("b", "s") if name == "graphs" else ("b",):
            state[name, prefix] = (open_requests(e, prefix, b, args.context, mode, budget, seed), {})
    g = torch.Generator().manual_seed(seed + 1)
    t_batch, t_solo, ok, eager_ok = [], [], True, True
    e = engines["graphs"]
    for rnd in range(args.rounds + 3):
        trees = [tree(rows, 0, e.vocab_size, g) for _ in range(b)]
        results = {}
        for (name, prefix), (bonus, commit) in state.items():
            items = [VerifyItem(f"{prefix}{i}", [bonus[i]] + t[1:], p, commit.get(i)) for i, (t, p) in enumerate(trees)]
            eng = engines[name]
            sync()
            t0 = time.perf_counter()
            if prefix == "b":
                out = eng.verify_batch(items)
            else:
                out = [eng.verify_batch([it])[0] for it in items]
            dt = (time.perf_counter() - t0) * 1e3
            if rnd >= 3 and name == "graphs":
                (t_batch if prefix == "b" else t_solo).append(dt)
            results[name, prefix] = out
            for i, (it, v) in enumerate(zip(items, out)):
                if isinstance(v, Exception):
                    raise v
                commit[i], bonus[i] = resolve(it.tokens, it.parents, v.samples)
        ok &= all(same(x, y) for x, y in zip(results["graphs", "b"], results["graphs", "s"]))
        if ("eager", "b") in results:
            eager_ok &= all(same(x, y) for x, y in zip(results["graphs", "b"], results["eager", "b"]))
    for (name, prefix) in state:
        engines[name].release([f"{prefix}{i}" for i in range(b)])
    per_forward = min(e._tree_forward.max_trees, e._tree_forward.inputs.R // rows)  # whole trees per forward
    row = dict(mode=mode, batch=b, rows_per_request=rows, total_rows=b * rows, forwards=-(-b // per_forward),
               batch_ms_p50=round(statistics.median(t_batch), 3),
               batch_ms_p90=round(statistics.quantiles(t_batch, n=10)[-1], 3) if len(t_batch) > 1 else None,
               solo_ms_p50=round(statistics.median(t_solo), 3),
               ms_per_request=round(statistics.median(t_batch) / b, 4),
               speedup_vs_solo=round(statistics.median(t_solo) / statistics.median(t_batch), 2),
               same_as_solo=ok)
    if "eager" in engines:
        row["graphs_equal_eager"] = eager_ok
    return row


def paging_cost(cfg) -> list[dict]:
    """GPU µs per ``tree_attention`` launch, paged (shuffled 128-row pages) vs contiguous."""
    import random

    from bench.kernel_tiles import per_launch_ms
    from specdec_kernels.tree_attention import tree_attention
    from modeling.tree import tree_ancestors

    h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out, P = [], 128
    for prefix in (300, 2000):
        for rows in (1, 17, 65):
            n = prefix + rows
            npg = -(-n // P)
            kc = torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            table = list(range(1, 2 * npg + 1))
            random.Random(rows).shuffle(table)
            table = table[:npg]
            s = torch.arange(n)
            prow = (torch.tensor(table)[s // P] * P + s % P).cuda()
            kp = torch.zeros((2 * npg + 1) * P, g, d, device="cuda", dtype=torch.bfloat16)
            vp = torch.zeros_like(kp)
            kp[prow], vp[prow] = kc, vc
            parents = [-1] + [max(0, i - 1 - i % 3) for i in range(1, rows)]
            depths, anc = tree_ancestors(parents)
            anc_d = torch.from_numpy(anc).to("cuda", torch.int64).flatten()
            pos = (prefix + torch.from_numpy(depths)).cuda()
            q = torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16)
            meta = torch.tensor([0, prefix, anc.shape[1]], device="cuda")
            rm_c = torch.tensor([[0, prefix]] * rows, device="cuda")
            rm_p = rm_c.clone()
            pages = torch.tensor(table, device="cuda")
            contiguous = lambda: tree_attention(q, kc, vc, pos, anc_d, meta, rm_c)
            paged = lambda: tree_attention(q, kp, vp, pos, anc_d, meta, rm_p, pages, P)
            row = dict(prefix=prefix, rows=rows, contiguous_us=round(1e3 * per_launch_ms(contiguous), 2),
                       paged_us=round(1e3 * per_launch_ms(paged), 2), same=bool(torch.equal(contiguous(), paged())))
            row["ratio"] = round(row["paged_us"] / row["contiguous_us"], 3)
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=os.environ.get("SPECDEC_GGUF", ""))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--rows", default="1,5,17")
    ap.add_argument("--modes", default="greedy,mixed")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-forward-rows", type=int, default=1089)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    from modeling.defaults import drafter_config
    from modeling.llama import LlamaModel
    from modeling.weights import load_target
    from target_service.engine import TargetEngine

    batches = [int(x) for x in args.batches.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    args.max_tree_budget = max(rows) - 1 or 1
    cfg, state = load_target(args.gguf)
    model = LlamaModel.from_state_dict(cfg, state, torch.device("cuda"), torch.bfloat16)
    taps = drafter_config(cfg).target_layer_ids
    pool = 2 * max(batches) * -(-(args.context + 64 + max(rows)) // 128) * 128 + 1024  # whole 128-row KV pages
    kw = dict(max_batch=args.max_batch, max_forward_rows=args.max_forward_rows)
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    graphs = TargetEngine(model, taps, 8192, pool, args.max_tree_budget, fast="graphs", **kw)
    res = dict(device=torch.cuda.get_device_name(), dtype="bfloat16", torch=torch.__version__, model=cfg.name,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), context=args.context, rounds=args.rounds,
               max_forward_rows=graphs._tree_forward.inputs.R, max_batch=args.max_batch,
               graph_buckets=len(graphs._tree_forward.buckets), capture_s=round(time.perf_counter() - t0, 2),
               engine_mib=round((free0 - torch.cuda.mem_get_info()[0]) / 2**20), rows=[])
    res["paging"] = paging_cost(cfg)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / f"batch_costs_{args.tag}.json").write_text(json.dumps(res, indent=1))
        head = ("| mode | batch | rows/req | total rows | forwards | batch ms p50 | p90 | b solo calls ms | ms/request "
                "| speedup | same as solo | graphs == eager |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        lines = [f"| {r['mode']} | {r['batch']} | {r['rows_per_request']} | {r['total_rows']} | {r['forwards']} | "
                 f"{r['batch_ms_p50']} | {r['batch_ms_p90']} | {r['solo_ms_p50']} | {r['ms_per_request']} | "
                 f"{r['speedup_vs_solo']} | {r['same_as_solo']} | {r.get('graphs_equal_eager', '')} |" for r in res["rows"]]
        paging = ("\n\n## Paged KV in tree_attention (shuffled 128-row pages vs contiguous, GPU µs per launch)\n\n"
                  "| prefix | query rows | contiguous µs | paged µs | paged / contiguous | bitwise same |\n"
                  "|---|---|---|---|---|---|\n"
                  + "\n".join(f"| {r['prefix']} | {r['rows']} | {r['contiguous_us']} | {r['paged_us']} | {r['ratio']} | "
                              f"{r['same']} |" for r in res["paging"]))
        (out / f"batch_costs_{args.tag}.md").write_text(
            f"# Batched verify cost ({res['device']}, {res['model']}, bf16, prefix {args.context}, {res['date']})\n\n"
            + head + "\n".join(lines) + paging + "\n")

    for mode in args.modes.split(","):
        for b in batches:
            for r in rows:
                row = measure({"graphs": graphs}, b, r, mode, args, seed=100 * b + r)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
    eager = TargetEngine(model, taps, 8192, pool, args.max_tree_budget, fast="eager", **kw)
    for b, r in ((16, 5), (4, 17)):
        row = measure({"graphs": graphs, "eager": eager}, b, r, "mixed", argparse.Namespace(**{**vars(args), "rounds": 3}),
                      seed=7 * b + r)
        row["check"] = "graphs vs eager"
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        save()
    print((out / f"batch_costs_{args.tag}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
