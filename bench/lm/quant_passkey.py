#!/usr/bin/env python3
"""Tables of bench/lm/quant_passkey.sh's answers: per (KV format, run) the
passkey exact-match accuracy, the true key's mean teacher-forced log p and
the KV bytes the store really held, sorted by bytes; the headline (the
smallest cache within 2 accuracy points of full bf16); and, given the main
grid's answers on the same tasks (--reference), its float32 accuracy per run.

    bench/lm/quant_passkey.py [--csv=FILE] [--reference=answers.jsonl] \
        passkey-NAME-1024.jsonl...
"""
import argparse
import collections
import csv
import json
import os
import re
import statistics

from report import COLOURS, POINTS, gnuplot

# quant_passkey.sh's layout names (bench/lm/kvkeepd.json) -> KV format.
FORMATS = {"f32": "f32", "bf16": "bf16", "fp8": "fp8_e4m3/g32",
           "int8": "int8/g32", "int4": "int4/g32", "kivi": "kivi_int4/g32"}


def cells(lines):
    """run -> its lines."""
    out = collections.defaultdict(list)
    for r in lines:
        out[r["run"]].append(r)
    return out


def summary(fmt, run, rs):
    return {"kv_format": fmt, "run": run, "keys": len(rs),
            "depths": ",".join(f"{d:g}" for d in sorted({r["depth"] for r in rs})),
            "accuracy": 100.0 * sum(r["exact"] for r in rs) / len(rs),
            "mean_logp": statistics.fmean(r["answer_logprob"] for r in rs),
            "resident_tokens": statistics.fmean(r["resident_tokens_per_layer"] for r in rs),
            "kv_bytes": statistics.fmean(r["resident_kv_bytes"] for r in rs)}


def png(rows, path):
    """Two panels against the KV bytes held: exact match and mean log p."""
    lines = collections.defaultdict(list)  # (format, policy) -> points
    for r in rows:
        policy = r["run"].partition(":")[0].partition("@")[0]
        lines[(r["kv_format"], policy)].append(r)
    keys = sorted(lines, key=lambda k: (k[1] != "full", k[1], k[0]))
    data = path + ".dat"
    with open(data, "w") as f:
        for k in keys:
            f.write(f"# {k[0]} {k[1]}\n")
            for r in sorted(lines[k], key=lambda r: r["kv_bytes"]):
                f.write(f"{r['kv_bytes'] / 1048576} {r['accuracy']} {r['mean_logp']}\n")
            f.write("\n\n")
    script = ['set terminal pngcairo size 1500,650 font ",11" noenhanced',
              f"set output '{path}'", "set logscale x", "set grid",
              "set xlabel 'KV bytes held at the answer (MiB, kvkeepd stats)'",
              "set multiplot layout 1,2"]
    for col, label in ((2, "exact match (%), passkey"), (3, "mean log p(true key)")):
        script += ["unset key" if col == 2 else "set key outside right top",
                   f"set ylabel '{label}'",
                   "set yrange [-5:105]" if col == 2 else "set autoscale y"]
        plots = [f"'{data}' index {i} using 1:{col} with linespoints lw 2 "
                 f"pt {POINTS[i % len(POINTS)]} ps 1.3 lc rgb "
                 f"'{COLOURS[i % len(COLOURS)]}' title '{k[0]} {k[1]}'"
                 for i, k in enumerate(keys)]
        script.append("plot " + ", \\\n  ".join(plots))
    script.append("unset multiplot")
    gnuplot("\n".join(script) + "\n")
    os.remove(data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv")
    ap.add_argument("--png")
    ap.add_argument("--reference", help="the main grid's answers (f32)")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    rows = []
    main_grid = [json.loads(line) for line in open(args.reference)] if args.reference else []
    for path in args.files:
        name = re.match(r"passkey-(.+)-\d+\.jsonl$", os.path.basename(path)).group(1)
        lines = [json.loads(line) for line in open(path)]
        for run, rs in cells(lines).items():
            rows.append(summary(FORMATS.get(name, name), run, rs))
            # The main grid's answers to the same tasks with the same run.
            ids = {r["id"] for r in rs}
            same = [r for r in main_grid if r["run"] == run and r["id"] in ids]
            rows[-1]["f32_accuracy"] = (100.0 * sum(r["exact"] for r in same) / len(same)
                                        if len(same) == len(rs) else None)
    base = [r for r in rows if r["kv_format"] == "bf16" and r["run"] == "full"]
    if not base:
        raise SystemExit("no full bf16 run among the files")
    base = base[0]
    rows.sort(key=lambda r: (r["kv_bytes"], -r["accuracy"]))
    print(f"{base['keys']} passkey tasks of 1024 tokens (depths {base['depths']}); "
          f"full bf16: {base['accuracy']:.0f}% exact, mean log p "
          f"{base['mean_logp']:.3f}\n")
    ref_col = " | f32, main grid |" if main_grid else " |"
    print("| KV format | run | keys | exact match | mean log p(key) | resident tokens/layer "
          "| KV bytes held" + ref_col)
    print("|---|---|---|---|---|---|---|" + ("---|" if main_grid else ""))
    for r in rows:
        extra = ""
        if main_grid:
            f = r["f32_accuracy"]
            extra = f" {f:.0f}% |" if f is not None else " |"
        print(f"| {r['kv_format']} | {r['run']} | {r['keys']} | {r['accuracy']:.0f}% | "
              f"{r['mean_logp']:.3f} | {r['resident_tokens']:.0f} | "
              f"{r['kv_bytes'] / 1048576:.2f} MiB |" + extra)
    ok = [r for r in rows if r["accuracy"] >= base["accuracy"] - 2]
    best = min(ok, key=lambda r: (r["kv_bytes"], -r["accuracy"]))
    print(f"\nsmallest cache within 2 accuracy points of full bf16: "
          f"{best['kv_format']} {best['run']}: {best['kv_bytes'] / 1048576:.2f} MiB "
          f"({best['kv_bytes'] / base['kv_bytes']:.1%} of full bf16's "
          f"{base['kv_bytes'] / 1048576:.2f} MiB), {best['accuracy']:.0f}% exact")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if args.png:
        png(rows, args.png)


if __name__ == "__main__":
    main()
