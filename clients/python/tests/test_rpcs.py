"""Every RPC of kvkeep.v1 through the client, against a real kvkeepd."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import kvkeep
import kvkeep.aio
from kvkeep import pb

from conftest import LAYOUTS, MAX_MESSAGE_BYTES
from helpers import (assert_mirror_equals_store, query_rows, random_kv, reduced_rows,
                     per_head_rows)


def test_server_info(client):
    info = client.info()
    assert [l.name for l in info.layouts] == [l["name"] for l in LAYOUTS]
    f32 = info.layouts[0]
    assert (f32.num_layers, f32.kv_heads, f32.query_heads, f32.head_dim,
            f32.page_tokens, f32.dtype) == (2, 2, 4, 8, 4, pb.DTYPE_F32)
    assert f32.page_bytes == 2 * 4 * 2 * 8 * 4
    assert info.max_message_bytes == MAX_MESSAGE_BYTES
    assert list(info.policies) == [p.name for p in info.policy_info]
    h2o = client.policy("h2o")
    assert h2o.input == pb.PolicyInfo.INPUT_PER_STEP
    assert {"sinks", "recent", "slack"} <= {p.name for p in h2o.params}
    assert client.policy("snapkv").input == pb.PolicyInfo.INPUT_COMPRESS
    assert client.policy("window").input == pb.PolicyInfo.INPUT_NONE


def test_session_lifecycle_stats_list_close(client):
    s = client.create_session("t_f32", "h2o", budget=12, sinks=2, recent=4)
    assert s.layer_budgets == [12, 12]
    assert s.id in [x.session_id for x in client.list()]
    st = client.stats(s.id)
    assert (st.layout, st.policy, st.resident_tokens, st.pages) == ("t_f32", "h2o", 0, 0)
    rng = np.random.default_rng(0)
    k, v = random_kv(rng, s.layout, 9)
    s.append(k, v, np.arange(9))
    st = s.stats()
    assert st.resident_tokens == 18 and st.pages == 2 * 3
    assert list(st.layer_resident) == [9, 9]
    assert s.close() == 6
    assert s.id not in [x.session_id for x in client.list()]
    with pytest.raises(kvkeep.NotFound) as e:
        client.stats(s.id)
    assert s.id in e.value.message


def test_context_manager_closes(client):
    with client.create_session("t_f32", "window", budget=8) as s:
        sid = s.id
    with pytest.raises(kvkeep.NotFound):
        client.stats(sid)


def test_prefill_chunks_decode_readkv(client):
    rng = np.random.default_rng(1)
    lay = client.layout("t_f32")
    with client.create_session("t_f32", "h2o", budget=24, sinks=2, recent=4) as s:
        n = 150  # 256 bytes a token: several 16 KiB messages
        k, v = random_kv(rng, lay, n)
        chunks = s.append_prefill(k, v, np.arange(n))
        assert len(chunks) > 1
        # h2o evicts on scores: each chunk after the first first settles the
        # layer to its budget, so the last chunk's tokens are over it.
        resident = s.tables.resident(0)
        assert 24 < resident < n
        assert_mirror_equals_store(s)
        # The prompt's own attention brings it down to the budget.
        res = s.score(kvkeep.reduced([reduced_rows(rng, lay, resident)[0] for _ in range(2)]))
        assert s.tables.resident(0) == 24
        assert len(res.scores.layers[0].evicted_positions) == resident - 24
        sent = {p: (k[:, p], v[:, p]) for p in range(n)}
        with s.decode() as stream:
            for pos in range(n, n + 30):
                tk, tv = random_kv(rng, lay, 1)
                sent[pos] = (tk[:, 0], tv[:, 0])
                scores = [reduced_rows(rng, lay, s.tables.resident(l) + 1) for l in range(2)]
                r = stream.step((tk, tv, [pos]), kvkeep.reduced(scores))
                assert r.append.layers[0].resident == 25
                assert r.scores.layers[0].resident == 24
        assert_mirror_equals_store(s)
        for layer in s.read_kv():
            assert list(layer.positions) == list(s.tables.positions(layer.layer))
            assert layer.version == s.tables.version(layer.layer)
            for slot, p in enumerate(layer.positions):
                assert layer.keys[slot].tobytes() == sent[p][0][layer.layer].tobytes()
                assert layer.values[slot].tobytes() == sent[p][1][layer.layer].tobytes()
        one = s.read_kv([1])
        assert [x.layer for x in one] == [1]
        bt = s.block_tables([1])
        assert [t.layer for t in bt.tables] == [1]


@pytest.mark.parametrize("form", ["per_head", "queries"])
def test_score_forms(client, form):
    rng = np.random.default_rng(2)
    lay = client.layout("t_f32")
    with client.create_session("t_f32", "h2o", budget=10, recent=2) as s:
        k, v = random_kv(rng, lay, 12)
        s.append_prefill(k, v, np.arange(12))
        for pos in range(12, 40):
            tk, tv = random_kv(rng, lay, 1)
            def make():
                if form == "per_head":
                    return kvkeep.per_head({l: per_head_rows(rng, lay, s.tables.resident(l) + 1)[:, 0]
                                            for l in range(2)})
                return kvkeep.queries({l: query_rows(rng, lay)[0] for l in range(2)})
            sc = make()
            if pos == 12:  # the prompt is over budget: score it alone first
                with pytest.raises(kvkeep.FailedPrecondition) as e:
                    s.step((tk, tv, pos), sc)
                assert e.value.client_side and "over budget" in e.value.message
                s.score(kvkeep.queries({l: query_rows(rng, lay)[0] for l in range(2)}))
                sc = make()
            s.step((tk, tv, pos), sc)
            assert s.tables.resident(0) == 10
        assert_mirror_equals_store(s)


def test_subset_of_layers_and_multirow(client):
    rng = np.random.default_rng(3)
    lay = client.layout("t_f32")
    with client.create_session("t_f32", "tova", budget=8) as s:
        k, v = random_kv(rng, lay, 6)
        s.append_prefill(k, v, np.arange(6))
        # 3 rows (a prefill chunk's queries), layer 1 only.
        r = s.score(kvkeep.reduced({1: reduced_rows(rng, lay, 6, rows=3)}))
        assert len(r.scores.layers) == 2
        k, v = random_kv(rng, lay, 5)
        s.append(k, v, np.arange(6, 11))
        r = s.score(kvkeep.reduced({0: reduced_rows(rng, lay, 11)[0]}))
        assert s.tables.resident(0) == 8 and s.tables.resident(1) == 11
        assert_mirror_equals_store(s)


def test_compress_snapkv(client):
    rng = np.random.default_rng(4)
    lay = client.layout("t_f32")
    window = 4
    with client.create_session("t_f32", "snapkv", budget=10, window=window,
                               kernel=3, pooling="maxpool") as s:
        k, v = random_kv(rng, lay, 30)
        s.append_prefill(k, v, np.arange(30))
        # Probabilities over every slot, future ones included: the client
        # zeroes what each window row cannot see.
        rows = [reduced_rows(rng, lay, 30, rows=window) for _ in range(2)]
        r = s.compress(kvkeep.reduced(rows))
        assert [c.resident for c in r.layers] == [10, 10]
        kept = set(s.tables.positions(0).tolist())
        assert set(range(26, 30)) <= kept  # the observation window stays
        # What snapkv keeps is the top pooled causal attention: recompute it.
        a = rows[0].copy()
        for i in range(window):
            a[i, 30 - window + i + 1:] = 0
        score = a.sum(axis=0)[:26]
        padded = np.concatenate([[-np.inf], score, [-np.inf]])
        pooled = np.max(np.stack([padded[j:j + 26] for j in range(3)]), axis=0)
        top = set(np.argsort(-pooled, kind="stable")[:6].tolist())
        assert kept - set(range(26, 30)) == top
        with pytest.raises(kvkeep.FailedPrecondition):
            s.step(random_kv(rng, lay, 1) + ([30],), kvkeep.reduced(
                [reduced_rows(rng, lay, 11)[0]] * 2))
        s.step(random_kv(rng, lay, 1) + ([30],))  # decode sends no scores
        assert_mirror_equals_store(s)


def test_open_session_second_handle(client):
    rng = np.random.default_rng(5)
    lay = client.layout("t_f16")
    with client.create_session("t_f16", "streaming_llm", budget=8, sinks=2) as s:
        k, v = random_kv(rng, lay, 20)
        s.append_prefill(k, v, np.arange(20))
        other = client.open_session(s.id)
        assert other.tables.diff(s.block_tables()) is None
        assert other.policy.name == "streaming_llm"
        assert list(other.tables.positions(0)) == list(s.tables.positions(0))
        assert sorted(other.tables.positions(0)) == [0, 1] + list(range(14, 20))


def test_map_pool_reads_pages_in_place(client):
    rng = np.random.default_rng(6)
    lay = client.layout("t_bf16")
    with client.create_session("t_bf16", "h2o", budget=12, sinks=1, recent=3) as s:
        sent = {}
        k, v = random_kv(rng, lay, 20)
        s.append_prefill(k, v, np.arange(20))
        for p in range(20):
            sent[p] = (k[:, p], v[:, p])
        s.score(kvkeep.reduced([reduced_rows(rng, lay, 20)[0]] * 2))
        with s.map_pool() as pool:
            assert pool.device == "host"
            assert pool.pages.dtype == np.uint16
            assert [t.layer for t in pool.tables] == [0, 1]
            for l in range(2):
                keys, values = pool.gather((s.tables.pages(l), s.tables.resident(l)))
                for slot, p in enumerate(s.tables.positions(l)):
                    assert keys[slot].tobytes() == sent[p][0][l].tobytes()
                    assert values[slot].tobytes() == sent[p][1][l].tobytes()
                kk, vv = pool.slot(pool.tables[l], 3)
                assert kk.tobytes() == sent[pool.tables[l].positions[3]][0][l].tobytes()
            del keys, values, kk, vv
        by_layout = client.map_pool("t_bf16")
        assert by_layout.capacity_pages == 16384 and not by_layout.tables
        by_layout.close()


def test_map_pool_needs_sharing(make_server):
    srv = make_server(extra=["--share_pools=false"])
    c = kvkeep.Client(srv.address)
    with pytest.raises(kvkeep.FailedPrecondition):
        c.map_pool("t_f32")
    with pytest.raises(kvkeep.NotFound):
        kvkeep.Client(srv.address).map_pool("nope")


def test_transfer_between_two_servers(client, make_server):
    rng = np.random.default_rng(7)
    target = make_server()
    lay = client.layout("t_f32")
    s = client.create_session("t_f32", "h2o", budget=16, sinks=2, recent=4)
    k, v = random_kv(rng, lay, 30)
    s.append_prefill(k, v, np.arange(30))
    s.score(kvkeep.reduced([reduced_rows(rng, lay, 30)[0]] * 2))
    before = s.read_kv()
    tables = s.block_tables()
    for transport in ["host"]:
        r = client.transfer(s.id, target.address, transport=transport)
        assert r.session_id == s.id and r.transport == transport
        assert r.bytes == sum(x.keys.nbytes + x.values.nbytes for x in before)
    with pytest.raises(kvkeep.NotFound):
        client.stats(s.id)
    tc = kvkeep.Client(target.address)
    moved = tc.open_session(s.id)
    # Same slots, positions and versions; the pages are the target's own.
    for t in tables.tables:
        assert list(moved.tables.positions(t.layer)) == list(t.positions)
        assert moved.tables.version(t.layer) == t.version
    after = moved.read_kv()
    for a, b in zip(before, after):
        assert a.keys.tobytes() == b.keys.tobytes() and a.values.tobytes() == b.values.tobytes()
    # It decodes on the target as it would have here.
    tk, tv = random_kv(rng, lay, 1)
    moved.step((tk, tv, 30), kvkeep.reduced([reduced_rows(rng, lay, 17)[0]] * 2))
    assert_mirror_equals_store(moved)
    assert moved.close() > 0


def test_tcp_transfer_and_retry_id(client, make_server):
    rng = np.random.default_rng(8)
    target = make_server()
    lay = client.layout("t_f16")
    s = client.create_session("t_f16", "full")
    k, v = random_kv(rng, lay, 10)
    s.append(k, v, np.arange(10))
    r = client.transfer(s.id, target.address, transport="tcp", transfer_id="py-xfer-1")
    assert (r.transport, r.transfer_id) == ("tcp", "py-xfer-1")
    assert kvkeep.Client(target.address).stats(s.id).resident_tokens == 20


def test_block_tables_larger_than_a_message_come_joined(client):
    # 6,000 tokens: about 26 KB of tables per layer, over the 16 KiB limit,
    # so the answer comes in pages and each layer is split.
    rng = np.random.default_rng(3)
    lay = client.layout("t_f32")
    with client.create_session("t_f32", "full") as s:
        n = 6000
        for start in range(0, n, 500):
            k, v = random_kv(rng, lay, 500)
            s.append_prefill(k, v, np.arange(start, start + 500))
        whole = s.block_tables()
        assert [t.layer for t in whole.tables] == [0, 1]
        for t in whole.tables:
            assert t.first_slot == 0
            assert list(t.positions) == list(range(n))
        assert whole == s.tables.tables()
        assert s.resync().tables() == whole
        # The pages themselves, as a client from the .proto sees them.
        pages, token = [], ""
        while True:
            page = client._c.call("GetBlockTables", pb.GetBlockTablesRequest(
                session_id=s.id, page_token=token))
            pages.append(page)
            token = page.next_page_token
            if not token:
                break
        assert len(pages) >= 3
        assert any(t.first_slot > 0 for p in pages for t in p.tables)
        assert all(p.ByteSize() <= MAX_MESSAGE_BYTES for p in pages)

        async def joined_by_aio():
            async with kvkeep.aio.Client(client.address) as c:
                return await c.block_tables(s.id)
        assert asyncio.run(joined_by_aio()) == whole


def test_leases_keep_alive_and_idle_timeout(client):
    info = client.info()
    assert info.default_idle_timeout_seconds == 3600
    assert info.max_idle_timeout_seconds == 30 * 24 * 3600
    s = client.create_session("t_f32", "window", budget=8, idle_timeout_seconds=120)
    st = s.stats()  # a call: renews first
    assert st.idle_timeout_seconds == 120 and not st.lease_held
    assert 119 < st.lease_seconds_left <= 120
    r = s.keep_alive()
    assert r.idle_timeout_seconds == 120 and 119 < r.lease_seconds_left <= 120
    assert client.keep_alive(s.id).idle_timeout_seconds == 120
    for bad in (-1, 0.5, float("nan"), 1e12):
        with pytest.raises(kvkeep.InvalidArgument) as e:
            client.create_session("t_f32", "window", budget=8, idle_timeout_seconds=bad)
        assert "idle" in e.value.message
    s.close()
    with pytest.raises(kvkeep.NotFound):
        s.keep_alive()


def test_an_idle_session_expires(make_server):
    server = make_server(config={"session_idle_timeout_seconds": 1})
    c = kvkeep.Client(server.address)
    s = c.create_session("t_f32", "window", budget=8)
    assert s.stats().idle_timeout_seconds == 1
    # Listing does not renew; the poll's limit only guards against a hang.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and s.id in [x.session_id for x in c.list()]:
        time.sleep(0.05)
    with pytest.raises(kvkeep.NotFound) as e:
        s.keep_alive()
    assert "expired" in e.value.message


def test_prefix_publish_start_and_unpublish(client):
    rng = np.random.default_rng(21)
    source = client.create_session("t_f32", "full", budget=64)
    k, v = random_kv(rng, source.layout, 8)
    source.append(k, v, np.arange(8))  # 2 full pages a layer
    info = source.publish("py/system")
    assert (info.tokens, info.pages, info.layout) == (8, 4, "t_f32")
    with pytest.raises(kvkeep.AlreadyExists):
        source.publish("py/system")
    with client.create_session("", "h2o", budget=12, prefix="py/system") as agent:
        assert agent.layout.name == "t_f32"
        assert agent.stats().shared_pages == 4
        assert list(agent.tables.pages(0)) == list(source.tables.pages(0))
        k1, v1 = random_kv(rng, agent.layout, 1)
        agent.append(k1, v1, [8])
        assert_mirror_equals_store(agent)
        np.testing.assert_array_equal(agent.read_kv()[0].keys[:8], k[0])
        assert [p.holders for p in client.list_prefixes()] == [1]
        source.close()
        assert client.unpublish_prefix("py/system") == 1
        with pytest.raises(kvkeep.NotFound):
            client.create_session("", "full", budget=64, prefix="py/system")
        assert client.list_prefixes()[0].published is False
    assert client.list_prefixes() == []
    with pytest.raises(kvkeep.InvalidArgument):
        client.create_session("", "h2o", budget=4, prefix="a bad name")


def test_fork_shares_pages_and_copies_on_write(client):
    rng = np.random.default_rng(18)
    with client.create_session("t_f32", "h2o", budget=32, sinks=1, recent=2) as parent:
        k, v = random_kv(rng, parent.layout, 6)
        parent.append(k, v, np.arange(6))  # 4 tokens a page: 2 pages a layer
        with parent.fork(idempotency_key="branch-a") as child:
            assert child.layer_budgets == parent.layer_budgets
            assert child.stats().shared_pages == 4
            assert list(child.tables.pages(0)) == list(parent.tables.pages(0))
            k1, v1 = random_kv(rng, child.layout, 1)
            r = child.append(k1, v1, [6])  # into the shared, partly filled page
            copied = r.layers[0].pages_copied
            assert [(c.index, c.from_page) for c in copied] == \
                [(1, parent.tables.pages(0)[1])]
            assert_mirror_equals_store(child)
            assert child.stats().shared_pages == 2
            mine, theirs = child.read_kv(), parent.read_kv()
            for l in range(2):
                np.testing.assert_array_equal(mine[l].keys[:6], theirs[l].keys)
                np.testing.assert_array_equal(mine[l].keys[6:], k1[l])
            # Another policy and budget for a second child.
            with parent.fork("window", budget=4) as small:
                assert small.layer_budgets == [4, 4]
                assert small.policy.name == "window"
                k2, v2 = random_kv(rng, small.layout, 1)
                small.append(k2, v2, [6])
                assert list(small.tables.positions(0)) == [3, 4, 5, 6]
                assert_mirror_equals_store(small)
        with pytest.raises(kvkeep.InvalidArgument):
            parent.fork(budget=0)
        np.testing.assert_array_equal(parent.read_kv()[0].keys, k[0])


def test_watch_events_resumes_after_a_reconnect(client):
    # Only session starts and closes: other tests' summaries stay out.
    kinds = [pb.EVENT_SESSION_CREATED, pb.EVENT_SESSION_FORKED, pb.EVENT_SESSION_CLOSED]
    watch = client.watch_events(kinds).start()
    first = watch.last_sequence
    a = client.create_session("t_f32", "window", budget=8)
    b = a.fork()
    events = iter(watch)
    seen = [next(events), next(events)]
    assert [(e.kind, e.session.session_id) for e in seen] == [
        (pb.EVENT_SESSION_CREATED, a.id), (pb.EVENT_SESSION_FORKED, b.id)]
    assert first < seen[0].sequence < seen[1].sequence == watch.last_sequence
    watch.cancel()
    b.close()  # while nobody watches
    resumed = iter(watch)
    e = next(resumed)
    assert (e.kind, e.session.session_id) == (pb.EVENT_SESSION_CLOSED, b.id)
    assert e.sequence > seen[1].sequence
    a.close()
    e = next(resumed)
    assert (e.kind, e.session.session_id) == (pb.EVENT_SESSION_CLOSED, a.id)
    watch.cancel()
    stale = client.watch_events(after_sequence=e.sequence + 100)
    with pytest.raises(kvkeep.OutOfRange):
        stale.start()
