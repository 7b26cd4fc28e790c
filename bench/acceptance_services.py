"""Acceptance length τ of several drafters through the real services, same prompts, same run.

  python -m bench.acceptance_services --drafters shipped=checkpoints/dflash-smollm2-135m,new=DIR \\
      [--n 8] [--max-new 64] [--modes chain,tree@64] [--temperatures 0,1] \\
      [--worker-flags "--device cuda --dtype bfloat16"] [--gguf F] [--seed 0] [--where TEXT] [--log-dir DIR] \\
      [--out bench/results/acceptance_services]

One target service (its taps from the first drafter; every drafter must tap the same layers),
then per drafter one draft service (``--drafter DIR``) and one orchestrator, all on loopback
over gRPC. Each request runs alone (c = 1): the first n HumanEval prompts (raw text) and
MT-Bench first turns (chat), ``max_new`` tokens with ignore_eos; at T > 0 request i samples with
seed ``seed`` + i, so every drafter serves the same requests. τ per request = the response's
``stats.mean_accept_length`` (committed tokens per verify); the table shows the mean over
requests (DFlash's definition, as bench.acceptance). At T = 0 every speculative output is
checked against the autoregressive output of the same prompt (token ids): the run fails (exit
1) if any differs. Writes ``--out``.json / .md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from bench.provenance import code_identity
from deploy.local import ROOT, free_port

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


SET_TEXT = {"humaneval": "first HumanEval raw prompts", "mtbench": "MT-Bench first turns",
            "stdlib": "first stdlib function prompts, raw"}


def requests(n: int, sets: tuple[str, ...] = ("humaneval", "mtbench")) -> dict[str, list[dict]]:
    """{set: [client kwargs]} for ``sets``: the first n HumanEval prompts (raw), MT-Bench first
    turns (chat), stdlib function prompts (raw; bench.datasets)."""
    from bench.datasets import humaneval_prompts, mtbench_questions, stdlib_prompts

    every = {"humaneval": lambda: [dict(prompt=p) for p in humaneval_prompts(n)],
             "mtbench": lambda: [dict(messages=[{"role": "user", "content": q}]) for q in mtbench_questions(n)],
             "stdlib": lambda: [dict(prompt=p) for p in stdlib_prompts(n)]}
    unknown = set(sets) - set(every)
    if unknown:
        raise ValueError(f"unknown prompt sets {sorted(unknown)} (known: {', '.join(every)})")
    return {s: every[s]() for s in sets}


def start(drafters: dict[str, str], worker_flags: list[str], log_dir: str, gguf: str = ""):
    """Start the target, one draft service + orchestrator per drafter (``gguf``: the target
    model for every process, as ``SPECDEC_TARGET_MODEL``; empty = the embedded default).
    Returns (procs, {drafter name: orchestrator address})."""
    from specdec_client import probe

    env = {"GRPC_VERBOSITY": "ERROR", **os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **({"SPECDEC_TARGET_MODEL": gguf} if gguf else {})}
    os.makedirs(log_dir, exist_ok=True)
    procs, addrs = {}, {}

    def spawn(name, args):
        out = open(os.path.join(log_dir, f"{name}.log"), "w")
        procs[name] = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=out)

    tport = free_port()
    spawn("target", ["-m", "target_service", "--port", str(tport), "--drafter", next(iter(drafters.values())),
                     *worker_flags])
    for name, d in drafters.items():
        dport, oport = free_port(), free_port()
        spawn(f"draft-{name}", ["-m", "draft_service", "--port", str(dport), "--drafter", d, *worker_flags])
        spawn(f"orchestrator-{name}", ["-m", "orchestrator", "--port", str(oport), "--target", f"127.0.0.1:{tport}",
                                       "--draft", f"127.0.0.1:{dport}"])
        addrs[name] = f"127.0.0.1:{oport}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        dead = [f"{k} exited with {p.returncode}" for k, p in procs.items() if p.poll() is not None]
        if dead:
            stop(procs)
            raise RuntimeError(f"{'; '.join(dead)}; logs in {log_dir}")
        if all(probe.check(a, "specdec.v1.Orchestrator") == "SERVING" for a in addrs.values()):
            return procs, addrs
        time.sleep(0.3)
    stop(procs)
    raise TimeoutError("services not SERVING after 600 s")


def stop(procs) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_for_drafter(client, tree_budget: int, timeout: float = 600.0) -> None:
    """Warm up one orchestrator until a tree request runs with no one-token fallback round.

    The orchestrator serves as soon as the target does and falls back to one-token rounds while
    its draft service is still loading (capturing CUDA graphs takes ~25 s on the H200), so
    SERVING alone does not mean speculation is on. Raises TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.generate(prompt="def f(x):", max_tokens=16, mode="tree", tree_budget=tree_budget)
        if not r.stats.fallback_rounds:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the drafter was still not used after {timeout:.0f} s "
                               f"({r.stats.fallback_rounds} fallback rounds in the last warm-up request)")
        time.sleep(0.5)


def run(drafters: dict[str, str], n: int, max_new: int, modes: list[tuple[str, int]], temperatures: list[float],
        seed: int, worker_flags: list[str], log_dir: str, gguf: str = "", log=print, save=None,
        prompt_sets: tuple[str, ...] = ("humaneval", "mtbench")) -> dict:
    """{"results": {drafter: {"T/set/mode": {"tau", "tau_per_request", "seconds"}}}, "identical": bool,
    "mismatches": [...]} — see the module docstring. ``save(partial result)`` after each cell."""
    from specdec_client import SpecDecClient

    sets = requests(n, prompt_sets)
    procs, addrs = start(drafters, worker_flags, log_dir, gguf)
    out = {"results": {k: {} for k in drafters}, "mismatches": []}
    try:
        clients = {k: SpecDecClient(a) for k, a in addrs.items()}
        for c in clients.values():  # warm-up (graphs, allocator) outside the measurement
            wait_for_drafter(c, max(b for _, b in modes) or 1)
        first = clients[next(iter(clients))]
        ref, out["autoregressive"] = {}, {}
        for s, reqs in sets.items():  # greedy reference (lossless check) and the autoregressive speed
            t0 = time.time()
            ref[s] = [first.generate(**kw, max_tokens=max_new, mode="autoregressive", ignore_eos=True).token_ids
                      for kw in reqs]
            out["autoregressive"][s] = {"tok_s": round(len(reqs) * max_new / (time.time() - t0), 1)}
        for t in temperatures:
            for mode, budget in modes:
                for s, reqs in sets.items():
                    key = f"T{t:g}/{s}/{mode}" + (f"@{budget}" if mode == "tree" else "")
                    for name, c in clients.items():
                        t0, taus = time.time(), []
                        for i, kw in enumerate(reqs):
                            samp = dict(temperature=t, seed=seed + i) if t > 0 else {}
                            r = c.generate(**kw, max_tokens=max_new, mode=mode, tree_budget=budget, ignore_eos=True,
                                           **samp)
                            taus.append(r.stats.mean_accept_length)
                            if r.stats.fallback_rounds:  # the drafter went away mid-run: τ would be the fallback's 1.0
                                raise RuntimeError(f"{name} {key} request {i}: {r.stats.fallback_rounds} one-token "
                                                   f"fallback rounds (draft service not used); logs in {log_dir}")
                            if t == 0 and list(r.token_ids) != list(ref[s][i]):
                                out["mismatches"].append(f"{name} {key} request {i}")
                        dt = time.time() - t0
                        res = out["results"][name][key] = {"tau": round(sum(taus) / len(taus), 3),
                                                           "tau_per_request": [round(x, 3) for x in taus],
                                                           "seconds": round(dt, 2),
                                                           "tok_s": round(len(reqs) * max_new / dt, 1)}
                        log(f"{name} {key}: tau {res['tau']:.3f} ({res['tok_s']} tok/s)")
                        if save:
                            save({**out, "identical": not out["mismatches"]})
        for c in clients.values():
            c.close()
    finally:
        stop(procs)
    out["identical"] = not out["mismatches"]
    return out


def markdown(res: dict) -> str:
    m, names = res["meta"], list(res["results"])
    sets = ", ".join(SET_TEXT[s] for s in m.get("sets", ("humaneval", "mtbench")))
    lines = [f"# DFlash acceptance (τ) through the services: {', '.join(names)}", "",
             f"{m['where']}; {m['n']} prompts per set ({sets}), "
             f"{m['max_new']} new tokens, ignore_eos, c = 1; T > 0: request i seeded {m['seed']}+i. τ = mean over "
             "requests of committed tokens per verify (the response's stats). Same prompts and requests for every "
             f"drafter, one run. Greedy outputs identical to autoregressive: {'yes' if res['identical'] else 'NO'}.",
             "tok/s: completion tokens ÷ wall seconds of the cell's requests, one after another (c = 1); "
             "autoregressive: " + ", ".join(f"{s} {v['tok_s']}" for s, v in res["autoregressive"].items()) + " tok/s.",
             "", "| T | set | mode | " + " | ".join(f"τ {k}" for k in names) +
             (f" | {names[-1]} / {names[0]}" if len(names) > 1 else "") + " | " + " | ".join(f"tok/s {k}" for k in names)
             + " |", "|---|---|---|" + "---|" * (2 * len(names) + (len(names) > 1))]
    for key in res["results"][names[0]]:
        t, s, mode = key.split("/", 2)
        taus = [res["results"][k][key]["tau"] for k in names]
        ratio = f" | {taus[-1] / taus[0]:.3f}" if len(names) > 1 else ""
        lines.append(f"| {t[1:]} | {s} | {mode} | " + " | ".join(f"{x:.2f}" for x in taus) + ratio + " | "
                     + " | ".join(f"{res['results'][k][key]['tok_s']:.0f}" for k in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.acceptance_services")
    ap.add_argument("--drafters", required=True, help="NAME=DIR,NAME=DIR (the first is the reference column)")
    ap.add_argument("--n", type=int, default=8, help="prompts per set (the first n of each)")
    ap.add_argument("--sets", default="humaneval,mtbench", help="comma-separated: humaneval, mtbench, stdlib")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request (ignore_eos)")
    ap.add_argument("--modes", default="chain,tree@64", help="comma-separated: chain, tree@BUDGET")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy (checked against autoregressive)")
    ap.add_argument("--seed", type=int, default=0, help="at T > 0 request i samples with seed SEED + i")
    ap.add_argument("--worker-flags", default="", help="flags for both workers, e.g. '--device cuda --dtype bfloat16'")
    ap.add_argument("--gguf", default=os.environ.get("SPECDEC_GGUF", ""), help="target model file (default "
                    "$SPECDEC_GGUF, else the embedded default)")
    ap.add_argument("--where", default="", help="a line describing the host for the report")
    ap.add_argument("--log-dir", default="/tmp/specdec-acceptance-logs", help="the services' JSON logs")
    ap.add_argument("--out", default=str(RESULTS / "acceptance_services"), help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    drafters = dict(x.split("=", 1) for x in a.drafters.split(","))
    modes = [("chain", 0) if m == "chain" else ("tree", int(m.split("@")[1])) for m in a.modes.split(",")]
    temps = [float(t) for t in a.temperatures.split(",")]
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench.datasets import parse_sets

    try:
        prompt_sets = parse_sets(a.sets)  # an unknown set name fails here, before any service starts
    except ValueError as e:
        ap.error(f"--sets: {e}")
    meta = {"drafters": drafters, "sets": list(prompt_sets), "n": a.n, "max_new": a.max_new, "seed": a.seed, "worker_flags": a.worker_flags,
            "where": a.where or f"services on loopback ({a.worker_flags or 'default device'})",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **code_identity()}
    save = lambda r: out.with_suffix(".json").write_text(json.dumps({**r, "meta": meta}, indent=1))  # noqa: E731
    res = run(drafters, a.n, a.max_new, modes, temps, a.seed, a.worker_flags.split(), a.log_dir, a.gguf, save=save,
              prompt_sets=prompt_sets)
    res["meta"] = meta
    save(res)
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
