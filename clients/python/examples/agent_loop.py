#!/usr/bin/env python3
"""A minimal agent loop: several agents share a system prompt, each runs many
turns on one session (its KV stays in kvkeepd between turns), and a
StreamingLLM budget keeps the system prompt's first tokens as sinks while
old turns fall out.

The "model" is a stand-in (random K/V per token); what matters is the
session's life: one prefill of the system prompt, then per turn the user's
message appended in one call and the reply decoded token by token.

    python agent_loop.py --server 127.0.0.1:50051 --layout demo
"""

import argparse

import numpy as np

import kvkeep


def kv_for(lay, rng, n):
    shape = (lay.num_layers, n, lay.kv_heads, lay.head_dim)
    f = rng.standard_normal(shape).astype(np.float32)
    return {kvkeep.pb.DTYPE_F32: f, kvkeep.pb.DTYPE_F16: f.astype(np.float16),
            kvkeep.pb.DTYPE_BF16: kvkeep.f32_to_bf16(f)}[lay.dtype]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--layout", default="demo")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system_tokens", type=int, default=24)
    args = ap.parse_args()

    client = kvkeep.Client(args.server)
    lay = client.layout(args.layout)
    rng = np.random.default_rng(1)
    system_k, system_v = kv_for(lay, rng, args.system_tokens), kv_for(lay, rng, args.system_tokens)
    sinks = 4
    sessions = []
    for a in range(args.agents):
        s = client.create_session(args.layout, "streaming_llm", 64, sinks=sinks)
        s.append_prefill(system_k, system_v, np.arange(args.system_tokens))
        sessions.append(s)
    try:
        next_pos = [args.system_tokens] * args.agents
        for turn in range(args.turns):
            for a, s in enumerate(sessions):
                user = int(rng.integers(3, 12))  # the user's message: one Append
                pos = np.arange(next_pos[a], next_pos[a] + user)
                s.append(kv_for(lay, rng, user), kv_for(lay, rng, user), pos)
                next_pos[a] += user
                for _ in range(int(rng.integers(4, 16))):  # the reply, token by token
                    s.step((kv_for(lay, rng, 1), kv_for(lay, rng, 1), next_pos[a]))
                    next_pos[a] += 1
            kept = sessions[0].tables.positions(0)
            print(f"turn {turn}: agent 0 holds {len(kept)} tokens, positions "
                  f"{int(kept.min())}..{int(kept.max())}")
        for s in sessions:
            kept = set(s.tables.positions(0).tolist())
            assert set(range(sinks)) <= kept, "the system prompt's sinks stay"
            assert s.tables.diff(s.block_tables()) is None
    finally:
        for s in sessions:
            s.close()
    print(f"{args.agents} agents x {args.turns} turns: ok")


if __name__ == "__main__":
    main()
