"""Plot acceptance length τ against the tree budget, per prompt set and temperature:
python -m bench.plot_acceptance FILE.json [FILE.json ...] [--out F] [--title T]
→ bench/results/acceptance_tau.png (default)

Reads ``bench.acceptance`` result files (``{"meta": {"temperature", ...}, "results": {"set/mode":
{"tau", ...}}}``, mode ``chain`` or ``tree@B``); results of several files for the same (set,
temperature) are merged, so one budget sweep may be split over processes. One line per (set,
temperature): τ at each DDTree budget (log x axis; solid T=0, dashed T>0), the set's chain τ
as a marker at the chain's node count (block size − 1). ``curves`` is the data the plot draws.
"""
from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def curves(files: list[dict]) -> dict[tuple[str, float], dict]:
    """{(set, temperature): {"tree": [(budget, τ), ...] ascending, "chain": (nodes, τ) or None}}
    from parsed ``bench.acceptance`` results. ValueError for an unknown mode key, a key that is
    not "set/mode", or files merged into one curve that measured another drafter or block size."""
    out: dict = {}
    origin: dict = {}
    for f in files:
        t = float(f["meta"].get("temperature", 0.0))
        chain_nodes = int(f["meta"].get("block_size", 8)) - 1
        what = (f["meta"].get("drafter"), chain_nodes + 1)
        for key, r in f["results"].items():
            if "/" not in key:
                raise ValueError(f"result key {key!r} is not 'set/mode' (not a bench.acceptance result file?)")
            name, mode = key.split("/", 1)
            if origin.setdefault((name, t), what) != what:
                raise ValueError(f"{name} T={t:g}: results of drafter/block size {origin[name, t]} and {what} "
                                 "would be merged into one curve")
            c = out.setdefault((name, t), {"tree": {}, "chain": None})
            if mode == "chain":
                c["chain"] = (chain_nodes, r["tau"])
            elif mode.startswith("tree@"):
                c["tree"][int(mode[5:])] = r["tau"]
            else:
                raise ValueError(f"unknown mode {mode!r} in result key {key!r}")
    return {k: {"tree": sorted(v["tree"].items()), "chain": v["chain"]} for k, v in sorted(out.items())}


def main(argv=None) -> None:
    import argparse

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plot_training import save

    ap = argparse.ArgumentParser(prog="python -m bench.plot_acceptance")
    ap.add_argument("files", nargs="+", help="bench.acceptance result files (.json)")
    ap.add_argument("--out", default=str(RESULTS / "acceptance_tau.png"))
    ap.add_argument("--title", default="DFlash acceptance τ vs DDTree budget")
    a = ap.parse_args(argv)
    data = curves([json.loads(pathlib.Path(f).read_text()) for f in a.files])
    if not data:
        ap.error(f"no results in {', '.join(a.files)}")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = {}
    for (name, t), c in data.items():
        colour = colours.setdefault(name, f"C{len(colours)}")
        ls = "-" if t == 0 else "--"
        if c["tree"]:
            ax.plot(*zip(*c["tree"]), ls=ls, marker="o", color=colour, label=f"{name} T={t:g} (DDTree)")
        if c["chain"]:
            ax.scatter(*c["chain"], marker="s" if t == 0 else "D", color=colour, zorder=3,
                       label=f"{name} T={t:g} (chain)")
    ax.set(xscale="log", xlabel="tree budget (draft nodes; chain: block size − 1)", ylabel="τ (committed tokens / verify)",
           title=a.title)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
    save(fig, (ax,), a.out, ncol=2)


if __name__ == "__main__":
    main()
