"""python -m specdec_client — send one prompt to a running orchestrator and print the text as it
arrives, then a stats line (τ, tokens/s) on stderr. --json prints one JSON result instead."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from serving.security import CredentialsError
from specdec_client.client import GenerationResult, SpecDecClient, SpecDecError
from specdec_client.probe import add_tls_flags, tls_hint


def stats_line(r: GenerationResult, seconds: float) -> str:
    """One human line: tokens, time, tokens/s, τ, rounds, finish reason."""
    rate = r.completion_tokens / seconds if seconds else 0.0
    fallback = f" ({r.stats.fallback_rounds} without the drafter)" if r.stats.fallback_rounds else ""
    return (f"{r.completion_tokens} tokens in {seconds:.2f}s = {rate:.1f} tok/s, "
            f"tau {r.stats.mean_accept_length:.2f} over {r.stats.rounds} rounds{fallback}, finish={r.finish_reason}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec_client", description=__doc__)
    p.add_argument("prompt", help="prompt text (sent as one chat user message unless --raw)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the orchestrator's host:port")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds: the request's gRPC deadline (carried to both workers; DEADLINE_EXCEEDED after it)")
    p.add_argument("--raw", action="store_true", help="send the text as-is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--mode", default="tree", choices=["autoregressive", "chain", "tree"],
                   help="decoding mode (default tree); every mode gives the autoregressive output")
    p.add_argument("--budget", type=int, default=0,
                   help="tree budget: draft tree nodes per round (0: the server's default); the cap with "
                        "--budget-policy adaptive")
    p.add_argument("--budget-policy", default="", choices=["", "fixed", "adaptive"],
                   help="tree mode: 'fixed' drafts --budget nodes every round, 'adaptive' lets the server pick a "
                        "one-token round or a tree of at most --budget nodes per round (default: the server's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same text")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); cut from the text")
    add_tls_flags(p)
    p.add_argument("--token", default=os.environ.get("SPECDEC_AUTH_TOKEN", ""),
                   help="bearer token for a server started with --auth-token (default: $SPECDEC_AUTH_TOKEN)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end (token ids, text, finish reason, usage, τ, tokens/s)")
    args = p.parse_args(argv)
    prompt = dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}])
    try:
        client = SpecDecClient(args.address, timeout=args.timeout, tls=args.tls, tls_ca=args.tls_ca,
                               tls_cert=args.tls_cert, tls_key=args.tls_key, token=args.token)
    except CredentialsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with client:
        t0 = time.perf_counter()
        try:
            for item in client.stream(**prompt, max_tokens=args.max_tokens, mode=args.mode,
                                      tree_budget=args.budget, temperature=args.temperature, top_k=args.top_k,
                                      top_p=args.top_p, seed=args.seed, stop=args.stop,
                                      budget_policy=args.budget_policy):
                if isinstance(item, GenerationResult):
                    r = item
                elif not args.json and item.text:
                    sys.stdout.write(item.text)
                    sys.stdout.flush()
        except SpecDecError as e:
            tls = bool(args.tls or args.tls_ca)
            if args.json:
                print(json.dumps({"error": e.code.name, "details": tls_hint(e.details, tls)}), file=sys.stderr)
            else:
                print(f"\nerror: {tls_hint(str(e), tls)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # closing the stream cancels the request on the server
            print("\ncancelled", file=sys.stderr)
            return 130
        seconds = time.perf_counter() - t0
    if not args.json:
        print(flush=True)
        print(stats_line(r, seconds), file=sys.stderr)
        return 0
    out = dataclasses.asdict(r)
    out.pop("chunks")
    out["seconds"] = round(seconds, 3)
    out["tokens_per_second"] = round(r.completion_tokens / seconds, 2) if seconds else None
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
