"""Plot the drafter's training curves: python -m bench.plot_training [--json F] [--out F]
→ bench/results/drafter_training.png

Reads bench/results/drafter_training.json (written by ``python -m training``; or --json, e.g.
drafter_training_session3.json): per run and config, the logged train-loss curve and the
held-out evaluations (loss, τ̂; dashed: τ̂ on anchors in the first 64 response tokens, where
recorded). An optional top-level ``"_baseline": {"label", "tau_hat"}`` is drawn as a
horizontal line on the τ̂ panel.
"""
from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv=None) -> None:
    import argparse

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(prog="python -m bench.plot_training")
    ap.add_argument("--json", default=str(RESULTS / "drafter_training.json"))
    ap.add_argument("--out", default=str(RESULTS / "drafter_training.png"))
    a = ap.parse_args(argv)
    runs = json.loads(pathlib.Path(a.json).read_text())
    base = runs.pop("_baseline", None)
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(12, 4.5))
    offset = {}
    for run_name, run in runs.items():
        for cfg, r in run.get("runs", {}).items():  # entries without runs (generation, acceptance records) are not curves
            start = offset.get(cfg, 0) if run.get("continued_from") else 0
            curve = r["curve"]
            steps = [start + (p[0] if isinstance(p, (list, tuple)) else p["step"]) for p in curve]
            loss = [(p[1] if isinstance(p, (list, tuple)) else p["loss"]) for p in curve]
            label = f"{run_name}:{cfg}"
            ax_loss.plot(steps, loss, lw=0.8, label=label)
            ev = r["evals"]
            ax_loss.scatter([start + e["step"] for e in ev], [e["loss"] for e in ev], s=12, marker="x")
            line, = ax_tau.plot([start + e["step"] for e in ev], [e["tau_hat"] for e in ev], marker="o", label=label)
            early = [e for e in ev if "tau_hat_first64" in e]
            if early:  # anchors in the first 64 response tokens (the bench's regime; plans/0008)
                ax_tau.plot([start + e["step"] for e in early], [e["tau_hat_first64"] for e in early], ls="--",
                            marker=".", color=line.get_color(), label=f"{label} (first 64 tokens)")
            offset[cfg] = start + r["steps"]
    if base:
        ax_tau.axhline(base["tau_hat"], color="grey", ls="--", lw=1, label=base["label"])
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE (lines: train, x: held-out)", title="loss", yscale="log")
    ax_tau.set(xlabel="optimizer step", ylabel="held-out τ̂ (chain, T=0)", title="acceptance")
    save(fig, (ax_loss, ax_tau), a.out)


def save(fig, axes, out, ncol: int = 1) -> pathlib.Path:
    """Grid and legend on each of ``axes``, then the figure to ``out`` (PNG, 110 dpi); prints and returns the path."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=ncol)
    fig.tight_layout()
    out = pathlib.Path(out)
    fig.savefig(out, dpi=110)
    print(out)
    return out


if __name__ == "__main__":
    main()
