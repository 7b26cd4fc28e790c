"""Batch invariance of the target engine, in process: does a greedy request batched with others
(``TargetEngine.verify_batch`` over the paged KV pool, graphs, prefills and releases of other
requests interleaving, threads through a real ``serving.batcher.StepBatcher``) produce exactly
the tokens it produces alone? (issue 14; the H200 concurrency bench saw batched outputs differ
from c=1 in a few % of requests.)

Each prompt's reference is its solo greedy autoregressive run (verify batches of one, after the
previous request is released). Every scenario then runs the same prompts and reports, per
scenario, how many requests match their reference token for token, the first mismatching step,
and — from a probe on the verify forward — the largest |Δlogit| of any tree's root row against
the solo row at the same position (row invariance means 0 exactly: ``rows bitwise`` counts the
root rows equal bit for bit), also at the first mismatch.

Scenarios: lock-step AR batches of 16 / 64 (no threads); staggered joins (prefills between
batches, releases mid-way, pages reused by new requests); threads through a StepBatcher like the
target servicer (each thread its own requests: prefill in its thread, verify via the batcher),
AR and trees / chains built from the reference continuation (so paths of up to the budget are
accepted: commits longer than MAX_MOVES go through the host), with random cancellations. Every
8th prompt is long (> one prefill chunk, so its prefill runs several forwards).

``--unfixed`` disables TreeInputs' wait for the previous host → device copy (commit 9eb3792):
the suspected cause of the H200 mismatches, for an A/B in the same lease.

GPU (H200, after ``bash scripts/device_run.sh K``):
  PYTHONPATH=/tmp/site:$PWD python3 -m bench.batch_invariance --tag h200
CPU try (tiny random model, Triton interpreter): TRITON_INTERPRET=1 python3 -m bench.batch_invariance
  --tiny --fast eager --prompts 8 --tokens 6 --scenarios lock16,threads_ar16
Writes $OUT/batch_invariance_<tag>.json (or bench/results/ without $OUT)."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import threading
import time

import torch

from modeling.acceptance import resolve
from modeling.sampling import SamplingParams
from target_service.engine import VerifyItem

GREEDY = SamplingParams()


class Probe:
    """Wraps the engine's verify forward: after each forward, each tree whose request is live
    gets its root row's logits compared with (or, solo, stored as) the solo row at the same
    position. Device work only, no host sync."""

    def __init__(self, engine, keep_logits: bool):
        self.engine, self.keep = engine, keep_logits
        self.owner: dict[str, tuple[int, int]] = {}  # rid → (prompt index, prompt length)
        self.solo: dict[tuple[int, int], torch.Tensor] = {}
        self.deltas: list[tuple[str, int, torch.Tensor]] = []
        self.storing = False
        fwd = engine._tree_forward
        if fwd is None or not keep_logits:
            return
        orig = fwd._run

        def run(trees):
            logits, feats = orig(trees)
            owners = {id(r.cache.base): rid for rid, r in list(engine._requests.items())}
            for (r0, _), t in zip(fwd.spans, trees):
                rid = owners.get(id(t.base))
                if rid is None or rid not in self.owner:
                    continue  # a prefill chunk
                pi, plen = self.owner[rid]
                step = t.L - plen
                row = logits[r0].float()
                if self.storing:
                    self.solo[pi, step] = row.clone()
                elif (pi, step) in self.solo:
                    self.deltas.append((rid, step, (row - self.solo[pi, step]).abs().max()))
            return logits, feats

        fwd._run = run

    def take(self) -> list[tuple[str, int, float]]:
        d, self.deltas = self.deltas, []
        if not d:
            return []
        vals = torch.stack([x[2] for x in d]).tolist()
        return [(rid, step, v) for (rid, step, _), v in zip(d, vals)]


class Req:
    """One greedy request's loop: open (prefill), per round a tree (AR: the root alone; chain /
    tree: the reference continuation as a path, a few drafts corrupted, tree: random siblings),
    take the result (accepted path from the samples), until ``tokens`` are out."""

    def __init__(self, engine, probe, rid, pi, prompt, ref, tokens, mode, budget, seed):
        self.engine, self.rid, self.pi, self.prompt, self.ref, self.T = engine, rid, pi, prompt, ref, tokens
        self.mode, self.budget, self.rng = mode, budget, random.Random(seed)
        self.out: list[int] = []
        self.commit = None
        self.cancelled = False
        probe.owner[rid] = (pi, len(prompt))

    def open(self, wait=None):
        mode = "autoregressive" if self.mode == "ar" else self.mode
        pf = self.engine.prefill(self.rid, self.prompt, self.T + self.budget + 1, GREEDY, mode, self.budget,
                                 wait_seconds=wait)
        self.out = [pf.first_token]

    @property
    def done(self) -> bool:
        return len(self.out) >= self.T

    def item(self) -> VerifyItem:
        bonus, p, V = self.out[-1], len(self.out) - 1, self.engine.vocab_size
        tokens, parents, seen = [bonus], [-1], set()
        if self.budget:
            k = self.budget if self.mode == "chain" or self.rng.random() < 0.5 else self.rng.randint(0, self.budget)
            for j in range(k):
                t = self.ref[p + 1 + j] if p + 1 + j < len(self.ref) else self.rng.randrange(V)
                if self.rng.random() < 0.04:
                    t = self.rng.randrange(V)
                seen.add((len(tokens) - 1, t))
                tokens.append(t)
                parents.append(len(tokens) - 2)
            while self.mode == "tree" and len(tokens) < self.budget + 1:
                par, t = self.rng.randrange(len(tokens)), self.rng.randrange(V)
                if (par, t) not in seen:
                    seen.add((par, t))
                    tokens.append(t)
                    parents.append(par)
        self._tree = (tokens, parents)
        return VerifyItem(self.rid, tokens, parents, self.commit)

    def take(self, res) -> None:
        if isinstance(res, Exception):
            raise res
        tokens, parents = self._tree
        rows, _ = resolve(tokens, parents, res.samples)
        self.out += [res.samples[r] for r in rows]
        self.commit = rows

    def release(self):
        self.engine.release([self.rid])


def load(args):
    """(engine, prompts as token lists)."""
    from modeling.defaults import drafter_config
    from target_service.engine import TargetEngine

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        from modeling.config import LlamaConfig
        from modeling.llama import LlamaModel

        cfg = LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        torch.manual_seed(0)
        model = LlamaModel(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0)
        model = model.to(device, torch.float32 if device.type == "cpu" else torch.bfloat16).eval()
        taps, rng = (0, 2), random.Random(0)
        prompts = [[rng.randrange(160) for _ in range(rng.randint(3, 30))] for _ in range(args.prompts)]
        engine = TargetEngine(model, taps, 1024, 16384, 32, fast=args.fast, kv_page_rows=16)
    else:
        from bench.throughput import prompts as bench_prompts
        from modeling.model_files import default_gguf_path
        from modeling.targets import load_target_model
        from modeling.tokenizer import TextTokenizer

        model = load_target_model(args.model or None, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        taps = drafter_config(model.cfg, None).target_layer_ids
        tok = TextTokenizer.from_file(args.model or default_gguf_path())
        prompts = []
        for p in bench_prompts(args.prompts):
            text = p["prompt"] if "prompt" in p else tok.apply_chat_template(p["messages"])
            prompts.append(tok.encode(text))
        engine = TargetEngine(model, taps, model.cfg.max_position_embeddings, args.kv_pool_tokens, 512,
                              fast=args.fast, prefill_chunk=512)
    chunk = min(engine.prefill_chunk, engine.max_tree_budget + 1)
    for i in range(7, len(prompts), 8):  # long prompts: prefills of several forwards
        long = []
        for j in range(len(prompts)):
            long += prompts[(i + j) % len(prompts)]
            if len(long) > 2 * chunk + 10:
                break
        prompts[i] = long[:2 * chunk + 10]
    if args.unfixed and engine._tree_forward is not None:
        engine._tree_forward.inputs._copied = None
    return engine, prompts


def solo_refs(engine, probe, prompts, T):
    refs = []
    probe.storing = True
    for pi, prompt in enumerate(prompts):
        r = Req(engine, probe, f"solo-{pi}", pi, prompt, [], T, "ar", 0, pi)
        r.open()
        while not r.done:
            r.take(engine.verify_batch([r.item()])[0])
        r.release()
        refs.append(r.out[:T])
    probe.storing = False
    probe.take()
    return refs


def lockstep(engine, probe, prompts, refs, T, c, mode="ar", budget=0, tag=""):
    reqs = []
    for b0 in range(0, len(prompts), c):
        group = [Req(engine, probe, f"{tag}-{pi}", pi, prompts[pi], refs[pi], T, mode, budget, pi)
                 for pi in range(b0, min(len(prompts), b0 + c))]
        for r in group:
            r.open()
        live = list(group)
        while live:
            for r, x in zip(live, engine.verify_batch([r.item() for r in live])):
                r.take(x)
            for r in [r for r in live if r.done]:
                r.release()
                live.remove(r)
        reqs += group
    return reqs


def staggered(engine, probe, prompts, refs, T, seed, mode="ar", budget=0, tag=""):
    """Requests join between batches (prefills of 0-3 new ones before each batch), some are
    released mid-way (their pages go to later joiners) and rerun later under a new id."""
    rng = random.Random(seed)
    queue = list(range(len(prompts)))
    live, reqs, n = [], [], 0
    while queue or live:
        for _ in range(rng.randint(0 if live else 1, 3)):
            if queue:
                pi = queue.pop(0)
                n += 1
                r = Req(engine, probe, f"{tag}-{pi}-{n}", pi, prompts[pi], refs[pi], T, mode, budget, n)
                r.open()
                live.append(r)
                reqs.append(r)
        if rng.random() < 0.08 and len(live) > 1:  # a cancellation mid-way
            r = live.pop(rng.randrange(len(live)))
            r.release()
            r.cancelled = True
            queue.append(r.pi)
        if not live:
            continue
        for r, x in zip(live, engine.verify_batch([r.item() for r in live])):
            r.take(x)
        for r in [r for r in live if r.done]:
            r.release()
            live.remove(r)
    return reqs


def threaded(engine, probe, prompts, refs, T, c, seed, mode="ar", budget=0, cancel=0.0, tag=""):
    """c threads, each running requests one after another from a shared queue like a target
    Session stream: prefill in its own thread (admission wait 30 s), each round's verify through
    one StepBatcher (expected = live requests, as the servicer); a request may be cancelled
    mid-way (released by its thread; the prompt reruns later)."""
    from serving.batcher import StepBatcher

    batcher = StepBatcher(engine.verify_batch, max_batch=64, expected=lambda: engine.live_requests)
    queue, lock, reqs, errors = list(range(len(prompts))), threading.Lock(), [], []
    count = [0]

    def worker(k):
        rng = random.Random(seed * 1000 + k)
        while True:
            with lock:
                if not queue:
                    return
                pi = queue.pop(0)
                count[0] += 1
                r = Req(engine, probe, f"{tag}-{pi}-{count[0]}", pi, prompts[pi], refs[pi], T, mode, budget,
                        count[0])
                reqs.append(r)
            try:
                r.open(wait=30.0)
                stop = rng.randint(1, T) if rng.random() < cancel else None
                while not r.done:
                    if stop is not None and len(r.out) >= stop:
                        r.cancelled = True
                        with lock:
                            queue.append(pi)
                        break
                    r.take(batcher.submit(r.item()))
                    time.sleep(rng.random() * 2e-4)  # the round trip to the orchestrator
            except Exception as e:  # noqa: BLE001 — reported, not hidden
                errors.append(f"{r.rid}: {type(e).__name__}: {e}")
            finally:
                r.release()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}")
    return reqs, batcher.items / max(1, batcher.batches)


SCENARIOS = {
    "lock16": lambda e, p, P, R, T: lockstep(e, p, P, R, T, 16, tag="lock16"),
    "lock64": lambda e, p, P, R, T: lockstep(e, p, P, R, T, 64, tag="lock64"),
    "lock64_tree16": lambda e, p, P, R, T: lockstep(e, p, P, R, T, 64, "tree", 16, tag="lock64_tree16"),
    "lock16_tree32": lambda e, p, P, R, T: lockstep(e, p, P, R, T, 16, "tree", 32, tag="lock16_tree32"),
    "stagger_ar": lambda e, p, P, R, T: staggered(e, p, P, R, T, 1, tag="stagger_ar"),
    "stagger_tree16": lambda e, p, P, R, T: staggered(e, p, P, R, T, 2, "tree", 16, tag="stagger_tree16"),
    "threads_ar16": lambda e, p, P, R, T: threaded(e, p, P, R, T, 16, 3, tag="threads_ar16"),
    "threads_ar64": lambda e, p, P, R, T: threaded(e, p, P, R, T, 64, 4, cancel=0.2, tag="threads_ar64"),
    "threads_chain16": lambda e, p, P, R, T: threaded(e, p, P, R, T, 16, 5, "chain", 15, tag="threads_chain16"),
    "threads_tree4_64": lambda e, p, P, R, T: threaded(e, p, P, R, T, 64, 6, "tree", 4, 0.2, tag="threads_tree4_64"),
    "threads_tree16_64": lambda e, p, P, R, T: threaded(e, p, P, R, T, 64, 7, "tree", 16, 0.2,
                                                       tag="threads_tree16_64"),
    "threads_tree32_16": lambda e, p, P, R, T: threaded(e, p, P, R, T, 16, 8, "tree", 32, tag="threads_tree32_16"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF / HF dir (default: SPECDEC_GGUF or the embedded default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fast", default="graphs", choices=["graphs", "eager"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kv-pool-tokens", type=int, default=65536)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (CPU tries)")
    ap.add_argument("--no-logits", action="store_true", help="skip the logit probe (tokens only)")
    ap.add_argument("--unfixed", action="store_true", help="disable TreeInputs' copy wait (A/B of 9eb3792)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":  # as tests/kernels/conftest.py: numpy >= 2.4
        from triton.runtime import interpreter  # refuses int() of the 1-element arrays Triton 3.6 indexes with

        orig = interpreter._patch_lang_tensor

        def patch(tensor, scope):
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patch
    t0 = time.perf_counter()
    engine, prompts = load(args)
    probe = Probe(engine, not args.no_logits)
    T = args.tokens
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {len(prompts)} prompts "
          f"(lengths {min(map(len, prompts))}-{max(map(len, prompts))}), {T} tokens, fast={engine.fast}, "
          f"unfixed={args.unfixed}", flush=True)
    t1 = time.perf_counter()
    refs = solo_refs(engine, probe, prompts, T)
    print(f"solo references in {time.perf_counter() - t1:.1f} s", flush=True)
    rows = []
    print(f"{'scenario':<20} {'match':>9} {'cancel':>6} {'batch':>6} {'first':>6} {'rows bitwise':>14} "
          f"{'max|dlogit|':>11} {'at first':>9} {'s':>6}")
    for name in args.scenarios.split(","):
        for rep in range(args.repeat):
            t1 = time.perf_counter()
            out = SCENARIOS[name](engine, probe, prompts, refs, T)
            reqs, mean_batch = out if isinstance(out, tuple) else (out, None)
            deltas = probe.take()
            bad, compared, cancelled = [], 0, 0
            for r in reqs:
                n = len(r.out) if r.cancelled else T
                cancelled += r.cancelled
                if r.cancelled and n == 0:
                    continue
                compared += 1
                got, want = r.out[:n], refs[r.pi][:n]
                if got != want:
                    bad.append((r.rid, r.pi, next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)))
            first = min((s for _, _, s in bad), default=None)
            at_first = None
            if bad:
                rid, _, s = min(bad, key=lambda x: x[2])
                at = [v for d_rid, step, v in deltas if d_rid == rid and step == s - 1]
                at_first = max(at) if at else None
            dmax = max((v for *_, v in deltas), default=None)
            bitwise = sum(v == 0 for *_, v in deltas)
            rows.append(dict(scenario=name, repeat=rep, requests=compared, identical=compared - len(bad),
                             cancelled=cancelled, mean_batch=mean_batch, first_mismatch_step=first,
                             mismatches=bad[:20], root_rows=len(deltas), rows_bitwise=bitwise,
                             max_dlogit=dmax, dlogit_at_first_mismatch=at_first,
                             seconds=round(time.perf_counter() - t1, 2)))
            fmt = lambda v: "-" if v is None else f"{v:.3g}"
            print(f"{name:<20} {compared - len(bad):>4}/{compared:<4} {cancelled:>6} {fmt(mean_batch):>6} "
                  f"{fmt(first):>6} {bitwise:>6}/{len(deltas):<7} {fmt(dmax):>11} {fmt(at_first):>9} "
                  f"{time.perf_counter() - t1:>6.1f}", flush=True)
            if engine.reserved_tokens or engine.live_requests:
                print(f"  LEAK: {engine.live_requests} live, {engine.reserved_tokens} rows reserved")
    res = dict(tag=args.tag, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               fast=engine.fast, unfixed=args.unfixed, prompts=len(prompts), tokens=T,
               prompt_lengths=[len(p) for p in prompts], scenarios=rows,
               seconds=round(time.perf_counter() - t0, 1))
    out_dir = pathlib.Path(os.environ.get("OUT") or pathlib.Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"batch_invariance_{args.tag or 'run'}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
