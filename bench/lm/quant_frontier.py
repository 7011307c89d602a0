#!/usr/bin/env python3
"""Table of bench/lm/quant_frontier.sh's JSON files: perplexity and the KV
bytes really held per (layout, run), sorted by bytes, and the headline: the
smallest cache within 0.5 perplexity of full bf16.

    bench/lm/quant_frontier.py FILE.json...
"""
import json
import sys


def main(paths):
    rows = []
    for path in paths:
        for r in json.load(open(path)):
            rows.append((r["kv_format"], r["run"], r["perplexity"],
                         r["resident_kv_bytes"], r["resident_tokens_per_layer"],
                         r["tokens"], r["cache"]))
    base = [r for r in rows if r[0] == "bf16" and r[1] == "full"]
    if not base:
        sys.exit("no full bf16 run among the files")
    ref = base[0][2]
    print(f"{rows[0][5]} tokens of Genesis; full bf16 perplexity {ref:.4f}\n")
    print("| KV format | run | perplexity | vs full bf16 | resident tokens/layer | KV bytes held |")
    print("|---|---|---|---|---|---|")
    for f, run, ppl, nbytes, res, _, _ in sorted(rows, key=lambda r: (r[3], r[2])):
        print(f"| {f} | {run} | {ppl:.4f} | {ppl - ref:+.4f} | {res:.0f} | "
              f"{nbytes / 1048576:.2f} MiB |")
    ok = [r for r in rows if r[2] <= ref + 0.5]
    best = min(ok, key=lambda r: (r[3], r[2]))
    print(f"\nsmallest cache within 0.5 perplexity of full bf16: {best[0]} "
          f"{best[1]}: {best[3] / 1048576:.2f} MiB "
          f"({best[3] / base[0][3]:.1%} of full bf16's "
          f"{base[0][3] / 1048576:.2f} MiB), perplexity {best[2]:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
