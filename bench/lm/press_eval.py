#!/usr/bin/env python3
"""kvpress beside kvkeep on the same model, texts, tasks and budgets (issue 16).

Runs in the venv that scripts/kvpress-env makes (kvpress 0.5.5, transformers
5.2.0, torch 2.15.0 on the CPU); the model is the GGUF kvkeep-lm reads,
loaded by transformers in float32 with SmolLM2's pre-tokenizer
(tests/lm/make_reference.py's loaders). docs/kvpress.md has the protocol and
the numbers.

  PY=$(scripts/kvpress-env)
  $PY bench/lm/press_eval.py baseline --text=/usr/share/common-licenses/GPL-3 \\
      --max_tokens=1024 [--kvkeep_lm=build/bin/kvkeep-lm]
  $PY bench/lm/press_eval.py tasks --tasks=TASKS.jsonl [--quick] \\
      [--kept=0.1,0.25,0.5] [--presses=snapkv,knorm,...]
  $PY bench/lm/press_eval.py perplexity --text=FILE --max_tokens=1024 \\
      [--budgets=64,128,256] [--presses=decoding_streaming_llm,...]

baseline: the full-cache perplexity of the transformers model on the text's
  first --max_tokens tokens (no BOS), one forward pass; with --kvkeep_lm,
  also `kvkeep-lm perplexity --local` on the same tokens, and the difference.
tasks: for every task (bench/lm/make_tasks.py's JSON Lines), press and kept
  fraction: kvpress's pipeline ("kv-press-text-generation") compresses the
  context with the press (compression_ratio = 1 - kept), then the question
  goes in uncompressed and is answered greedily (8 new tokens). One CSV row
  each: exact match, the answer's teacher-forced log-probability on the same
  compressed cache, the KV bytes the cache holds after compression.
perplexity: the text token by token through a DecodingPress (kvpress's
  decode-time compression) that keeps --budgets tokens per layer and head,
  compressing every --interval tokens; the perplexity of every next token.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "lm"))
import make_reference as ref  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results", "lm")
MAX_NEW_TOKENS = 8
# SnapKV's and PyramidKV's observation window and pooling kernel: kvpress's
# defaults (kvkeep's snapkv is given the same, docs/kvpress.md).
WINDOW, KERNEL = 64, 5

# The presses: name -> (what kvpress calls it, needs eager attention).
# Methods kvkeep also has first, then kvpress's strongest that kvkeep lacks.
PRESS_NAMES = [
    "full", "streaming_llm", "snapkv", "tova", "observed_attention",
    "pyramidkv", "expected_attention", "knorm", "adakv_snapkv",
    "adakv_expected_attention",
]
QUICK_PRESSES = ["full", "streaming_llm", "snapkv", "tova",
                 "observed_attention", "expected_attention", "adakv_snapkv"]
DECODING_BASES = ["streaming_llm", "knorm", "tova", "expected_attention"]


def make_press(name, kept):
    """A fresh press keeping `kept` of the context; None for "full"."""
    import kvpress as kp
    cr = 1.0 - kept
    if name == "full":
        return None
    return {
        "streaming_llm": lambda: kp.StreamingLLMPress(compression_ratio=cr, n_sink=4),
        "snapkv": lambda: kp.SnapKVPress(compression_ratio=cr, window_size=WINDOW,
                                         kernel_size=KERNEL),
        "tova": lambda: kp.TOVAPress(compression_ratio=cr),
        "observed_attention": lambda: kp.ObservedAttentionPress(compression_ratio=cr),
        "pyramidkv": lambda: kp.PyramidKVPress(compression_ratio=cr, window_size=WINDOW,
                                               kernel_size=KERNEL),
        "expected_attention": lambda: kp.ExpectedAttentionPress(compression_ratio=cr),
        "knorm": lambda: kp.KnormPress(compression_ratio=cr),
        "adakv_snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress(
            compression_ratio=cr, window_size=WINDOW, kernel_size=KERNEL)),
        "adakv_expected_attention": lambda: kp.AdaKVPress(
            kp.ExpectedAttentionPress(compression_ratio=cr)),
    }[name]()


def needs_eager(name):
    # ObservedAttentionPress reads the attention weights the layer returns,
    # which only eager attention computes; AdaKV refuses eager.
    return name == "observed_attention"


def setup(model_path, threads):
    import torch
    torch.set_num_threads(threads)
    import kvpress  # noqa: F401  (registers the pipeline, patches attention)
    from transformers import pipeline
    tok = ref.load_tokenizer(model_path)
    model = ref.load_model(model_path)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok,
                    device="cpu")
    return tok, model, pipe


def set_attention(model, name):
    impl = "eager" if needs_eager(name) else "sdpa"
    if model.config._attn_implementation != impl:
        model.set_attn_implementation(impl)


def encode(tok, text):
    return ref.encode(tok, text)


def split_prompt(tok, context, question, answer):
    """Token ids of context, question and answer as kvkeep-lm sees them: the
    prompt context + question is tokenized as one string (so the ids match
    kvkeep-lm's); the context is its longest prefix that is also a prefix of
    the context's own ids. The answer is what follows the prompt in
    prompt + " " + answer (a greedy continuation starts with the space)."""
    prompt = encode(tok, context + question)
    ctx = encode(tok, context)
    n = 0
    while n < min(len(ctx), len(prompt)) and ctx[n] == prompt[n]:
        n += 1
    full = encode(tok, context + question + " " + answer)
    if full[:len(prompt)] != prompt:
        raise ValueError("prompt + answer does not extend the prompt's ids")
    return prompt[:n], prompt[n:], full[len(prompt):]


def cache_stats(cache, model):
    """(tokens per layer and kv head kept on average, bytes the key and value
    tensors hold, bytes of the entries attention can still see). AdaKV keeps
    its evicted entries in the tensors and masks them (kvpress's
    masked_key_indices), so the two byte counts differ for it alone."""
    held = seen = 0
    tokens = []
    layers = model.model.layers
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        held += k.numel() * k.element_size() + v.numel() * v.element_size()
        entries = k.shape[0] * k.shape[1] * k.shape[2]
        masked = getattr(layers[i].self_attn, "masked_key_indices", None)
        n_masked = 0 if masked is None else int(masked[0].numel())
        per_entry = k.shape[3] * (k.element_size() + v.element_size())
        seen += (entries - n_masked) * per_entry
        tokens.append((entries - n_masked) / (k.shape[0] * k.shape[1]))
    return sum(tokens) / len(tokens), held, seen


def forward(model, cache, ids, start, one_at_a_time):
    """The model's logits for `ids` at positions start..., appended to
    `cache`. one_at_a_time: a token at a time, for a cache whose layers hold
    different lengths (PyramidKV's), which no one causal mask fits: a
    question of several tokens then fails in kvpress's own generate_answer;
    a single token needs no mask."""
    import torch
    ids = torch.tensor([ids])
    pos = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    spans = [(i, i + 1) for i in range(ids.shape[1])] if one_at_a_time \
        else [(0, ids.shape[1])]
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[:, a:b], past_key_values=cache,
                                position_ids=pos[:, a:b]).logits[0]
                          for a, b in spans])


def answer_logprob(model, cache, context_len, question_ids, answer_ids,
                   one_at_a_time):
    """Teacher-forced log p(answer | compressed context, question), with the
    positions kvpress's pipeline gives the question (context_len onwards)."""
    import torch
    logits = forward(model, cache, question_ids + answer_ids, context_len,
                     one_at_a_time)
    logp = torch.log_softmax(logits.double(), dim=-1)
    q = len(question_ids)
    return float(sum(logp[q - 1 + j, a] for j, a in enumerate(answer_ids)))


def run_task(pipe, model, press_name, kept, ids):
    """kvpress's pipeline, one task: its _forward (prefill under the press,
    then greedy answer) with the ids split as kvkeep-lm sees them; plus the
    answer's log-probability on the same compressed cache."""
    import torch
    from transformers import DynamicCache
    ctx, question, answer = ids
    press = make_press(press_name, kept)
    set_attention(model, press_name)
    context_ids = torch.tensor([ctx])
    cache = DynamicCache()
    with torch.no_grad():
        with (press(model) if press is not None else _null()):
            model.model(input_ids=context_ids, past_key_values=cache)
        kept_tokens, held, seen = cache_stats(cache, model)
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        uneven = len(set(lengths)) > 1  # see forward()
        logprob = answer_logprob(model, cache, len(ctx), question, answer,
                                 uneven)
        pipe._remove_answer_from_cache(cache, lengths)
        q, start = question, len(ctx)
        if uneven:  # all but the question's last token, one at a time
            forward(model, cache, q[:-1], start, True)
            q, start = q[-1:], start + len(q) - 1
        text = pipe.generate_answer(torch.tensor([q]), cache, start,
                                    MAX_NEW_TOKENS)
    for layer in model.model.layers:  # AdaKV's mask must not outlive its cache
        layer.self_attn.masked_key_indices = None
    return text, logprob, kept_tokens, held, seen


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def progress(i, n, start, what):
    if not sys.stderr.isatty():
        if i == n or i % 20 == 0:
            print(f"press_eval: {i}/{n} {what}", file=sys.stderr, flush=True)
        return
    el = time.time() - start
    eta = el / i * (n - i) if i else 0
    bar = "#" * int(30 * i / n)
    print(f"\r[{bar:<30}] {i}/{n} {el:5.0f}s eta {eta:5.0f}s {what[:40]:<40}",
          end="" if i < n else "\n", file=sys.stderr, flush=True)


def key_index(task):
    """NN of an id ending in -kNN (make_tasks.py's key or fact number)."""
    return int(task["id"].rsplit("-k", 1)[1])


def cmd_tasks(a):
    tok, model, pipe = setup(a.model, a.threads)
    with open(a.tasks, encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    if a.quick:  # the shortest contexts, a key or two per cell
        a.max_keys = a.max_keys or 1
        a.kept = a.kept or "0.25"
        tasks = [t for t in tasks if t["length"] <= 1024]
    if a.max_keys:
        tasks = [t for t in tasks if key_index(t) < a.max_keys *
                 (2 if t["task"] == "conversation" else 1)]
    if a.limit:
        tasks = tasks[:a.limit]
    presses = a.presses.split(",") if a.presses else (
        QUICK_PRESSES if a.quick else PRESS_NAMES)
    kept = [float(x) for x in (a.kept or "0.1,0.25,0.5").split(",")]
    jobs = [(t, p, k) for t in tasks for p in presses
            for k in ([1.0] if p == "full" else kept)]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fields = ["task", "id", "length", "depth", "kind", "side", "press",
              "kept_fraction", "compression_ratio", "context_tokens",
              "question_tokens", "kept_tokens", "kv_bytes", "kv_bytes_seen",
              "exact_match", "answer_logprob", "answer", "output", "seconds",
              "cpu_seconds"]
    done = set()
    if a.resume and os.path.exists(a.out):  # keep the rows already there
        with open(a.out, encoding="utf-8") as f:
            done = {(r["id"], r["press"], float(r["kept_fraction"]))
                    for r in csv.DictReader(f) if r.get("cpu_seconds")}
        jobs = [(t, p, k) for t, p, k in jobs if (t["id"], p, k) not in done]
    cached_ids = {}
    start = time.time()
    with open(a.out, "a" if done else "w", newline="", encoding="utf-8") as out:
        w = csv.DictWriter(out, fieldnames=fields)
        if not done:
            w.writeheader()
        for i, (t, p, k) in enumerate(jobs):
            progress(i, len(jobs), start, f"{t['id']} {p}@{k}")
            if t["id"] not in cached_ids:
                cached_ids[t["id"]] = split_prompt(tok, t["context"], t["question"],
                                                   t["answer"])
            ids = cached_ids[t["id"]]
            t0, c0 = time.time(), time.process_time()
            text, lp, kept_tokens, held, seen = run_task(pipe, model, p, k, ids)
            w.writerow({
                "task": t["task"], "id": t["id"], "length": t["length"],
                "depth": t.get("depth", ""), "kind": t.get("kind", ""),
                "side": "kvpress", "press": p, "kept_fraction": k,
                "compression_ratio": round(1 - k, 6),
                "context_tokens": len(ids[0]), "question_tokens": len(ids[1]),
                "kept_tokens": round(kept_tokens, 2), "kv_bytes": held,
                "kv_bytes_seen": seen,
                "exact_match": int(text.lstrip(" ").startswith(t["answer"])),
                "answer_logprob": round(lp, 4), "answer": t["answer"],
                "output": text, "seconds": round(time.time() - t0, 2),
                "cpu_seconds": round(time.process_time() - c0, 2)})
            out.flush()
        progress(len(jobs), len(jobs), start, "done")
    print(f"press_eval: {len(jobs)} rows -> {a.out}")


def text_ids(tok, path, max_tokens):
    with open(path, encoding="utf-8") as f:
        ids = encode(tok, f.read())
    return ids[:max_tokens] if max_tokens else ids


def kvkeep_local_perplexity(binary, model_path, text, max_tokens):
    """kvkeep-lm perplexity --local --json: its first run's JSON object."""
    res = subprocess.run([binary, "perplexity", "--local", f"--model={model_path}",
                          f"--text={text}", f"--max_tokens={max_tokens}", "--json"],
                         check=True, capture_output=True, text=True)
    out = res.stdout
    return json.loads(out[out.index("["):])[0]


def cmd_baseline(a):
    import torch
    torch.set_num_threads(a.threads)
    tok = ref.load_tokenizer(a.model)
    model = ref.load_model(a.model)
    ids = text_ids(tok, a.text, a.max_tokens)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -sum(float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1))
    ppl = math.exp(nll / (len(ids) - 1))
    import transformers
    print(f"transformers {transformers.__version__} / torch {torch.__version__}: "
          f"{len(ids)} tokens, {len(ids) - 1} predictions, perplexity {ppl:.6f}")
    row = {"text": a.text, "tokens": len(ids), "predictions": len(ids) - 1,
           "transformers_version": transformers.__version__,
           "transformers_perplexity": round(ppl, 6)}
    if a.kvkeep_lm:
        run = kvkeep_local_perplexity(a.kvkeep_lm, a.model, a.text, a.max_tokens)
        if run["predictions"] != len(ids) - 1:
            sys.exit(f"kvkeep-lm scored {run['predictions']} tokens, "
                     f"transformers {len(ids) - 1}: not the same tokens")
        k = float(run["perplexity"])
        rel = abs(k - ppl) / ppl
        print(f"kvkeep-lm --local: perplexity {k:.6f}; relative difference "
              f"{rel:.2e} (tolerance {a.tol:.0e}): {'AGREE' if rel <= a.tol else 'DIFFER'}")
        row.update(kvkeep_perplexity=round(k, 6), relative_difference=f"{rel:.3e}",
                   tolerance=a.tol, agree=int(rel <= a.tol))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        new = not os.path.exists(a.out)
        with open(a.out, "a", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(row))
            if new:
                w.writeheader()
            w.writerow(row)
    if a.kvkeep_lm and not row["agree"]:
        sys.exit(1)


def keep_slot_order():
    """Makes ScorerPress.compress keep the kept entries in their slot order.
    kvpress 0.5.5 gathers them in topk's order, which is arbitrary among
    equal scores (NVIDIA/kvpress#173, "overlooked"); a one-shot prefill
    press does not care (attention is order-free), but a DecodingPress whose
    base press ranks by slot (StreamingLLMPress: slots n_sink...; the sinks
    of ExpectedAttentionPress) then evicts the wrong tokens at its second
    compression. --keep_order measures the press with that fixed."""
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        indices = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()

    ScorerPress.compress = compress


def decoding_press(base, budget, interval):
    import kvpress as kp
    scorer = {
        "streaming_llm": lambda: kp.StreamingLLMPress(n_sink=4),
        "knorm": lambda: kp.KnormPress(),
        "tova": lambda: kp.TOVAPress(),
        "expected_attention": lambda: kp.ExpectedAttentionPress(),
    }[base]()
    return kp.DecodingPress(base_press=scorer, compression_interval=interval,
                            target_size=budget,
                            hidden_states_buffer_size=max(interval, 64))


def decode_perplexity(model, ids, press):
    """Every token after the first through the model one at a time, each at
    its original position (as the pipeline's decoding does), under `press`
    (a DecodingPress, or None for the full cache). Returns (perplexity, mean
    tokens per layer and head at the end)."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    nll = 0.0
    with torch.no_grad(), (press(model) if press is not None else _null()):
        out = model(input_ids=torch.tensor([ids[:1]]), past_key_values=cache)
        for i in range(1, len(ids)):
            logp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
            nll -= float(logp[ids[i]])
            out = model(input_ids=torch.tensor([[ids[i]]]), past_key_values=cache,
                        position_ids=torch.tensor([[i]]))
    tokens = sum(cache.get_seq_length(i) for i in range(len(cache))) / len(cache)
    return math.exp(nll / (len(ids) - 1)), tokens


def cmd_perplexity(a):
    tok, model, _ = setup(a.model, a.threads)
    set_attention(model, "sdpa")
    if a.keep_order:
        keep_slot_order()
    ids = text_ids(tok, a.text, a.max_tokens)
    bases = a.presses.split(",") if a.presses else DECODING_BASES
    budgets = [int(b) for b in a.budgets.split(",")]
    runs = ([] if a.no_full else [("full", None)]) + \
        [(b, n) for b in bases for n in budgets]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fields = ["text", "tokens", "side", "press", "budget", "interval",
              "perplexity", "kept_tokens_end", "kv_bytes_end", "seconds",
              "cpu_seconds"]
    per_token = model.config.num_hidden_layers * model.config.num_key_value_heads * \
        model.config.head_dim * 2 * 4
    start = time.time()
    with open(a.out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for i, (base, budget) in enumerate(runs):
            progress(i, len(runs), start, f"{base}@{budget}")
            t0, c0 = time.time(), time.process_time()
            press = None if budget is None else decoding_press(base, budget, a.interval)
            ppl, tokens = decode_perplexity(model, ids, press)
            w.writerow({"text": os.path.basename(a.text), "tokens": len(ids),
                        "side": "kvpress",
                        "press": "full" if press is None else
                        f"decoding_{base}" + ("_ordered" if a.keep_order else ""),
                        "budget": budget or "", "interval": a.interval if press else "",
                        "perplexity": round(ppl, 4), "kept_tokens_end": tokens,
                        "kv_bytes_end": int(tokens * per_token),
                        "seconds": round(time.time() - t0, 1),
                        "cpu_seconds": round(time.process_time() - c0, 1)})
            f.flush()
            print(f"{'full' if press is None else 'decoding_' + base}@{budget}: "
                  f"perplexity {ppl:.4f}, {tokens:.0f} tokens kept", flush=True)
        progress(len(runs), len(runs), start, "done")


def cmd_summary(a):
    """Markdown tables from a tasks CSV: per task kind, press and kept
    fraction, the exact-match accuracy, mean answer log-probability and the
    mean KV bytes held (and seen)."""
    import collections
    cells = collections.defaultdict(list)
    with open(a.csv, encoding="utf-8") as f:
        for r in csv.DictReader(f):
            kind = r["task"] + (f" ({r['kind']})" if r["kind"] else "")
            cells[(kind, r["press"], float(r["kept_fraction"]))].append(r)
    lines = []
    for kind in sorted({k[0] for k in cells}):
        lines += [f"**{kind}** (kvpress)", "",
                  "| press | kept | n | exact match | mean log p(answer) | "
                  "KV MiB held | KV MiB seen |", "|---|---|---|---|---|---|---|"]
        keys = sorted((k for k in cells if k[0] == kind),
                      key=lambda k: (PRESS_NAMES.index(k[1]) if k[1] in PRESS_NAMES
                                     else 99, -k[2]))
        for key in keys:
            rows = cells[key]
            n = len(rows)
            em = sum(int(r["exact_match"]) for r in rows) / n
            lp = sum(float(r["answer_logprob"]) for r in rows) / n
            held = sum(int(r["kv_bytes"]) for r in rows) / n / 2**20
            seen = sum(int(r["kv_bytes_seen"]) for r in rows) / n / 2**20
            lines.append(f"| {key[1]} | {key[2]:g} | {n} | {em:.2f} | {lp:.2f} | "
                         f"{held:.1f} | {seen:.1f} |")
        lines.append("")
    text = "\n".join(lines)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=ref.DEFAULT_MODEL)  # $KVKEEP_MODEL
    common.add_argument("--threads", type=int, default=2,
                        help="torch threads (the machine has 2 cores)")
    b = sub.add_parser("baseline", parents=[common])
    b.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    b.add_argument("--max_tokens", type=int, default=1024)
    b.add_argument("--kvkeep_lm", default=None, help="build/bin/kvkeep-lm")
    b.add_argument("--tol", type=float, default=1e-4,
                   help="largest relative perplexity difference that agrees")
    b.add_argument("--out", default=os.path.join(RESULTS, "press_baseline.csv"))
    t = sub.add_parser("tasks", parents=[common])
    t.add_argument("--tasks", required=True, help="make_tasks.py's JSON Lines")
    t.add_argument("--quick", action="store_true",
                   help="tasks of at most 1024 tokens, one key per cell, "
                        "kept 0.25, fewer presses")
    t.add_argument("--limit", type=int, default=0, help="first N tasks only")
    t.add_argument("--max_keys", type=int, default=0,
                   help="passkey keys per cell (conversation: twice as many: "
                        "both kinds); 0: all")
    t.add_argument("--presses", default="", help=",".join(PRESS_NAMES))
    t.add_argument("--kept", default="",
                   help="fractions of the context's KV kept "
                        "(default 0.1,0.25,0.5; --quick 0.25)")
    t.add_argument("--out", default=os.path.join(RESULTS, "press_tasks.csv"))
    t.add_argument("--resume", action="store_true",
                   help="keep the rows --out already holds; run the rest")
    p = sub.add_parser("perplexity", parents=[common])
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--max_tokens", type=int, default=1024)
    p.add_argument("--presses", default="", help=",".join(DECODING_BASES))
    p.add_argument("--budgets", default="256",
                   help="tokens kept per layer and kv head")
    p.add_argument("--interval", type=int, default=1,
                   help="DecodingPress's compression_interval (1: every token, "
                        "as kvkeep's policies with slack 0)")
    p.add_argument("--keep_order", action="store_true",
                   help="keep the kept entries in slot order (kvpress#173)")
    p.add_argument("--no_full", action="store_true",
                   help="skip the full-cache decode run")
    p.add_argument("--out", default=os.path.join(RESULTS, "press_perplexity.csv"))
    m = sub.add_parser("summary", help="Markdown tables from a tasks CSV")
    m.add_argument("--csv", default=os.path.join(RESULTS, "press_tasks.csv"))
    m.add_argument("--out", default="")
    a = ap.parse_args()
    if a.cmd == "summary":
        return cmd_summary(a)
    if not os.path.exists(a.model):
        sys.exit(f"{a.model} is missing: run scripts/fetch-model")
    {"baseline": cmd_baseline, "tasks": cmd_tasks,
     "perplexity": cmd_perplexity}[a.cmd](a)


if __name__ == "__main__":
    main()
