#!/usr/bin/env python3
"""SnapKV's kept sets, kvpress vs kvkeep, on the same prompt (issue 16).

Two halves, two venvs (kvpress needs transformers < 5.3; the kvkeep client
needs grpcio), one file between them:

  PY=$(scripts/kvpress-env)
  $PY bench/lm/press_keptsets.py press --out=/tmp/snap.npz [--kept=0.25] \\
      [--text=/usr/share/common-licenses/GPL-3 --max_tokens=1024]
  build/bin/kvkeepd --config=config/smollm2.json --listen=127.0.0.1:PORT &
  .cache/venv-python-client/bin/python bench/lm/press_keptsets.py kvkeep \\
      --in=/tmp/snap.npz --server=127.0.0.1:PORT [--csv=OUT.csv]

press: the transformers model (the GGUF, float32, make_reference.py's
  loaders) prefills the prompt under kvpress's SnapKVPress (window 64,
  kernel 5, compression_ratio = 1 - kept). A wrapper around the press's own
  score() records, per layer, the scores it ranks, the indices its topk
  keeps per kv head, the keys and values before compression, and the
  window's attention rows over every prompt token (causal), computed as
  SnapKVPress.compute_window_attention computes them but without dropping
  the window's columns (checked equal to kvpress's on those columns).
kvkeep: a kvkeepd session with policy snapkv (window 64, kernel 5, avgpool)
  and budget = kvpress's kept count; the keys and values go in with
  append_prefill, the window's attention (summed over query heads) with
  compress(); the kept set per layer is read from the client's block-table
  mirror (checked equal to GetBlockTables). Then compares, tie-aware:
  kvkeep's set per layer against (a) kvpress's per-kv-head sets and (b) the
  set kvpress's scores would keep if summed over kv heads (kvkeep's
  granularity: one set per layer). Prints a table; --csv writes one row per
  layer.
"""
import argparse
import csv
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW, KERNEL = 64, 5


def cmd_press(a):
    import math
    import numpy as np
    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(REPO, "tests", "lm"))
    import make_reference as ref
    import kvpress
    from kvpress.utils import compute_n_kept, get_prerope_query_states
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

    tok = ref.load_tokenizer(a.model)
    model = ref.load_model(a.model)
    with open(a.text, encoding="utf-8") as f:
        ids = ref.encode(tok, f.read())[:a.max_tokens]
    n = len(ids)
    press = kvpress.SnapKVPress(compression_ratio=1 - a.kept, window_size=WINDOW,
                                kernel_size=KERNEL)
    rec = {}
    original_score = press.score

    def window_rows(module, hidden_states, keys, position_embeddings):
        # SnapKVPress.compute_window_attention, all columns kept.
        groups = module.config.num_attention_heads // module.config.num_key_value_heads
        q = get_prerope_query_states(module, hidden_states[:, -WINDOW:])
        cos, sin = position_embeddings
        cos, sin = cos[:, -WINDOW:], sin[:, -WINDOW:]
        q = (q * cos.unsqueeze(1)) + (rotate_half(q) * sin.unsqueeze(1))
        k = repeat_kv(keys, groups)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(module.head_dim)
        mask = torch.triu(torch.ones_like(w) * float("-inf"), diagonal=n - WINDOW + 1)
        return torch.softmax(w + mask, dim=-1, dtype=torch.float32)

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = original_score(module, hidden_states, keys, values, attentions, kwargs)
        rows = window_rows(module, hidden_states, keys, kwargs["position_embeddings"])
        theirs = press.compute_window_attention(module, hidden_states, keys, WINDOW,
                                                kwargs["position_embeddings"])
        diff = float((rows[..., :-WINDOW] - theirs).abs().max())
        kept = compute_n_kept(keys.shape[2], press.compression_ratio)
        rec[module.layer_idx] = dict(
            scores=s[0].numpy().copy(),                       # [kv_heads][n]
            kept=s.topk(kept, dim=-1).indices[0].numpy(),     # [kv_heads][kept]
            keys=keys[0].permute(1, 0, 2).numpy().copy(),     # [n][kv_heads][dim]
            values=values[0].permute(1, 0, 2).numpy().copy(),
            rows=rows[0].sum(0).numpy(),                      # [window][n]
            check=diff)
        return s

    press.score = score
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    layers = range(len(rec))
    worst = max(rec[l]["check"] for l in layers)
    print(f"kvpress SnapKV: {n} tokens, keeps {rec[0]['kept'].shape[1]} per kv head; "
          f"window rows vs kvpress's own: max |diff| {worst:.1e}")
    np.savez_compressed(
        a.out, ids=np.array(ids), kept_fraction=a.kept, window=WINDOW, kernel=KERNEL,
        **{f"{k}_{l}": rec[l][k] for l in layers
           for k in ("scores", "kept", "keys", "values", "rows")})
    print(f"-> {a.out}")


def tie_aware(ref_scores, kept_set, n_kept, rtol):
    """(differences, differences outside the tie band): the tokens kvkeep
    keeps that the reference ranking would not, where those whose reference
    score is within rtol of the n_kept-th score count as ties."""
    import numpy as np
    order = np.argsort(-ref_scores, kind="stable")
    ref_set = set(order[:n_kept].tolist())
    cut = ref_scores[order[n_kept - 1]]
    band = set(np.nonzero(np.abs(ref_scores - cut) <= rtol * abs(cut))[0].tolist())
    diff = kept_set ^ ref_set
    return len(kept_set - ref_set), len([t for t in diff if t not in band])


def cmd_kvkeep(a):
    import numpy as np
    sys.path.insert(0, os.path.join(REPO, "clients", "python", "src"))
    import kvkeep
    d = np.load(a.input)
    layers = sum(1 for k in d.files if k.startswith("scores_"))
    ids = d["ids"]
    n = len(ids)
    n_kept = int(d["kept_0"].shape[1])
    keys = [d[f"keys_{l}"] for l in range(layers)]
    values = [d[f"values_{l}"] for l in range(layers)]
    client = kvkeep.Client(a.server)
    rows_out = []
    with client.create_session(a.layout, "snapkv", n_kept, window=WINDOW,
                               kernel=KERNEL, pooling="avgpool") as s:
        s.append_prefill(keys, values, positions=np.arange(n))
        # Columns in the session's slot order.
        s.compress(kvkeep.reduced([d[f"rows_{l}"][:, np.asarray(s.tables.positions(l))]
                                   for l in range(layers)]))
        server = s.block_tables()
        for t in server.tables:
            if sorted(t.positions) != sorted(s.tables.positions(t.layer).tolist()):
                sys.exit(f"layer {t.layer}: GetBlockTables differs from the mirror")
        totals = dict(layer=0, jac=0.0)
        for l in range(layers):
            kept = set(int(p) for p in s.tables.positions(l))
            sc = d[f"scores_{l}"]                  # [kv_heads][n]
            heads = d[f"kept_{l}"]                 # [kv_heads][n_kept]
            summed = sc.astype(np.float64).sum(0)
            layer_diff, layer_out = tie_aware(summed, kept, n_kept, a.rtol)
            head_diffs = []
            for h in range(sc.shape[0]):
                hs = set(heads[h].tolist())
                head_diffs.append(len(kept - hs))
            union = set().union(*(set(x.tolist()) for x in heads))
            jac = np.mean([len(kept & set(x.tolist())) / len(kept | set(x.tolist()))
                           for x in heads])
            rows_out.append(dict(layer=l, tokens=n, kept=len(kept), n_kept=n_kept,
                                 vs_summed_differ=layer_diff,
                                 vs_summed_differ_outside_ties=layer_out,
                                 vs_heads_differ=";".join(map(str, head_diffs)),
                                 mean_jaccard_vs_heads=round(float(jac), 4),
                                 kvkeep_in_union_of_heads=len(kept & union)))
            totals["layer"] += layer_out
            totals["jac"] += jac
        del server
    print(f"{n} prompt tokens, window {WINDOW}, kernel {KERNEL}, {n_kept} kept "
          f"per layer (kvkeep) / per kv head (kvpress)")
    print(f"{'layer':>5} {'kept':>5} {'vs summed':>10} {'outside ties':>13} "
          f"{'vs each head':>14} {'Jaccard/head':>13}")
    for r in rows_out:
        print(f"{r['layer']:>5} {r['kept']:>5} {r['vs_summed_differ']:>10} "
              f"{r['vs_summed_differ_outside_ties']:>13} {r['vs_heads_differ']:>14} "
              f"{r['mean_jaccard_vs_heads']:>13}")
    print(f"differences outside ties vs kvpress summed over heads: {totals['layer']} "
          f"in {layers} layers; mean Jaccard vs kvpress's per-head sets "
          f"{totals['jac'] / layers:.3f}")
    if a.csv:
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            w.writeheader()
            w.writerows(rows_out)
    sys.exit(0 if totals["layer"] == 0 else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("press")
    p.add_argument("--model", default=os.environ.get("KVKEEP_MODEL", os.path.join(
        REPO, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")))
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--max_tokens", type=int, default=1024)
    p.add_argument("--kept", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    k = sub.add_parser("kvkeep")
    k.add_argument("--in", dest="input", required=True)
    k.add_argument("--server", default="127.0.0.1:50051")
    k.add_argument("--layout", default="smollm2-135m")
    k.add_argument("--rtol", type=float, default=1e-5,
                   help="relative score gap that counts as a tie")
    k.add_argument("--csv", default="")
    a = ap.parse_args()
    {"press": cmd_press, "kvkeep": cmd_kvkeep}[a.cmd](a)


if __name__ == "__main__":
    main()
