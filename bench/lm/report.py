#!/usr/bin/env python3
"""Tables and plots of the real-model evaluation (bench/eval-lm.sh).

  bench/lm/report.py --raw=DIR --out=bench/results/lm

Reads from DIR what kvkeep-lm wrote: perplexity-*.json (`perplexity --json`,
one file per position scheme) and answers-*.jsonl (`answer`, one line per
task and run), and writes to --out:

  perplexity.csv, perplexity.md, perplexity.png
      perplexity per run, with the resident KV bytes the store reported
  passkey.csv, passkey.md, passkey_heatmap.png
      exact match and the key's log-probability per run, length and depth
  conversation.csv, conversation.md
      exact match per run, length and kind (repeated / once)

Plots need gnuplot (bench/eval-lm.sh installs Debian's gnuplot-nox). Every
line and point set has its own colour and its own marker.
"""

import argparse
import collections
import csv
import glob
import json
import math
import os
import re
import subprocess
import sys

DEFAULT_SINKS = {"streaming_llm": 4}
# Distinct colours (no two alike) and gnuplot point types, assigned in order.
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
           "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#000000", "#006d2c",
           "#fd8d3c", "#3f007d", "#67000d", "#08306b"]
POINTS = [7, 5, 9, 11, 13, 4, 6, 8, 10, 12, 14, 1, 2, 3, 15, 16]
SHAPES = [(7, 6), (5, 4), (9, 8), (11, 10), (13, 12), (15, 14)]


def parse_run(run):
    """'h2o:sinks=4,recent=64@256' -> (policy, params, budget text)."""
    spec, _, budget = run.partition("@")
    policy, _, params = spec.partition(":")
    kv = dict(p.split("=", 1) for p in params.split(",") if p)
    return policy, kv, budget


def variant(policy, params):
    """The policy with its sinks: 'h2o', 'h2o+4 sinks', 'full'."""
    if policy == "full":
        return "full"
    sinks = int(params.get("sinks", DEFAULT_SINKS.get(policy, 0)))
    return f"{policy}+{sinks} sinks" if sinks else policy


def write_csv(path, rows, fields):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def fmt(x, digits=2):
    if x is None:
        return "–"
    if isinstance(x, float) and (math.isinf(x) or x > 1e4):
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


# --- perplexity -------------------------------------------------------------

def perplexity_rows(raw):
    rows = []
    for path in sorted(glob.glob(os.path.join(raw, "perplexity-*.json"))):
        runs = json.load(open(path))
        full = next((r for r in runs if r["run"] == "full"), None)
        for r in runs:
            policy, params, budget = parse_run(r["run"])
            tokens = r["tokens"]
            b = int(budget) if budget else tokens
            rows.append({
                "positions": r["positions"],
                "run": r["run"],
                "policy": policy,
                "variant": variant(policy, params),
                "sinks": int(params.get("sinks",
                                        DEFAULT_SINKS.get(policy, 0))),
                "budget_tokens": b,
                "budget_share": round(b / tokens, 4),
                "tokens": tokens,
                "perplexity": r["perplexity"],
                "vs_full": (r["perplexity"] / full["perplexity"]
                            if full else None),
                "resident_tokens_per_layer": r["resident_tokens_per_layer"],
                "resident_kv_bytes": r["resident_kv_bytes"],
                "seconds": r["seconds"],
            })
    return rows


def perplexity_md(rows):
    out = []
    for positions in sorted({r["positions"] for r in rows}):
        sel = [r for r in rows if r["positions"] == positions]
        tokens = sel[0]["tokens"]
        budgets = sorted({r["budget_tokens"] for r in sel
                          if r["policy"] != "full"})
        full = next((r for r in sel if r["policy"] == "full"), None)
        out.append(f"### Perplexity, {tokens} tokens, positions={positions}\n")
        if full:
            out.append(f"full (every token, {fmt(full['resident_kv_bytes'] / 2**20, 1)} "
                       f"MiB at the end): **{fmt(full['perplexity'], 3)}**\n")
        out.append("| policy | " + " | ".join(
            f"{b} ({100 * b / tokens:.0f}%)" for b in budgets) + " |")
        out.append("|---|" + "---:|" * len(budgets))
        variants = []
        for r in sel:
            if r["policy"] != "full" and r["variant"] not in variants:
                variants.append(r["variant"])
        for v in variants:
            cells = []
            for b in budgets:
                m = [r for r in sel if r["variant"] == v and
                     r["budget_tokens"] == b]
                cells.append(fmt(m[0]["perplexity"]) if m else "–")
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def gnuplot(script):
    try:
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    except FileNotFoundError:
        print("report.py: no gnuplot; plots skipped", file=sys.stderr)


def perplexity_png(rows, out_dir):
    schemes = sorted({r["positions"] for r in rows})
    if not schemes:
        return
    variants = []
    for r in rows:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    data = os.path.join(out_dir, "perplexity.dat")
    with open(data, "w") as f:
        for s in schemes:
            for v in variants:
                pts = sorted((r["resident_kv_bytes"] / 2**20, r["perplexity"])
                             for r in rows
                             if r["positions"] == s and r["variant"] == v)
                f.write(f"# {s} {v}\n")
                for x, y in pts:
                    f.write(f"{x} {y}\n")
                if not pts:  # keeps the block, so every index stays put
                    f.write("NaN NaN\n")
                f.write("\n\n")
    png = os.path.join(out_dir, "perplexity.png")
    lines = [
        'set terminal pngcairo size %d,700 font ",11" noenhanced'
        % (800 * len(schemes)),
        f"set output '{png}'",
        "set logscale xy", "set grid", "set xrange [5:300]",
        "set yrange [4:30]",
        "set xlabel 'resident KV at the end (MiB, kvkeepd stats)'",
        "set ylabel 'perplexity (log scale)'",
        "set key outside right top",
        f"set multiplot layout 1,{len(schemes)}",
    ]
    for si, s in enumerate(schemes):
        lines.append(f"set title 'positions={s}'")
        plots = []
        for vi, v in enumerate(variants):
            if not any(r["positions"] == s and r["variant"] == v
                       for r in rows):
                continue
            idx = si * len(variants) + vi
            c, p = COLOURS[vi % len(COLOURS)], POINTS[vi % len(POINTS)]
            plots.append(f"'{data}' index {idx} using 1:2 with linespoints "
                         f"lw 2 pt {p} ps 1.3 lc rgb '{c}' title '{v}'")
        lines.append("plot " + ", \\\n  ".join(plots))
    lines.append("unset multiplot")
    gnuplot("\n".join(lines) + "\n")
    os.remove(data)


# --- answers ----------------------------------------------------------------

def answer_rows(raw):
    rows = []
    for path in sorted(glob.glob(os.path.join(raw, "answers-*.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            policy, params, budget = parse_run(r["run"])
            r["variant"] = variant(policy, params)
            r["budget"] = budget or "all"
            rows.append(r)
    return rows


def summarise(rows, keys):
    groups = collections.OrderedDict()
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, g in groups.items():
        d = dict(zip(keys, key))
        d["n"] = len(g)
        d["accuracy"] = round(sum(r["exact"] for r in g) / len(g), 4)
        d["mean_answer_logprob"] = round(
            sum(r["answer_logprob"] for r in g) / len(g), 4)
        d["mean_resident_kv_bytes"] = round(
            sum(r["resident_kv_bytes"] for r in g) / len(g))
        # The answer in the cache when the question came (kvkeep-lm lines
        # from 2026-12-02 on; kvpress's and older lines do not say).
        held = [r for r in g if "answer_token_share" in r]
        d["n_held_measured"] = len(held)
        d["mean_answer_token_share"] = round(
            sum(r["answer_token_share"] for r in held) / len(held),
            4) if held else ""
        d["mean_answer_layers_whole"] = round(
            sum(r["answer_layers_whole"] for r in held) / len(held),
            2) if held else ""
        out.append(d)
    return out


def runs_in_order(rows):
    seen = []
    for r in rows:
        if (r["positions"], r["run"]) not in seen:
            seen.append((r["positions"], r["run"]))
    return seen


def passkey_md(cells, rows):
    lengths = sorted({c["length"] for c in cells})
    out = ["### Passkey retrieval: exact match (mean log-probability of the "
           "key), over depths\n",
           "| positions | run | " + " | ".join(f"{l} tokens" for l in lengths)
           + " | all |",
           "|---|---|" + "---:|" * (len(lengths) + 1)]
    for positions, run in runs_in_order(rows):
        sel = [r for r in rows if r["run"] == run and
               r["positions"] == positions]
        cells_txt = []
        for l in lengths + [None]:
            g = [r for r in sel if l is None or r["length"] == l]
            if not g:
                cells_txt.append("–")
                continue
            acc = sum(r["exact"] for r in g) / len(g)
            lp = sum(r["answer_logprob"] for r in g) / len(g)
            cells_txt.append(f"{acc:.2f} ({lp:.1f}) n={len(g)}")
        out.append(f"| {positions} | {run} | " + " | ".join(cells_txt) + " |")
    return "\n".join(out) + "\n"


def held_md(cells, budget):
    """Accuracy next to what the cache held of the key, per run and depth."""
    sel = [c for c in cells if c["budget"] in (budget, "all") and
           c["n_held_measured"]]
    if not sel:
        return ""
    depths = sorted({c["depth"] for c in sel})
    out = ["### Passkey: found / held when the question came\n",
           "Per run and depth (every length): the share of exact matches "
           "of all its tasks, then, over the tasks whose lines measured it, "
           "the share of the key's tokens (both copies, every layer) still "
           "in the cache after the prompt and the mean number of layers (of "
           "30) holding a whole copy.\n",
           "| run | " + " | ".join(f"depth {d}" for d in depths) + " |",
           "|---|" + "---:|" * len(depths)]
    for run in dict.fromkeys(c["run"] for c in sel):
        txt = []
        for d in depths:
            g = [c for c in sel if c["run"] == run and c["depth"] == d]
            n = sum(c["n_held_measured"] for c in g)
            if not n:
                txt.append("–")
                continue
            acc = sum(c["accuracy"] * c["n"] for c in g) / sum(
                c["n"] for c in g)
            share = sum(c["mean_answer_token_share"] * c["n_held_measured"]
                        for c in g) / n
            whole = sum(c["mean_answer_layers_whole"] * c["n_held_measured"]
                        for c in g) / n
            total = sum(c["n"] for c in g)
            txt.append(f"{acc:.2f} of {total}; held {share:.2f}, "
                       f"{whole:.1f} layers (of {n})")
        out.append(f"| {run} | " + " | ".join(txt) + " |")
    return "\n".join(out) + "\n"


def conversation_md(rows):
    lengths = sorted({r["length"] for r in rows})
    cols = [(l, k) for l in lengths for k in ("repeated", "once")]
    out = ["### Conversation recall: exact match (mean log-probability of the "
           "answer) per length and kind\n",
           "| positions | run | " + " | ".join(f"{l} {k}" for l, k in cols)
           + " |",
           "|---|---|" + "---:|" * len(cols)]
    for positions, run in runs_in_order(rows):
        cells = []
        for l, k in cols:
            g = [r for r in rows if r["run"] == run and r["length"] == l and
                 r["kind"] == k and r["positions"] == positions]
            cells.append(f"{sum(r['exact'] for r in g) / len(g):.2f} "
                         f"({sum(r['answer_logprob'] for r in g) / len(g):.1f})"
                         f" n={len(g)}" if g else "–")
        out.append(f"| {positions} | {run} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def heatmap_png(cells, out_dir, budget):
    """One panel per run at `budget` (and full): accuracy by depth x length."""
    sel = [c for c in cells if c["budget"] in (budget, "all")]
    runs = []
    for c in sel:
        if (c["positions"], c["run"]) not in runs:
            runs.append((c["positions"], c["run"]))
    if not runs:
        return
    lengths = sorted({c["length"] for c in sel})
    depths = sorted({c["depth"] for c in sel})
    data = os.path.join(out_dir, "heatmap.dat")
    with open(data, "w") as f:
        for positions, run in runs:
            f.write(f"# {positions} {run}\n")
            for di, d in enumerate(depths):
                for li, l in enumerate(lengths):
                    m = [c for c in sel if c["run"] == run and
                         c["positions"] == positions and c["length"] == l and
                         c["depth"] == d]
                    acc = m[0]["accuracy"] if m else "NaN"
                    f.write(f"{li} {di} {acc}\n")
                f.write("\n")
            f.write("\n\n")
    cols = min(4, len(runs))
    rows_n = math.ceil(len(runs) / cols)
    png = os.path.join(out_dir, "passkey_heatmap.png")
    lines = [
        'set terminal pngcairo size %d,%d font ",10" noenhanced'
        % (420 * cols, 380 * rows_n + 40),
        f"set output '{png}'",
        "set palette defined (0 '#b2182b', 0.5 '#f7f7f7', 1 '#2166ac')",
        "set cbrange [0:1]", "set view map",
        "set xtics (" + ", ".join(f"'{l}' {i}" for i, l in
                                  enumerate(lengths)) + ")",
        "set ytics (" + ", ".join(f"'{d:.1f}' {i}" for i, d in
                                  enumerate(depths)) + ")",
        f"set xrange [-0.5:{len(lengths) - 0.5}]",
        f"set yrange [-0.5:{len(depths) - 0.5}]",
        "set xlabel 'context (tokens)'", "set ylabel 'depth of the key'",
        f"set multiplot layout {rows_n},{cols} title 'Passkey exact match at "
        f"budget {budget} (full: every token)'",
    ]
    for i, (positions, run) in enumerate(runs):
        lines.append(f"set title '{run} ({positions})'")
        lines.append(f"plot '{data}' index {i} using 1:2:(0.5):(0.5):3 "
                     "with boxxyerror fs solid 1.0 noborder palette notitle, "
                     "'' index %d using 1:2:(strcol(3) eq 'NaN' ? 'not run' "
                     ": sprintf('%%.2f',$3)) with labels notitle" % i)
    lines.append("unset multiplot")
    gnuplot("\n".join(lines) + "\n")
    os.remove(data)


def passkey_budget_md(rows):
    """Accuracy per policy and budget, over the tasks every budget ran."""
    budgets = []
    for r in rows:
        if r["budget"] != "all" and r["budget"] not in budgets:
            budgets.append(r["budget"])
    if len(budgets) < 2:
        return ""
    budgets = by_share(budgets)
    ids = None
    for b in budgets:
        have = {r["id"] for r in rows if r["budget"] == b}
        ids = have if ids is None else ids & have
    sel = [r for r in rows if r["id"] in ids]
    lengths = sorted({r["length"] for r in sel})
    out = [f"### Passkey retrieval by budget: exact match (mean log-probability"
           f" of the key), {', '.join(map(str, lengths))} tokens, the "
           f"{len(ids)} tasks every budget ran\n",
           "| policy | " + " | ".join(budgets) + " |",
           "|---|" + "---:|" * len(budgets)]
    variants = []
    for r in sel:
        if r["variant"] not in variants and r["budget"] != "all":
            variants.append(r["variant"])
    for v in variants:
        cells = []
        for b in budgets:
            g = [r for r in sel if r["variant"] == v and r["budget"] == b]
            cells.append(f"{sum(r['exact'] for r in g) / len(g):.2f} "
                         f"({sum(r['answer_logprob'] for r in g) / len(g):.1f})"
                         if g else "–")
        out.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def press_rows(path):
    """kvpress's rows (press_eval.py tasks) in answer_rows' terms."""
    if not os.path.exists(path):
        return []
    rows = []
    for r in csv.DictReader(open(path, encoding="utf-8")):
        kept = float(r["kept_fraction"])
        rows.append({
            "id": r["id"], "task": r["task"], "length": int(r["length"]),
            "depth": float(r["depth"]) if r["depth"] else None,
            "side": "kvpress", "method": r["press"],
            "budget": "all" if r["press"] == "full" else f"{kept * 100:g}%",
            "exact": int(r["exact_match"]),
            "answer_logprob": float(r["answer_logprob"]),
            "resident_kv_bytes": int(r["kv_bytes"])})
    return rows


def versus_rows(answers, press, budget):
    """kvkeep's runs and kvpress's presses at `budget` (and full), on the
    passkey tasks both sides answered."""
    ours = [dict(r, side="kvkeep", method=r["variant"]) for r in answers
            if r["task"] == "passkey" and r["budget"] in (budget, "all")]
    theirs = [r for r in press
              if r["task"] == "passkey" and r["budget"] in (budget, "all")]
    both = {r["id"] for r in ours} & {r["id"] for r in theirs}
    return [r for r in ours + theirs if r["id"] in both]


def budget_versus_rows(answers, press):
    """The methods that ran at every budget, and the full caches, on the
    passkey tasks that every (side, budget) answered: the budget sweep's."""
    rows = [dict(r, side="kvkeep", method=r["variant"]) for r in answers
            if r["task"] == "passkey"] + [r for r in press
                                          if r["task"] == "passkey"]
    budgets = {r["budget"] for r in rows if r["budget"] != "all"}
    if len(budgets) < 2:
        return []
    ids = None
    for side in ("kvkeep", "kvpress"):
        for b in budgets:
            have = {r["id"] for r in rows
                    if r["side"] == side and r["budget"] == b}
            ids = have if ids is None else ids & have
    rows = [r for r in rows if r["id"] in ids]
    # The methods that ran at every budget, and the full caches.
    swept = {(r["side"], r["method"]) for r in rows if r["budget"] == "all"}
    for side, method in methods_in_order(rows):
        if {r["budget"] for r in rows if (r["side"], r["method"]) ==
                (side, method)} >= budgets:
            swept.add((side, method))
    return [r for r in rows if (r["side"], r["method"]) in swept]


def by_share(budgets):
    """"10%", "25%", ... in order, "all" (the full cache) last."""
    return sorted(budgets, key=lambda b: float("inf") if b == "all"
                  else float(b.rstrip("%")))


def methods_in_order(rows):
    methods = []
    for r in rows:
        if (r["side"], r["method"]) not in methods:
            methods.append((r["side"], r["method"]))
    return methods


def versus_md(rows, title, column, values, header, total=True):
    """Exact match (mean KV MiB held) per side and method, one column per
    value of row[column] (and over all of them when total)."""
    out = [title + "\n",
           "| side | method | " + " | ".join(map(header, values))
           + (" | all |" if total else " |"),
           "|---|---|" + "---:|" * (len(values) + total)]
    for side, method in methods_in_order(rows):
        cells = []
        for v in values + ([None] if total else []):
            g = [r for r in rows if r["side"] == side and r["method"] == method
                 and (v is None or r[column] == v)]
            cells.append(f"{sum(r['exact'] for r in g) / len(g):.2f} "
                         f"({sum(r['resident_kv_bytes'] for r in g) / len(g) / 2**20:.1f})"
                         if g else "–")
        out.append(f"| {side} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def versus_png(rows, png, column, values, title):
    """Accuracy against the KV bytes held, every method a point per value of
    row[column] (a length, a budget): kvkeep filled, kvpress open."""
    methods = methods_in_order(rows)
    data = png + ".dat"
    with open(data, "w") as f:
        for side, method in methods:
            f.write(f"# {side} {method}\n")
            for v in values:
                g = [r for r in rows if r["side"] == side and
                     r["method"] == method and r[column] == v]
                if g:
                    f.write(f"{sum(r['resident_kv_bytes'] for r in g) / len(g) / 2**20} "
                            f"{sum(r['exact'] for r in g) / len(g)}\n")
            f.write("\n\n")
    lines = [
        'set terminal pngcairo size 1000,650 font ",11" noenhanced',
        f"set output '{png}'", "set logscale x", "set grid",
        "set yrange [-0.05:1.05]",
        f"set xlabel 'KV held when the question is asked (MiB, mean per {column})'",
        "set ylabel 'passkey exact match'", "set key outside right top",
        f"set title '{title}: kvkeep filled, kvpress open'"]
    plots = []
    for i, (side, method) in enumerate(methods):
        # gnuplot's filled/open pairs: circle, square, triangles, diamond,
        # pentagon.
        filled, hollow = SHAPES[i % len(SHAPES)]
        c, pt = COLOURS[i % len(COLOURS)], filled if side == "kvkeep" else hollow
        plots.append(f"'{data}' index {i} using 1:2 with linespoints lw 2 "
                     f"pt {pt} ps 1.5 lc rgb '{c}' title '{side} {method}'")
    lines.append("plot " + ", \\\n  ".join(plots))
    gnuplot("\n".join(lines) + "\n")
    os.remove(data)


def write_versus(out_dir, answers, press, budget):
    """passkey_vs_kvpress.* (both sides at `budget`, by length) and
    passkey_budgets_vs_kvpress.* (the budget sweep, both sides)."""
    fields = ["side", "method", "id", "length", "budget", "exact",
              "answer_logprob", "resident_kv_bytes"]
    rows = versus_rows(answers, press, budget)
    if rows:
        name = os.path.join(out_dir, "passkey_vs_kvpress")
        write_csv(name + ".csv", rows, fields)
        lengths = sorted({r["length"] for r in rows})
        n = len({r["id"] for r in rows})
        open(name + ".md", "w").write(versus_md(
            rows, f"### kvkeep and kvpress on the same {n} passkey tasks, "
            f"{budget} of the context kept: exact match (mean KV MiB held)",
            "length", lengths, lambda l: f"{l} tokens"))
        versus_png(rows, name + ".png", "length", lengths,
                   f"Passkey at {budget} of the context (lines join the "
                   f"lengths {', '.join(map(str, lengths))})")
    rows = budget_versus_rows(answers, press)
    if rows:
        name = os.path.join(out_dir, "passkey_budgets_vs_kvpress")
        write_csv(name + ".csv", rows, fields)
        budgets = by_share({r["budget"] for r in rows})
        lengths = sorted({r["length"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        n = len({r["id"] for r in rows})
        open(name + ".md", "w").write(versus_md(
            rows, f"### kvkeep and kvpress by budget on the same {n} passkey "
            f"tasks ({', '.join(map(str, lengths))} tokens, depths "
            f"{', '.join(map(str, depths))}): exact match (mean KV MiB held)",
            "budget", budgets,
            lambda b: "full cache" if b == "all" else f"{b} kept", total=False))
        versus_png(rows, name + ".png", "budget", budgets,
                   f"Passkey by budget, {n} tasks of "
                   f"{', '.join(map(str, lengths))} tokens (lines join the "
                   "budgets)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--raw", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--heatmap_budget", default="25%",
                   help="the budget (as written in --runs) of the heat maps")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    ppl = perplexity_rows(a.raw)
    if ppl:
        write_csv(os.path.join(a.out, "perplexity.csv"), ppl, list(ppl[0]))
        open(os.path.join(a.out, "perplexity.md"), "w").write(
            perplexity_md(ppl))
        perplexity_png(ppl, a.out)

    answers = answer_rows(a.raw)
    passkey = [r for r in answers if r["task"] == "passkey"]
    if passkey:
        cells = summarise(passkey, ["positions", "run", "variant", "budget",
                                    "length", "depth"])
        write_csv(os.path.join(a.out, "passkey.csv"), cells, list(cells[0]))
        open(os.path.join(a.out, "passkey.md"), "w").write(
            passkey_md(cells, passkey))
        heatmap_png(cells, a.out, a.heatmap_budget)
        held = held_md(cells, a.heatmap_budget)
        if held:
            open(os.path.join(a.out, "passkey_held.md"), "w").write(held)
        budget_md = passkey_budget_md(passkey)
        if budget_md:
            open(os.path.join(a.out, "passkey_budgets.md"), "w").write(
                budget_md)
        write_versus(a.out, answers, press_rows(
            os.path.join(a.out, "press_tasks.csv")), a.heatmap_budget)
    conv = [r for r in answers if r["task"] == "conversation"]
    if conv:
        cells = summarise(conv, ["positions", "run", "variant", "budget",
                                 "length", "kind"])
        write_csv(os.path.join(a.out, "conversation.csv"), cells,
                  list(cells[0]))
        open(os.path.join(a.out, "conversation.md"), "w").write(
            conversation_md(conv))
    print(f"report.py: {len(ppl)} perplexity runs, {len(answers)} answers "
          f"-> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
