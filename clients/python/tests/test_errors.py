"""Errors: one exception class per gRPC code, with the server's message."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import kvkeep
from kvkeep import pb

from helpers import random_kv, reduced_rows


def test_policy_params_checked_against_server_info(client):
    cases = [
        (dict(sink=4), "has no parameter 'sink'"),           # a typo
        (dict(sinks=-1), "sinks=-1 is not sinks"),           # out of range
        (dict(sinks=2.5), "is not sinks"),                   # not an int
        (dict(sinks=True), "is not sinks"),
        (dict(sinks="four"), "is not sinks"),
    ]
    before = len(client.list())
    for params, text in cases:
        with pytest.raises(kvkeep.InvalidArgument) as e:
            client.create_session("t_f32", "h2o", 16, **params)
        assert e.value.client_side and text in e.value.message, e.value.message
    with pytest.raises(kvkeep.InvalidArgument) as e:
        client.create_session("t_f32", "snapkv", 16, pooling="median")
    assert "one of avgpool, maxpool" in e.value.message
    with pytest.raises(kvkeep.InvalidArgument) as e:
        client.create_session("t_f32", "lru", 16)
    assert "unknown policy 'lru'" in e.value.message
    with pytest.raises(kvkeep.NotFound) as e:
        client.create_session("nope", "h2o", 16)
    assert "layout 'nope'" in e.value.message
    assert len(client.list()) == before  # nothing was created
    # Text, ints and floats all become the server's text.
    with client.create_session("t_f32", "scissorhands", 16, history="8",
                               threshold=0.5, sinks=np.int64(1)) as s:
        assert s.policy.name == "scissorhands"


def test_server_refusals_carry_its_message(client):
    # The budget rule is the server's: its message names the policy.
    with pytest.raises(kvkeep.InvalidArgument) as e:
        client.create_session("t_f32", "h2o", 4, sinks=4, recent=4)
    assert not e.value.client_side
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "policy 'h2o'" in e.value.message and e.value.method == "CreateSession"
    # kernel must be odd: a rule in words, checked by the server.
    with pytest.raises(kvkeep.InvalidArgument) as e:
        client.create_session("t_f32", "snapkv", 16, kernel=4)
    assert "odd" in e.value.message and not e.value.client_side
    lay = client.layout("t_f32")
    rng = np.random.default_rng(0)
    with client.create_session("t_f32", "h2o", 16) as s:
        k, v = random_kv(rng, lay, 4)
        s.append(k, v, np.arange(4))
        with pytest.raises(kvkeep.InvalidArgument) as e:  # positions must increase
            s.append(k, v, np.arange(4))
        assert s.id in e.value.message and not e.value.client_side
        # Rows summing to more than query_heads: the server's check.
        with pytest.raises(kvkeep.InvalidArgument) as e:
            s.score(kvkeep.reduced([np.full(4, 2.0, np.float32)] * 2))
        assert not e.value.client_side
        assert s.in_sync  # a refusal changed nothing
        s.score(kvkeep.reduced([reduced_rows(rng, lay, 4)[0]] * 2))


def test_client_side_score_checks(client):
    lay = client.layout("t_f32")
    rng = np.random.default_rng(1)
    with client.create_session("t_f32", "window", 8) as s:
        k, v = random_kv(rng, lay, 4)
        s.append(k, v, np.arange(4))
        with pytest.raises(kvkeep.FailedPrecondition) as e:
            s.score(kvkeep.reduced([reduced_rows(rng, lay, 4)[0]] * 2))
        assert e.value.client_side and "takes no scores" in e.value.message
    with client.create_session("t_f32", "h2o", 8) as s:
        s.append(k, v, np.arange(4))
        for bad, text in [
            (kvkeep.reduced([np.ones(5, np.float32) / 5] * 2), "want [rows][4]"),
            (kvkeep.reduced({5: np.ones(4, np.float32)}), "layer 5"),
            (kvkeep.per_head([np.ones((3, 4), np.float32) / 4] * 2), "want [4][rows][4]"),
            (kvkeep.queries([np.ones((4, 7), np.float32)] * 2), "want [rows][4][8]"),
            (kvkeep.reduced([np.array([0.5, np.nan, 0, 0], np.float32)] * 2), "not finite"),
            (kvkeep.reduced([np.array([0.5, -0.1, 0, 0], np.float32)] * 2), "negative"),
        ]:
            with pytest.raises(kvkeep.InvalidArgument) as e:
                s.score(bad)
            assert e.value.client_side and text in e.value.message, e.value.message
    with client.create_session("t_pre_rope", "h2o", 8) as s:
        s.append(k, v, np.arange(4))
        with pytest.raises(kvkeep.FailedPrecondition) as e:
            s.score(kvkeep.queries([np.ones((4, 8), np.float32)] * 2))
        assert "before RoPE" in e.value.message


def test_stale_version(client):
    lay = client.layout("t_f32")
    rng = np.random.default_rng(2)
    with client.create_session("t_f32", "h2o", 8, recent=2) as s:
        k, v = random_kv(rng, lay, 6)
        s.append(k, v, np.arange(6))
        other = client.open_session(s.id)  # a second handle, then s moves on
        k, v = random_kv(rng, lay, 1)
        s.append(k, v, [6])
        with pytest.raises(kvkeep.StaleVersion) as e:
            other.score(kvkeep.reduced([np.zeros(6, np.float32)] * 2))
        assert isinstance(e.value, kvkeep.FailedPrecondition)
        assert "stale version" in e.value.message and s.id in e.value.message
        other.resync()
        other.score(kvkeep.reduced([reduced_rows(rng, lay, 7)[0]] * 2))


def test_stream_ends_after_an_error_unless_reopen(client):
    lay = client.layout("t_f32")
    rng = np.random.default_rng(3)
    with client.create_session("t_f32", "h2o", 8) as s:
        k, v = random_kv(rng, lay, 3)
        s.append(k, v, np.arange(3))
        stream = s.decode()
        with pytest.raises(kvkeep.InvalidArgument):  # position 1 again: refused
            stream.step(random_kv(rng, lay, 1) + ([1],))
        with pytest.raises(kvkeep.FailedPrecondition) as e:
            stream.step(random_kv(rng, lay, 1) + ([3],))
        assert "has ended" in e.value.message and e.value.client_side
        stream.close()
        with s.decode(reopen=True) as again:
            with pytest.raises(kvkeep.InvalidArgument):
                again.step(random_kv(rng, lay, 1) + ([1],))
            again.step(random_kv(rng, lay, 1) + ([3],))  # a new stream
        # The session's own step() reopens too.
        with pytest.raises(kvkeep.InvalidArgument):
            s.step(random_kv(rng, lay, 1) + ([2],))
        s.step(random_kv(rng, lay, 1) + ([4],))
        assert list(s.tables.positions(0)) == [0, 1, 2, 3, 4]


def test_resource_exhausted_pool_full(client):
    lay = client.layout("t_tiny_pool")  # 8 pages of 4 tokens, 2 layers
    rng = np.random.default_rng(4)
    with client.create_session("t_tiny_pool", "full") as s:
        k, v = random_kv(rng, lay, 16)
        s.append(k, v, np.arange(16))
        with client.create_session("t_tiny_pool", "full") as t:
            with pytest.raises(kvkeep.ResourceExhausted) as e:
                t.append(k, v, np.arange(16))
            assert t.id in e.value.message or "pool" in e.value.message, e.value.message
            assert t.stats().resident_tokens == 0 and t.in_sync


def test_unknown_session(client):
    with pytest.raises(kvkeep.NotFound) as e:
        client.block_tables("0000000000000001")
    assert "0000000000000001" in e.value.message
    with pytest.raises(kvkeep.NotFound):
        client.close("0000000000000001")


def test_tenants_permission_and_authentication(make_server, tmp_path):
    srv = make_server(config={"tenants": [{"name": "a", "token": "tok-a"},
                                          {"name": "b", "token": "tok-b"}]})
    a = kvkeep.Client(srv.address, token="tok-a")
    b = kvkeep.Client(srv.address, token="tok-b")
    with pytest.raises(kvkeep.Unauthenticated):
        kvkeep.Client(srv.address).info()
    with pytest.raises(kvkeep.Unauthenticated):
        kvkeep.Client(srv.address, token="wrong").list()
    s = a.create_session("t_f32", "full")
    assert s.stats().tenant == "a"
    # Another tenant's session answers as one that does not exist.
    with pytest.raises(kvkeep.NotFound) as e:
        b.stats(s.id)
    assert s.id in e.value.message
    with pytest.raises(kvkeep.NotFound) as missing:
        b.stats("00000000000000a1")
    assert (e.value.message.replace(s.id, "ID") ==
            missing.value.message.replace("00000000000000a1", "ID"))
    assert [x.session_id for x in b.list()] == []
    assert [x.session_id for x in a.list()] == [s.id]
    s.close()


def test_mirror_refuses_a_result_that_does_not_fit(client):
    lay = client.layout("t_f32")
    rng = np.random.default_rng(5)
    with client.create_session("t_f32", "window", 4) as s, \
            client.create_session("t_f32", "window", 4) as t:
        k, v = random_kv(rng, lay, 6)
        r = s.append(k, v, np.arange(6))  # evicts 2, moves slots
        before = t.tables.tables()
        with pytest.raises(kvkeep.InvalidArgument):
            t.tables.apply(r, np.arange(6)[:1])  # another session's result
        assert t.tables.tables() == before
        with pytest.raises(kvkeep.InvalidArgument):
            s.tables.apply(pb.StepResult(layers=[pb.LayerChange(layer=0)]))
        assert t.tables.diff(t.block_tables()) is None
