"""Plot the drafter's training curves: python -m bench.plot_training → bench/results/drafter_training.png

Reads bench/results/drafter_training.json (written by ``python -m training``): per run and
config, the logged train-loss curve and the held-out evaluations (loss, τ̂).
"""
from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads((RESULTS / "drafter_training.json").read_text())
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(12, 4.5))
    offset = {}
    for run_name, run in runs.items():
        for cfg, r in run["runs"].items():
            start = offset.get(cfg, 0) if run.get("continued_from") else 0
            curve = r["curve"]
            steps = [start + (p[0] if isinstance(p, (list, tuple)) else p["step"]) for p in curve]
            loss = [(p[1] if isinstance(p, (list, tuple)) else p["loss"]) for p in curve]
            label = f"{run_name}:{cfg}"
            ax_loss.plot(steps, loss, lw=0.8, label=label)
            ev = r["evals"]
            ax_loss.scatter([start + e["step"] for e in ev], [e["loss"] for e in ev], s=12, marker="x")
            ax_tau.plot([start + e["step"] for e in ev], [e["tau_hat"] for e in ev], marker="o", label=label)
            offset[cfg] = start + r["steps"]
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE (lines: train, x: held-out)", title="loss", yscale="log")
    ax_tau.set(xlabel="optimizer step", ylabel="held-out τ̂ (chain, T=0)", title="acceptance")
    for ax in (ax_loss, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "drafter_training.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
