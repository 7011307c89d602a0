"""kvkeep.aio: 64 concurrent sessions on one channel, and the same checks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvkeep
import kvkeep.aio

from helpers import random_kv, reduced_rows, query_rows

SESSIONS = 64
STEPS = 60


async def _worker(client: kvkeep.aio.Client, i: int) -> dict:
    rng = np.random.default_rng(100 + i)
    policy = ["h2o", "tova", "scissorhands", "h2o_page", "window", "streaming_llm"][i % 6]
    lay = kvkeep.pb.Layout()
    info = await client.info(refresh=False)
    lay = [l for l in info.layouts if l.name == ["t_f32", "t_f16", "t_bf16"][i % 3]][0]
    sent = {}
    async with await client.create_session(lay.name, policy, 12 + i % 5) as s:
        k, v = random_kv(rng, lay, 20 + i)
        await s.append_prefill(k, v, np.arange(20 + i), max_chunk_tokens=7)
        for p in range(20 + i):
            sent[p] = (k[:, p], v[:, p])
        scored = s.policy.input == kvkeep.pb.PolicyInfo.INPUT_PER_STEP
        if scored:
            await s.score(kvkeep.reduced([reduced_rows(rng, lay, s.tables.resident(l))[0]
                                          for l in range(2)]))
        async with s.decode() as stream:
            for p in range(20 + i, 20 + i + STEPS):
                tk, tv = random_kv(rng, lay, 1)
                sent[p] = (tk[:, 0], tv[:, 0])
                sc = None
                if scored:
                    sc = (kvkeep.queries([query_rows(rng, lay)[0]] * 2) if p % 2 else
                          kvkeep.reduced([reduced_rows(rng, lay, s.tables.resident(l) + 1)[0]
                                          for l in range(2)]))
                await stream.step((tk, tv, p), sc)
                await asyncio.sleep(0)  # let the others interleave
        store = await s.block_tables()
        assert s.tables.diff(store) is None, s.tables.diff(store)
        for layer in await s.read_kv():
            for slot, p in enumerate(layer.positions):
                assert layer.keys[slot].tobytes() == sent[p][0][layer.layer].tobytes()
                assert layer.values[slot].tobytes() == sent[p][1][layer.layer].tobytes()
        stats = await s.stats()
        assert list(stats.layer_resident) == [s.tables.resident(l) for l in range(2)]
        assert all(r <= s.layer_budgets[l] for l, r in enumerate(stats.layer_resident))
        return {"id": s.id, "evicted": stats.evicted_tokens}


def test_64_concurrent_sessions(server):
    async def main():
        async with kvkeep.aio.Client(server.address) as client:
            results = await asyncio.gather(*(_worker(client, i) for i in range(SESSIONS)))
            assert len({r["id"] for r in results}) == SESSIONS
            assert all(r["evicted"] > 0 for r in results)
            left = {x.session_id for x in await client.list()}
            assert not left & {r["id"] for r in results}  # every one closed
    asyncio.run(main())


def test_aio_errors_and_rpcs(server, make_server):
    async def main():
        async with kvkeep.aio.Client(server.address) as client:
            with pytest.raises(kvkeep.NotFound):
                await client.stats("0000000000000001")
            with pytest.raises(kvkeep.InvalidArgument) as e:
                await client.create_session("t_f32", "h2o", 16, sink=1)
            assert e.value.client_side
            rng = np.random.default_rng(9)
            lay = (await client.info()).layouts[0]
            s = await client.create_session("t_f32", "snapkv", 8, window=2)
            k, v = random_kv(rng, lay, 12)
            await s.append(k, v, np.arange(12))
            r = await s.compress(kvkeep.reduced([reduced_rows(rng, lay, 12, 2)] * 2))
            assert r.layers[0].resident == 8
            other = await client.open_session(s.id)
            assert other.tables.diff(await s.block_tables()) is None
            with pytest.raises(kvkeep.InvalidArgument):  # stream error, then reopen
                await s.step(random_kv(rng, lay, 1) + ([3],))
            await s.step(random_kv(rng, lay, 1) + ([12],))
            pool = await s.map_pool()
            keys, _ = pool.gather((s.tables.pages(0), s.tables.resident(0)))
            got = (await s.read_kv([0]))[0]
            assert keys.tobytes() == got.keys.tobytes()
            del keys
            pool.close()
            target = make_server()
            moved = await client.transfer(s.id, target.address)
            assert moved.session_id == s.id
            async with kvkeep.aio.Client(target.address) as tc:
                assert (await tc.stats(s.id)).resident_tokens == 18
                assert await tc.close(s.id) > 0
    asyncio.run(main())
