"""python -m specdec_client — send one prompt to a running orchestrator and print JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from specdec_client.client import SpecDecClient, SpecDecError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("prompt", help="prompt text (sent as one chat user message unless --raw)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--raw", action="store_true", help="send the text as-is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mode", default="tree", choices=["autoregressive", "chain", "tree"])
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    args = p.parse_args(argv)
    prompt = dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}])
    with SpecDecClient(args.address) as client:
        t0 = time.perf_counter()
        try:
            r = client.generate(**prompt, max_tokens=args.max_tokens, mode=args.mode, tree_budget=args.budget,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, stop=args.stop)
        except SpecDecError as e:
            print(json.dumps({"error": e.code.name, "details": e.details}), file=sys.stderr)
            return 1
        seconds = time.perf_counter() - t0
    out = dataclasses.asdict(r)
    out.pop("chunks")
    out["seconds"] = round(seconds, 3)
    out["tokens_per_second"] = round(r.completion_tokens / seconds, 2) if seconds else None
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
