"""kvkeep.Fleet against three real kvkeepd replicas (docs/fleet.md):
placement by free pages, routing by id, a move and the redirect an old
handle follows, a killed replica named in the error."""

from __future__ import annotations

import numpy as np
import pytest

import kvkeep

from helpers import assert_mirror_equals_store, random_kv, reduced_rows

QUICK = kvkeep.Options(deadline=10, retries=1, backoff=0.05, max_backoff=0.1)


def _fill(session, rng, n: int, start: int = 0) -> None:
    k, v = random_kv(rng, session.layout, n)
    session.append_prefill(k, v, np.arange(start, start + n))


def test_placement_by_free_pages(fleet_servers):
    rng = np.random.default_rng(1)
    fleet = kvkeep.Fleet([s.address for s in fleet_servers.values()],
                         placement_staleness=0)
    assert fleet.replicas() == ["fleet-a", "fleet-b", "fleet-c"]
    a = fleet.create_session("t_f32", "full", replica="fleet-a")
    b = fleet.create_session("t_f32", "full", replica="fleet-b")
    assert a.id.startswith("fleet-a.") and b.id.startswith("fleet-b.")
    _fill(a, rng, 40)
    _fill(b, rng, 20)
    placed = fleet.create_session("t_f32", "full")  # the empty one
    assert placed.id.startswith("fleet-c."), placed.id
    _fill(placed, rng, 60)
    assert fleet.create_session("t_f32", "full").id.startswith("fleet-b.")  # emptier
    with pytest.raises(kvkeep.NotFound, match="no reachable replica of the fleet "
                                              "serves layout 'nope'"):
        fleet.create_session("nope", "full")
    with pytest.raises(kvkeep.NotFound, match="replica fleet-z is not in the fleet"):
        fleet.create_session("t_f32", "full", replica="fleet-z")


def test_placement_numbers_are_at_most_the_staleness_old(fleet_servers):
    rng = np.random.default_rng(2)
    # Read once when connecting; an hour's staleness keeps those numbers.
    fleet = kvkeep.Fleet([s.address for s in fleet_servers.values()],
                         placement_staleness=3600)
    first = fleet.create_session("t_f32", "full")
    assert first.id.startswith("fleet-a.")  # all empty: the first name
    _fill(first, rng, 40)
    assert fleet.create_session("t_f32", "full").id.startswith("fleet-a.")  # stale
    fleet.refresh()
    assert fleet.create_session("t_f32", "full").id.startswith("fleet-b.")


def test_routing_by_id(fleet_servers):
    rng = np.random.default_rng(3)
    addresses = [s.address for s in fleet_servers.values()]
    fleet = kvkeep.Fleet(addresses)
    made = {name: fleet.create_session("t_f16", "h2o", 8, replica=name, recent=2)
            for name in fleet.replicas()}
    other = kvkeep.Fleet(list(reversed(addresses)))  # another client, by id only
    for name, s in made.items():
        assert other.route(s.id) == name
        opened = other.open_session(s.id)
        _fill(opened, rng, 5)
        assert list(fleet.stats(s.id).layer_resident) == [5, 5]
        assert_mirror_equals_store(opened)
        for elsewhere in set(fleet_servers) - {name}:  # only the owner holds it
            with pytest.raises(kvkeep.NotFound):
                kvkeep.Client(fleet_servers[elsewhere].address).stats(s.id)
        assert other.close(s.id) == 4  # 2 pages a layer
    key = made["fleet-a"].id.split(".")[1]
    with pytest.raises(kvkeep.FailedPrecondition, match="names no replica"):
        fleet.route(key)
    with pytest.raises(kvkeep.NotFound, match="replica fleet-z, which is not in the "
                                              "fleet"):
        fleet.open_session("fleet-z." + key)
    with pytest.raises(kvkeep.InvalidArgument, match="not a kvkeep session id"):
        fleet.route("fleet-a.XYZ")
    with pytest.raises(kvkeep.InvalidArgument, match="a DNS label"):
        fleet.route("Fleet_A." + key)


def test_a_fleet_needs_distinct_replicas(fleet_servers, make_server):
    # (An unnamed replica cannot be had from kvkeepd: it takes its host's name.)
    twin = make_server(extra=["--replica_name=fleet-a"])
    with pytest.raises(kvkeep.InvalidArgument, match="two replicas call themselves "
                                                     "'fleet-a'"):
        kvkeep.Fleet([fleet_servers["fleet-a"].address, twin.address])
    with pytest.raises(kvkeep.InvalidArgument, match="no targets"):
        kvkeep.Fleet([])
    one = kvkeep.Fleet([fleet_servers["fleet-a"].address])
    assert one.route("0123456789abcdef") == "fleet-a"  # a bare key: the only replica


def test_discovery_through_one_resolved_target(fleet_servers):
    target = "ipv4:" + ",".join(s.address for s in fleet_servers.values())
    fleet = kvkeep.Fleet(target)
    assert fleet.replicas() == ["fleet-a", "fleet-b", "fleet-c"]
    s = fleet.create_session("t_f32", "full", replica="fleet-b")
    assert fleet.replica("fleet-b").address == fleet_servers["fleet-b"].address
    assert fleet.open_session(s.id).stats().session_id == s.id


def test_a_moved_session_is_followed_by_old_handles(fleet_servers):
    rng = np.random.default_rng(4)
    fleet = kvkeep.Fleet([s.address for s in fleet_servers.values()])
    lay = fleet.replica("fleet-a").layout("t_f32")
    s = fleet.create_session("t_f32", "h2o", 24, replica="fleet-a", sinks=2, recent=4)
    k, v = random_kv(rng, lay, 30)
    s.append_prefill(k, v, np.arange(30))
    sent = {p: (k[:, p], v[:, p]) for p in range(30)}
    s.score(kvkeep.reduced([reduced_rows(rng, lay, 30)[0]] * 2))
    unary, prefill, decode = (fleet.open_session(s.id) for _ in range(3))
    moved = fleet.replica("fleet-a").transfer(s.id, fleet_servers["fleet-b"].address)
    assert moved.session_id == "fleet-b." + s.id.split(".")[1]
    with pytest.raises(kvkeep.NotFound, match="moved to replica fleet-b"):
        kvkeep.Client(fleet_servers["fleet-a"].address).stats(s.id)  # no fleet: no follow
    # Each handle made before the move follows it on its next call.
    assert list(unary.stats().layer_resident) == [24, 24]
    assert unary._c.replica == "fleet-b"
    k3, v3 = random_kv(rng, lay, 1)
    with decode.decode() as stream:  # the stream's first step follows
        stream.step((k3, v3, 30), kvkeep.reduced([reduced_rows(rng, lay, 25)[0]] * 2))
        sent[30] = (k3[:, 0], v3[:, 0])
    assert decode._c.replica == "fleet-b"
    assert_mirror_equals_store(decode)  # on the new replica's pages
    k2, v2 = random_kv(rng, lay, 3)
    chunks = prefill.append_prefill(k2, v2, [31, 32, 33])
    sent.update({31 + i: (k2[:, i], v2[:, i]) for i in range(3)})
    assert chunks[-1].layers[0].resident == 27 and prefill._c.replica == "fleet-b"
    assert_mirror_equals_store(prefill)  # reloaded at the move, decode's step in it
    for layer in fleet.open_session(moved.session_id).read_kv():  # byte-exact
        for slot, p in enumerate(layer.positions):
            assert layer.keys[slot].tobytes() == sent[p][0][layer.layer].tobytes()
            assert layer.values[slot].tobytes() == sent[p][1][layer.layer].tobytes()
    assert fleet.stats(s.id).session_id == moved.session_id  # the old id, followed
    assert fleet.close(s.id) > 0


def test_a_killed_replica_is_named_and_the_others_serve_on(fleet_servers):
    rng = np.random.default_rng(5)
    fleet = kvkeep.Fleet([s.address for s in fleet_servers.values()],
                         options=QUICK, placement_staleness=0)
    doomed = fleet.create_session("t_f32", "full", replica="fleet-c")
    alive = fleet.create_session("t_f32", "full", replica="fleet-a")
    _fill(doomed, rng, 4)
    streaming = fleet.open_session(doomed.id)
    fleet_servers["fleet-c"].kill()
    where = f"replica fleet-c at {fleet_servers['fleet-c'].address}"
    with pytest.raises(kvkeep.Unavailable, match=f"GetSessionStats to {where} failed"):
        doomed.stats()
    k, v = random_kv(rng, doomed.layout, 1)
    with pytest.raises(kvkeep.Unavailable, match=where):
        doomed.append(k, v, [4])
    with pytest.raises(kvkeep.Unavailable, match=where):
        streaming.step((k, v, 4))
    _fill(alive, rng, 8)
    assert alive.step((k, v, 8)).append.layers[0].resident == 9
    for _ in range(3):  # placement skips the dead replica
        assert not fleet.create_session("t_f32", "full").id.startswith("fleet-c.")


def test_two_moves_between_calls_and_a_replica_joined_since(fleet_servers):
    rng = np.random.default_rng(6)
    a, b, c = (fleet_servers[n].address for n in ("fleet-a", "fleet-b", "fleet-c"))
    fleet = kvkeep.Fleet([a, b])  # fleet-c joined after this client looked
    s = fleet.create_session("t_f32", "full", replica="fleet-a")
    _fill(s, rng, 6)
    first = fleet.replica("fleet-a").transfer(s.id, b)
    kvkeep.Client(b).transfer(first.session_id, c)
    # One move is followed per call (as the C++ client): fleet-b names the
    # second, which this call does not follow...
    with pytest.raises(kvkeep.NotFound, match="moved to replica fleet-c") as e:
        s.stats()
    assert e.value.method == "GetSessionStats"
    assert not s.in_sync  # its tables are not reloaded yet
    # ...and the next call does, to fleet-c at the address fleet-b sent it to.
    assert list(s.stats().layer_resident) == [6, 6]
    assert (s._c.replica, s._c.address) == ("fleet-c", c) and s.in_sync
    _fill(s, rng, 2, start=6)
    assert_mirror_equals_store(s)
    assert kvkeep.Client(c).stats(s.id).resident_tokens == 16


def test_each_handle_follows_its_own_session(fleet_servers):
    rng = np.random.default_rng(7)
    fleet = kvkeep.Fleet([s.address for s in fleet_servers.values()])
    parent = fleet.create_session("t_f32", "full", replica="fleet-a")
    _fill(parent, rng, 5)
    child = parent.fork()  # stays on fleet-a when its parent moves
    fleet.replica("fleet-a").transfer(parent.id, fleet_servers["fleet-b"].address)
    assert list(parent.stats().layer_resident) == [5, 5]
    assert parent._c.replica == "fleet-b"
    _fill(child, rng, 1, start=5)
    assert child._c.replica == "fleet-a"
    assert list(child.stats().layer_resident) == [6, 6]
    assert_mirror_equals_store(child)
    assert_mirror_equals_store(parent)
