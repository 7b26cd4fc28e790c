"""Fit the adaptive budget's cost model (``orchestrator.budget.CostModel``) to a
``bench.concurrency`` run through the real services, so that its step time is what a step costs
there and not only on the GPU.

python -m bench.cost_table --fit-concurrency bench/results/concurrency_h200.json[,more runs …] \\
    [--out bench/results/cost_model_h200.json]   (also writes the .md next to it; several runs: their cells pooled)

The GPU parts stay measured in-process: ``verify_ms`` = the one-request verify forward
(bench/results/gpu_fast_path_h200.json, "graphs"), the draft calls = the batched drafter at
batch 1 (bench/results/draft_batch_costs_h200.json; budgets it lacks from the fast-path
table), ``draft_ms_per_request`` = the mean of its per-request fits over the tree shapes. What a
step costs beyond them is fitted: through the services the orchestrator (one Python process)
spends serial host time on every round, and every round waits on the wire. With c identical
requests of shape s one step (one round of each) is modelled as

    T(s, c) = step_ms + [s drafts]·(spec_step_ms + draft_call(s) + draft_ms_per_request·(c − 1))
              + verify(c·rows(s)) + c·(host_ms + [s drafts]·spec_host_ms + host_ms_per_row·rows(s))

(``CostModel.step``), and the run measured T = c·τ / tok/s per cell. T is linear in the five
fitted terms, so they come from a least-squares fit of the relative error of T over the fixed
cells (autoregressive, chain, tree@N; every c), every term ≥ 0 (the best of all subsets of
terms whose unconstrained solution is non-negative). Relative error of T = relative error of
the predicted tok/s to first order.

The model's ``fit_error`` = the rms |log predicted ÷ measured tok/s| over the fixed cells (the planner
explores unmeasured shapes within it: ``BudgetPlanner``'s ``trust``).

Checks printed and written: measured vs predicted tok/s per cell (the adaptive cells priced
as the measured mix of round shapes), and the plan ``plan_step`` makes for c uniform requests
at the run's c=1 acceptance (the reference curve) against the measured best fixed shape.
"""
from __future__ import annotations

import itertools
import json
import math
import pathlib
import re
from dataclasses import replace

import numpy as np

from orchestrator.adaptive import load_cost_model
from orchestrator.budget import ONE_TOKEN, AcceptanceEstimate, CostModel, Shape, chain, plan_step, tree

TERMS = ("step_ms", "spec_step_ms", "host_ms", "spec_host_ms", "host_ms_per_row")
FAST_PATH = "bench/results/gpu_fast_path_h200.json"
DRAFT_BATCH = "bench/results/draft_batch_costs_h200.json"


def gpu_tables(fast_path: dict, draft_batch: dict) -> CostModel:
    """The in-process GPU parts of the model, the fitted terms zero."""
    verify = tuple((r["rows"], r["graphs"]) for r in fast_path["verify_ms"])
    batch1 = {r["shape"]: r["batch_ms"] for r in draft_batch["rows"] if r["batch"] == 1}
    draft = {r["budget"]: r["graphs"] for r in fast_path["draft_ms"] if r["mode"] == "tree"}
    draft.update({int(k[5:]): ms for k, ms in batch1.items() if k.startswith("tree@")})
    per_request = [f["per_request_ms"] for k, f in draft_batch["fit"].items() if k.startswith("tree@")]
    return CostModel(verify_ms=verify, chain_draft_ms=batch1["chain"], draft_ms=tuple(sorted(draft.items())),
                     draft_ms_per_request=round(sum(per_request) / len(per_request), 4),
                     block_size=draft_batch["block_size"])


def shape_of(config: str, block_size: int) -> Shape | None:
    """The fixed shape a bench.concurrency config runs (None: adaptive)."""
    if config == "autoregressive":
        return ONE_TOKEN
    if config == "chain":
        return chain(block_size)
    if m := re.fullmatch(r"tree@(\d+)", config):
        return tree(int(m[1]))
    return None


def shape_mix(text: str, block_size: int, c: int) -> list[Shape]:
    """c shapes in the proportions of an ``orchestrator_shapes`` cell ("tree@4 47%, one-token 46%")."""
    parts = [(p.rsplit(" ", 1)[0], float(p.rsplit(" ", 1)[1].rstrip("%"))) for p in text.split(", ") if p]
    parts = [(ONE_TOKEN if n == "one-token" else shape_of(n.replace("chain@", "chain") if n.startswith("chain@")
              else n, block_size), w) for n, w in parts]
    total = sum(w for _, w in parts) or 1.0
    exact = [(s, c * w / total) for s, w in parts]
    counts = {s: int(x) for s, x in exact}
    for s, x in sorted(exact, key=lambda t: t[1] - int(t[1]), reverse=True)[:c - sum(counts.values())]:
        counts[s] += 1  # largest remainders
    return [s for s, n in counts.items() for _ in range(n)]


def coefficients(shape: Shape, c: int) -> list[float]:
    """d T(shape, c) / d term, in ``TERMS`` order."""
    return [1.0, float(shape.drafts), float(c), float(c * shape.drafts), float(c * shape.rows)]


def fit(cells: list[tuple[Shape, int, float]], base: CostModel) -> dict[str, float]:
    """Non-negative least squares of (T_model − T) / T over ``cells`` = (shape, c, measured T ms)."""
    a = np.array([[x / t for x in coefficients(s, c)] for s, c, t in cells])
    b = np.array([(t - base.step([s] * c)) / t for s, c, t in cells])
    best, best_err = np.zeros(len(TERMS)), float(np.sum(b ** 2))
    for k in range(1, len(TERMS) + 1):
        for cols in itertools.combinations(range(len(TERMS)), k):
            sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            err = float(np.sum((a[:, cols] @ sol - b) ** 2))
            if (sol >= 0).all() and err < best_err:
                best, best_err = np.zeros(len(TERMS)), err
                best[list(cols)] = sol
    return {name: round(float(v), 4) for name, v in zip(TERMS, best)}


def uniform_plan(cost: CostModel, reference: dict[Shape, float], c: int, cap: int):
    """``plan_step`` for c requests at the reference level, adaptive with tree budget cap ``cap``."""
    options = [ONE_TOKEN] + [s for s in reference if s.mode is tree(1).mode and s.nodes <= cap]
    gains = AcceptanceEstimate(reference).gains(options)
    return plan_step([gains] * c, cost)


def main(path: str, out: str) -> int:
    """Fit to the run(s) in ``path`` (comma-separated files: their cells pooled, e.g. several leases
    of one configuration, whose run-to-run spread a single run's fit would take for the model's);
    write the model to ``out`` and its report next to it."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in path.split(",")]
    run = runs[0]
    base = gpu_tables(json.loads(pathlib.Path(FAST_PATH).read_text()), json.loads(pathlib.Path(DRAFT_BATCH).read_text()))
    block = base.block_size
    rows = [r for each in runs for r in each["rows"]]
    fixed = [(shape_of(r["config"], block), r) for r in rows if shape_of(r["config"], block) is not None]
    terms = fit([(s, r["c"], 1000 * r["c"] * r["tau"] / r["tok_s"]) for s, r in fixed], base)
    cost = replace(base, **terms)

    def predict(shapes: list[Shape], tau: float) -> float:
        return 1000 * len(shapes) * tau / cost.step(shapes)

    # the reference curve: τ − 1 of the fixed shapes at c=1; budgets past the run's scaled by the
    # fast-path table's bench-prompt τ (an older drafter: its ratio to tree@64, not its level)
    at_c1: dict[Shape, list[float]] = {}
    for s, r in fixed:
        if r["c"] == 1 and s.drafts:
            at_c1.setdefault(s, []).append(r["tau"] - 1.0)
    reference = {s: round(sum(v) / len(v), 4) for s, v in at_c1.items()}
    older = {r["budget"]: r["tau"] - 1.0 for r in json.loads(pathlib.Path(FAST_PATH).read_text())["greedy"]
             if r["mode"] == "tree" and r.get("prompts") == "bench"}
    top = max(s.nodes for s in reference if s.mode is tree(1).mode)
    for b, _ in base.draft_ms:
        if b > top and b in older and top in older:
            reference[tree(b)] = round(reference[tree(top)] * older[b] / older[top], 3)

    fitted_to = "; ".join(f"{p} ({r['meta'].get('note', '')}, {r['meta'].get('date', '')})"
                          for p, r in zip(path.split(","), runs))
    lines = [f"# Cost model fitted to {fitted_to}", "",
             "Fitted terms (ms): " + ", ".join(f"{k} {v}" for k, v in terms.items())
             + f"; GPU parts in-process: verify_ms {FAST_PATH} (graphs), draft calls {DRAFT_BATCH} (batch 1), "
             f"draft_ms_per_request {base.draft_ms_per_request}.", "",
             "| config | c | measured tok/s | τ | predicted tok/s | error |", "|---|---|---|---|---|---|"]
    table = []
    for r in rows:
        s = shape_of(r["config"], block)
        shapes = [s] * r["c"] if s is not None else shape_mix(r.get("orchestrator_shapes", ""), block, r["c"])
        if not shapes:
            continue
        p = predict(shapes, r["tau"])
        name = r["config"] if s is not None else f"{r['config']} (as its measured mix)"
        table.append(dict(config=name, c=r["c"], tok_s=r["tok_s"], tau=r["tau"], predicted=round(p, 1)))
        lines.append(f"| {name} | {r['c']} | {r['tok_s']} | {r['tau']} | {p:.1f} | {p / r['tok_s'] - 1:+.1%} |")
    fixed_errors = [math.log(t["predicted"] / t["tok_s"]) for t in table if not t["config"].endswith("measured mix)")]
    fit_error = round(math.sqrt(sum(e * e for e in fixed_errors) / len(fixed_errors)), 3)
    cost = replace(cost, fit_error=fit_error)
    lines[2] += f" Fit error (rms |log predicted ÷ measured| over the fixed cells): {fit_error}."
    cap = run["meta"].get("adaptive_cap", 64)
    lines += ["", f"The plan for c uniform requests at the c=1 acceptance (tree cap {cap}) vs the measured fixed "
              "shapes:", "", "| c | model's plan | modelled tok/s | measured best fixed | measured tok/s of the plan's "
              "shape | ÷ best |", "|---|---|---|---|---|---|"]
    picks = []
    for c in sorted({r["c"] for _, r in fixed}):
        cells_at = {}
        for s, r in fixed:
            if r["c"] == c:
                cells_at.setdefault(s, []).append(r["tok_s"])
        measured = {s: round(sum(v) / len(v), 1) for s, v in cells_at.items()}  # (the mean over runs and repeats)
        best = max(measured, key=measured.get)
        plan = uniform_plan(cost, reference, c, cap)
        counts = {str(s): plan.shapes.count(s) for s in sorted(set(plan.shapes))}
        got = sum(measured.get(s, float("nan")) for s in plan.shapes) / c
        picks.append(dict(c=c, plan=counts, modelled_tok_s=round(1000 * plan.tokens_per_ms, 1), best=str(best),
                          best_tok_s=measured[best], plan_measured_tok_s=round(got, 1)))
        lines.append(f"| {c} | {', '.join(f'{k} ×{n}' for k, n in counts.items())} | {1000 * plan.tokens_per_ms:.0f} "
                     f"| {best} {measured[best]} | {got:.1f} | {got / measured[best]:.3f} |")
    print("\n".join(lines))
    model = dict(verify_ms=[list(p) for p in cost.verify_ms], chain_draft_ms=cost.chain_draft_ms,
                 draft_ms=[list(p) for p in cost.draft_ms], draft_ms_per_request=cost.draft_ms_per_request,
                 **terms, block_size=block, fit_error=fit_error,
                 measured=dict(fitted_to=path, run=run["meta"] if len(runs) == 1 else [r["meta"] for r in runs],
                               gpu_parts=[FAST_PATH, DRAFT_BATCH],
                               reference_accepted={str(s): v for s, v in reference.items()},
                               cells=table, uniform_plans=picks))
    dest = pathlib.Path(out)
    dest.write_text(json.dumps(model, indent=1) + "\n")
    dest.with_suffix(".md").write_text("\n".join(lines) + "\n")
    assert load_cost_model(str(dest)) == cost  # what --cost-model will load
    print("wrote", dest, "and", dest.with_suffix(".md"))
    return 0
