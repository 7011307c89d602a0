"""The block-table mirror equals GetBlockTables after thousands of random
steps, for every policy the server publishes."""

from __future__ import annotations

import numpy as np
import pytest

import kvkeep
from kvkeep import pb

from helpers import per_head_rows, query_rows, random_kv, reduced_rows

STEPS = 3000
# Parameters that make every policy evict often on a small budget; slack
# exercises batch eviction; the pyramid schedule gives layers their own budgets.
PARAMS = {
    "full": ({}, 0),
    "window": ({"slack": 3}, 20),
    "streaming_llm": ({"sinks": 2, "slack": 2}, 20),
    "h2o": ({"sinks": 2, "recent": 4, "slack": 1}, kvkeep.Budget(tokens=30, schedule="pyramid")),
    "tova": ({"recent": 2}, 18),
    "scissorhands": ({"history": 8, "sinks": 1, "recent": 3, "slack": 1}, [16, 24]),
    "snapkv": ({"window": 4, "kernel": 3}, 16),
    "h2o_page": ({"sinks": 1, "recent": 4}, 21),
}


def test_every_published_policy_is_covered(client):
    assert set(client.info().policies) == set(PARAMS)


@pytest.mark.parametrize("policy", sorted(PARAMS))
def test_mirror_equals_store_after_random_steps(client, policy):
    rng = np.random.default_rng(sum(map(ord, policy)))
    params, budget = PARAMS[policy]
    info = client.policy(policy)
    lay = client.layout("t_f32")
    with client.create_session("t_f32", policy, budget, **params) as s:
        pos = 0

        def tokens(n):
            nonlocal pos
            k, v = random_kv(rng, lay, n)
            p = np.arange(pos, pos + n) + rng.integers(0, 3)  # gaps are allowed
            pos = int(p[-1]) + 1
            return k, v, p

        def scores(appended, rows=1):
            kind = rng.choice(["reduced", "reduced", "per_head", "queries"])
            layers = [l for l in range(lay.num_layers) if rng.random() < 0.85]
            out = {}
            for l in layers:
                n = s.tables.resident(l) + appended
                if kind == "reduced":
                    out[l] = reduced_rows(rng, lay, n, rows)
                elif kind == "per_head":
                    out[l] = per_head_rows(rng, lay, n, rows)
                else:
                    out[l] = query_rows(rng, lay, rows)
            return kvkeep.Scores(kind, out)

        k, v, p = tokens(int(rng.integers(5, 40)))
        chunks = s.append_prefill(k, v, p, max_chunk_tokens=int(rng.integers(1, 16)))
        evicted = sum(len(c.evicted_positions) for r in chunks for c in r.layers)
        scored = info.input == pb.PolicyInfo.INPUT_PER_STEP
        if info.input == pb.PolicyInfo.INPUT_COMPRESS:
            window = int(params["window"])
            res = s.compress(kvkeep.reduced([reduced_rows(rng, lay, s.tables.resident(l), window)
                                       for l in range(lay.num_layers)]))
            evicted += sum(len(c.evicted_positions) for c in res.layers)
        if scored:
            res = s.score(scores(0))
            evicted += sum(len(c.evicted_positions) for c in res.scores.layers)
        for i in range(STEPS):
            r = rng.random()
            over = [l for l in range(lay.num_layers)
                    if s.tables.resident(l) > s.layer_budgets[l]]
            if r < 0.04:  # a prefill-like chunk with Append, no scores
                k, v, p = tokens(int(rng.integers(1, 6)))
                res = s.append(k, v, p)
                evicted += sum(len(c.evicted_positions) for c in res.layers)
            elif scored and (r < 0.12 or over):  # a score-only step (several rows)
                res = s.score(scores(0, rows=int(rng.integers(1, 3))))
                evicted += sum(len(c.evicted_positions) for c in res.scores.layers)
            else:  # the common decode step: a token and its attention
                k, v, p = tokens(1)
                res = s.step((k, v, p), scores(1) if scored else None)
                evicted += sum(len(c.evicted_positions)
                               for c in list(res.append.layers) + list(res.scores.layers))
            if i % 97 == 0 or i == STEPS - 1:
                # One layer per call: a long session's tables of every layer
                # can exceed the server's message limit.
                for l in range(lay.num_layers):
                    store = s.block_tables([l]).tables[0]
                    assert s.tables.table(l) == store, f"step {i} layer {l}"
        stats = s.stats()
        assert stats.evicted_tokens == evicted
        assert list(stats.layer_resident) == [s.tables.resident(l) for l in range(2)]
        assert list(stats.layer_version) == s.tables.versions()
        if policy not in ("full", "snapkv"):
            assert evicted > STEPS  # every layer evicted along the way
            for l in range(2):
                assert s.tables.resident(l) <= s.layer_budgets[l] + 5
