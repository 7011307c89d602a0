#!/usr/bin/env python3
"""Table of bench/lm/quant_frontier.sh's JSON files: perplexity and the KV
bytes really held per (layout, run), sorted by bytes, and the headline: the
smallest cache within 0.5 perplexity of full bf16. Files of several windows
of the text (frontier-NAME-TOKENS-chN.json: CHAPTER=N) give the spread
table instead: per (layout, run) the perplexity's and its distance's
min-max over the windows, each window against its own full bf16, and
(--png=FILE) that distance against the bytes, a line per format and policy
through its budgets, its bars the min-max (gnuplot).

    bench/lm/quant_frontier.py [--png=FILE] FILE.json...
"""
import collections
import json
import os
import re
import statistics
import sys

from report import COLOURS, POINTS, gnuplot


def load(paths):
    """Rows (format, run, perplexity, bytes, resident tokens, tokens, name,
    window) of every file; name is the file's DTYPES name (bf16-page...)."""
    rows = []
    for path in paths:
        m = re.search(r"frontier-(.+?)-\d+(?:-ch(\d+))?\.json$", path)
        name, window = m.group(1), int(m.group(2) or 1)
        for r in json.load(open(path)):
            rows.append((r["kv_format"], r["run"], r["perplexity"],
                         r["resident_kv_bytes"], r["resident_tokens_per_layer"],
                         r["tokens"], name, window))
    return rows


def full_bf16(rows):
    base = [r for r in rows if r[0] == "bf16" and r[1] == "full"]
    if not base:
        sys.exit("no full bf16 run among the files")
    return base[0]


def table(rows):
    base = full_bf16(rows)
    ref = base[2]
    print(f"{rows[0][5]} tokens of Genesis; full bf16 perplexity {ref:.4f}\n")
    print("| KV format | run | perplexity | vs full bf16 | resident tokens/layer | KV bytes held |")
    print("|---|---|---|---|---|---|")
    for f, run, ppl, nbytes, res, *_ in sorted(rows, key=lambda r: (r[3], r[2])):
        print(f"| {f} | {run} | {ppl:.4f} | {ppl - ref:+.4f} | {res:.0f} | "
              f"{nbytes / 1048576:.2f} MiB |")
    ok = [r for r in rows if r[2] <= ref + 0.5]
    best = min(ok, key=lambda r: (r[3], r[2]))
    print(f"\nsmallest cache within 0.5 perplexity of full bf16: {best[0]} "
          f"{best[1]}: {best[3] / 1048576:.2f} MiB "
          f"({best[3] / base[3]:.1%} of full bf16's "
          f"{base[3] / 1048576:.2f} MiB), perplexity {best[2]:.4f}")


def span(values, fmt):
    return f"{fmt.format(min(values))} .. {fmt.format(max(values))}"


def spread(rows):
    """Per (format, run) over the windows: perplexity, its distance to the
    window's full bf16, and its distance to bf16 at the same run and window
    (the format's own cost: an interval that excludes 0 is a difference
    larger than the spread)."""
    by_window = collections.defaultdict(list)
    for r in rows:
        by_window[r[7]].append(r)
    windows = sorted(by_window)
    ref = {w: full_bf16(rs)[2] for w, rs in by_window.items()}
    bf16 = {}
    for r in rows:
        if r[0] == "bf16":
            bf16.setdefault((r[1], r[7]), r[2])
    cells = collections.defaultdict(dict)
    for r in rows:
        if (r[0], r[1]) == ("bf16", "full") and r[6].endswith("-page"):
            continue  # bf16-page's own baseline: the bf16 file's is the one
        cells[(r[0], r[1])][r[7]] = r
    print(f"{rows[0][5]} tokens of Genesis from chapters "
          f"{', '.join(map(str, windows))} (one window each); full bf16 "
          f"perplexity {span(ref.values(), '{:.4f}')}\n")
    print("| KV format | run | windows | perplexity min .. max | vs full bf16 "
          "min .. max | vs bf16, same run, min .. max | beyond spread | KV bytes held |")
    print("|---|---|---|---|---|---|---|---|")
    worst, points = [], collections.defaultdict(list)
    for (f, run), per in sorted(cells.items(),
                                key=lambda c: (max(r[3] for r in c[1].values()), c[0])):
        ppl = [r[2] for r in per.values()]
        vs_full = [r[2] - ref[w] for w, r in per.items()]
        vs_run = [r[2] - bf16[(run, w)] for w, r in per.items() if (run, w) in bf16]
        beyond = ""
        if f != "bf16" and len(vs_run) > 1:
            beyond = "yes" if min(vs_run) > 0 or max(vs_run) < 0 else "no"
        nbytes = max(r[3] for r in per.values())
        worst.append((max(vs_full), nbytes, f, run, len(per)))
        points[(f, run.partition(":")[0].partition("@")[0])].append(
            (nbytes / 1048576, statistics.fmean(vs_full), min(vs_full), max(vs_full)))
        print(f"| {f} | {run} | {len(per)} | {span(ppl, '{:.4f}')} | "
              f"{span(vs_full, '{:+.4f}')} | "
              f"{span(vs_run, '{:+.4f}') if f != 'bf16' else ''} | {beyond} | "
              f"{nbytes / 1048576:.2f} MiB |")
    ok = [c for c in worst if c[0] <= 0.5 and c[4] == len(windows)]
    if ok:
        best = min(ok, key=lambda c: (c[1], c[0]))
        print(f"\nsmallest cache within 0.5 perplexity of full bf16 in every "
              f"window: {best[2]} {best[3]}: {best[1] / 1048576:.2f} MiB, "
              f"at most {best[0]:+.4f}")
    return points


def png(points, path):
    """Distance to full bf16 (mean, bars min-max) against the bytes."""
    keys = sorted(points, key=lambda k: (k[1] != "full", k[1], k[0]))
    data = path + ".dat"
    with open(data, "w") as f:
        for k in keys:
            f.write(f"# {k[0]} {k[1]}\n")
            for p in sorted(points[k]):
                f.write(" ".join(map(str, p)) + "\n")
            f.write("\n\n")
    plots = [f"'{data}' index {i} using 1:2:3:4 with yerrorlines lw 2 "
             f"pt {POINTS[i % len(POINTS)]} ps 1.3 lc rgb "
             f"'{COLOURS[i % len(COLOURS)]}' title '{k[0].split(' (')[0]} {k[1]}'"
             for i, k in enumerate(keys)]
    gnuplot("\n".join([
        'set terminal pngcairo size 1100,650 font ",11" noenhanced',
        f"set output '{path}'", "set logscale x", "set grid",
        "set xlabel 'KV bytes held at the end (MiB, kvkeepd stats)'",
        "set ylabel 'perplexity - full bf16 (same window; bars: min-max)'",
        "set arrow from graph 0, first 0.5 to graph 1, first 0.5 nohead dt 2",
        "set key outside right top",
        "plot " + ", \\\n  ".join(plots)]) + "\n")
    os.remove(data)


def main(args):
    out_png = None
    if args and args[0].startswith("--png="):
        out_png, args = args[0][len("--png="):], args[1:]
    rows = load(args)
    if len({r[7] for r in rows}) > 1:
        points = spread(rows)
        if out_png:
            png(points, out_png)
    else:
        table(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
