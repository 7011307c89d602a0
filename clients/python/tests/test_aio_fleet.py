"""kvkeep.aio: the fleet (placement, routing, a move followed, a killed
replica named) and the calls of issue 18 (prefixes, fork, keep_alive,
watch_events), against real kvkeepd processes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvkeep
import kvkeep.aio
from kvkeep import pb

from helpers import random_kv, reduced_rows

QUICK = kvkeep.Options(deadline=10, retries=1, backoff=0.05, max_backoff=0.1)


async def _same_as_store(s: kvkeep.aio.Session) -> None:
    store = await s.block_tables()
    assert s.tables.diff(store) is None, s.tables.diff(store)


def test_aio_fleet_places_routes_and_follows(fleet_servers):
    async def main():
        rng = np.random.default_rng(11)
        addresses = [s.address for s in fleet_servers.values()]
        async with await kvkeep.aio.Fleet.connect(addresses,
                                                  placement_staleness=0) as fleet:
            assert fleet.replicas() == ["fleet-a", "fleet-b", "fleet-c"]
            a = await fleet.create_session("t_f32", "h2o", 24, replica="fleet-a",
                                           sinks=2, recent=4)
            lay = a.layout
            k, v = random_kv(rng, lay, 30)
            await a.append_prefill(k, v, np.arange(30))
            await a.score(kvkeep.reduced([reduced_rows(rng, lay, 30)[0]] * 2))
            b = await fleet.create_session("t_f32", "full", replica="fleet-b")
            await b.append(*random_kv(rng, lay, 10), np.arange(10))
            placed = await fleet.create_session("t_f32", "full")  # the empty one
            assert placed.id.startswith("fleet-c."), placed.id
            assert fleet.route(a.id) == "fleet-a"
            # Handles made before a move follow it: a unary call, a prefill,
            # a decode stream's first step.
            unary, prefill, decode = [await fleet.open_session(a.id) for _ in range(3)]
            moved = await fleet.replica("fleet-a").transfer(
                a.id, fleet_servers["fleet-c"].address)
            assert moved.session_id.startswith("fleet-c.")
            async with kvkeep.aio.Client(fleet_servers["fleet-a"].address) as plain:
                with pytest.raises(kvkeep.NotFound, match="moved to replica fleet-c"):
                    await plain.stats(a.id)
            assert list((await unary.stats()).layer_resident) == [24, 24]
            assert unary._c.replica == "fleet-c"
            k1, v1 = random_kv(rng, lay, 1)
            async with decode.decode() as stream:
                await stream.step((k1, v1, 30),
                                  kvkeep.reduced([reduced_rows(rng, lay, 25)[0]] * 2))
            assert decode._c.replica == "fleet-c"
            await _same_as_store(decode)
            k2, v2 = random_kv(rng, lay, 2)
            chunks = await prefill.append_prefill(k2, v2, [31, 32])
            assert chunks[-1].layers[0].resident == 26
            await _same_as_store(prefill)
            got = (await (await fleet.open_session(moved.session_id)).read_kv([0]))[0]
            want = {**{p: k[0, p] for p in range(30)}, 30: k1[0, 0], 31: k2[0, 0],
                    32: k2[0, 1]}
            for slot, p in enumerate(got.positions):
                assert got.keys[slot].tobytes() == want[p].tobytes()
            assert await fleet.close(a.id) > 0  # the old id, followed
    asyncio.run(main())


def test_aio_fleet_names_a_killed_replica(fleet_servers):
    async def main():
        rng = np.random.default_rng(12)
        target = "ipv4:" + ",".join(s.address for s in fleet_servers.values())
        async with await kvkeep.aio.Fleet.connect(target, options=QUICK,
                                                  placement_staleness=0) as fleet:
            assert fleet.replicas() == ["fleet-a", "fleet-b", "fleet-c"]
            doomed = await fleet.create_session("t_f32", "full", replica="fleet-b")
            alive = await fleet.create_session("t_f32", "full", replica="fleet-a")
            streaming = await fleet.open_session(doomed.id)
            fleet_servers["fleet-b"].kill()
            where = f"replica fleet-b at {fleet_servers['fleet-b'].address}"
            with pytest.raises(kvkeep.Unavailable, match=f"GetSessionStats to {where}"):
                await doomed.stats()
            k, v = random_kv(rng, doomed.layout, 1)
            with pytest.raises(kvkeep.Unavailable, match=where):
                await streaming.step((k, v, 0))
            assert (await alive.step((k, v, 0))).append.layers[0].resident == 1
            for _ in range(3):
                s = await fleet.create_session("t_f32", "full")
                assert not s.id.startswith("fleet-b."), s.id
    asyncio.run(main())


def test_aio_prefixes_fork_keep_alive_and_events(server):
    async def main():
        rng = np.random.default_rng(13)
        async with kvkeep.aio.Client(server.address) as client:
            kinds = [pb.EVENT_SESSION_CREATED, pb.EVENT_SESSION_FORKED,
                     pb.EVENT_SESSION_CLOSED]
            watch = await client.watch_events(kinds).start()
            source = await client.create_session("t_f32", "full", budget=64)
            k, v = random_kv(rng, source.layout, 8)
            await source.append(k, v, np.arange(8))
            info = await source.publish("aio/system")
            assert (info.tokens, info.pages, info.layout) == (8, 4, "t_f32")
            with pytest.raises(kvkeep.AlreadyExists):
                await source.publish("aio/system")
            agent = await client.create_session("", "h2o", budget=12, prefix="aio/system")
            assert agent.layout.name == "t_f32"
            assert (await agent.stats()).shared_pages == 4
            assert list(agent.tables.pages(0)) == list(source.tables.pages(0))
            assert [p.holders for p in await client.list_prefixes()] == [1]
            child = await agent.fork(idempotency_key="aio-branch")
            assert child.layer_budgets == [12, 12] and child.policy.name == "h2o"
            assert (await child.stats()).shared_pages == 4
            k1, v1 = random_kv(rng, child.layout, 1)
            await child.append(k1, v1, [8])
            assert list(child.tables.positions(0)) == list(range(9))
            await _same_as_store(child)
            np.testing.assert_array_equal((await agent.read_kv([0]))[0].keys, k[0])
            assert (await child.keep_alive()).lease_seconds_left > 0
            assert (await client.keep_alive(agent.id)).lease_seconds_left > 0
            seen = []
            async for event in watch:
                seen.append((event.kind, event.session.session_id))
                if len(seen) == 3:
                    break
            assert seen == [(pb.EVENT_SESSION_CREATED, source.id),
                            (pb.EVENT_SESSION_CREATED, agent.id),
                            (pb.EVENT_SESSION_FORKED, child.id)]
            watch.cancel()
            for s in (child, agent, source):
                await s.close()
            assert await client.unpublish_prefix("aio/system") == 0
            assert await client.list_prefixes() == []
            async for event in watch:  # resumes after the last one seen
                assert (event.kind, event.session.session_id) == \
                    (pb.EVENT_SESSION_CLOSED, child.id)
                break
            watch.cancel()
    asyncio.run(main())
