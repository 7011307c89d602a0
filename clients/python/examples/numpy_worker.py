#!/usr/bin/env python3
"""A decode worker whose model is a few numpy attention layers, with its KV
cache in kvkeepd.

Each step the worker computes the new token's q, k, v per layer, attends over
the tokens the store kept (the mirror says which position sits in which
slot, so keys are gathered in slot order), appends the token and sends the
step's attention, summed over query heads, in one Decode message. Every
eviction the store makes comes back in the reply and is already applied to
`session.tables`. At the end the store's ReadKv must hold exactly the keys
the worker computed for the positions the mirror names.

    python numpy_worker.py --server 127.0.0.1:50051 --layout demo
"""

import argparse

import numpy as np

import kvkeep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--layout", default="demo")
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()

    client = kvkeep.Client(args.server)
    lay = client.layout(args.layout)
    L, kvh, qh, d = lay.num_layers, lay.kv_heads, lay.query_heads, lay.head_dim
    group = qh // kvh
    rng = np.random.default_rng(0)
    model_dim = 64
    wq = rng.standard_normal((L, model_dim, qh * d)).astype(np.float32) / 8
    wk = rng.standard_normal((L, model_dim, kvh * d)).astype(np.float32) / 8
    wv = rng.standard_normal((L, model_dim, kvh * d)).astype(np.float32) / 8
    to_store = {kvkeep.pb.DTYPE_F32: lambda x: x.astype(np.float32),
                kvkeep.pb.DTYPE_F16: lambda x: x.astype(np.float16),
                kvkeep.pb.DTYPE_BF16: kvkeep.f32_to_bf16}[lay.dtype]
    keys_by_pos = {}  # the worker's own copy of what it sent, float32

    def project(x):  # x: [n][model_dim] -> q [L][n][qh][d], k, v [L][n][kvh][d]
        n = x.shape[0]
        q = np.einsum("nm,lmo->lno", x, wq).reshape(L, n, qh, d)
        k = np.einsum("nm,lmo->lno", x, wk).reshape(L, n, kvh, d)
        v = np.einsum("nm,lmo->lno", x, wv).reshape(L, n, kvh, d)
        return q, k, v

    def attention(layer, q, resident_keys):  # q [qh][d], keys [n][kvh][d] -> [n]
        k = np.repeat(resident_keys, group, axis=1)  # GQA: [n][qh][d]
        logits = np.einsum("hd,nhd->hn", q, k) / np.sqrt(d)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return (p.sum(axis=0) * 0.999).astype(np.float32)  # summed over query heads

    with client.create_session(args.layout, args.policy, args.budget) as s:
        scored = s.policy.input == kvkeep.pb.PolicyInfo.INPUT_PER_STEP
        x = rng.standard_normal((args.prompt, model_dim)).astype(np.float32)
        q, k, v = project(x)
        k, v = to_store(k), to_store(v)
        s.append_prefill(k, v, np.arange(args.prompt))
        for p in range(args.prompt):
            keys_by_pos[p] = k[:, p]
        wide = lambda a: kvkeep.bf16_to_f32(a) if lay.dtype == kvkeep.pb.DTYPE_BF16 \
            else a.astype(np.float32)  # noqa: E731
        if scored:  # the prompt's last query brings it down to the budget
            s.score(kvkeep.reduced([
                attention(l, q[l, -1], np.stack([wide(keys_by_pos[p][l])
                                                 for p in s.tables.positions(l)]))
                for l in range(L)]))
        for step in range(args.steps):
            pos = args.prompt + step
            q, k, v = project(rng.standard_normal((1, model_dim)).astype(np.float32))
            k, v = to_store(k), to_store(v)
            keys_by_pos[pos] = k[:, 0]
            scores = None
            if scored:  # over the resident slots, in slot order, plus the new token
                scores = kvkeep.reduced([
                    attention(l, q[l, 0], np.stack(
                        [wide(keys_by_pos[p][l]) for p in s.tables.positions(l)] +
                        [wide(k[l, 0])]))
                    for l in range(L)])
            r = s.step((k, v, pos), scores)
            gone = [list(c.evicted_positions) for c in r.scores.layers or r.append.layers]
            if step % 16 == 0:
                print(f"step {step}: position {pos}, evicted (layer 0) {gone[0]}, "
                      f"resident {s.tables.resident(0)}")
        for layer in s.read_kv():
            assert list(layer.positions) == list(s.tables.positions(layer.layer))
            for slot, p in enumerate(layer.positions):
                assert layer.keys[slot].tobytes() == keys_by_pos[p][layer.layer].tobytes()
        print(f"{s.stats().evicted_tokens} tokens evicted; the store holds exactly the "
              "keys the worker computed, where the mirror says: ok")


if __name__ == "__main__":
    main()
