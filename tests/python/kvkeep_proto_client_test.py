#!/usr/bin/python3
"""A kvkeep client in Python, written from proto/kvkeep/v1/kvkeep.proto alone.

This is the "clients in other languages" check: it generates Python stubs
from the .proto at test time (nothing from the C++ build), starts a real
kvkeepd on an ephemeral loopback port with a small f32 layout, and drives it
the way a worker would: prefill, a Decode stream with head-reduced
probabilities computed here, a block-table mirror kept only from the
LayerChange replies (in the order the .proto documents), an H2O replica that
predicts every eviction, and a byte-exact ReadKv. kvkeepd runs with
--share_pools, so the test also maps the layout's host pool the way a
same-machine worker would (MapPool: the POSIX shared-memory name, opened
read-only with mmap) and checks that every slot the returned block tables
name holds, at the offsets the .proto's page geometry gives, exactly the
keys and values sent for that position (and what ReadKv returns); MapPool
with neither layout nor session is INVALID_ARGUMENT, an unknown layout
NOT_FOUND.

Usage:
  kvkeep_proto_client_test.py --kvkeepd PATH --proto_dir DIR [unittest args]
  (or the environment variables KVKEEPD and KVKEEP_PROTO_DIR)

Needs the Debian python3-grpcio and python3-protobuf (no numpy), protoc and
grpc_python_plugin.
"""

import argparse
import ctypes
import json
import mmap
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import unittest

import grpc

ARGS = None  # the parsed command line, set in __main__
pb = None  # kvkeep.v1.kvkeep_pb2, generated in setUpModule
pb_grpc = None  # kvkeep.v1.kvkeep_pb2_grpc

# The layout kvkeepd serves in these tests: small enough that every byte and
# every eviction can be checked by hand.
LAYOUT = {
    "name": "py_f32",
    "num_layers": 2,
    "kv_heads": 2,
    "query_heads": 4,
    "head_dim": 8,
    "dtype": "f32",
    "page_tokens": 4,
    "pool_pages": 64,
}
F32_BYTES = 4
TOKEN_ELEMS = LAYOUT["kv_heads"] * LAYOUT["head_dim"]  # per layer, K or V
# The server's smallest allowed message limit, so that ReadKv has to split a
# layer over several chunks (KvChunk.first_slot is then exercised).
MAX_MESSAGE_BYTES = 4096

_tmp = None  # temp dir holding the stubs and the config
_server = None  # the kvkeepd subprocess
_address = None  # "127.0.0.1:PORT" it printed
_stdout_lines = []  # everything kvkeepd printed, for failure messages
_shm_paths = set()  # /dev/shm files MapPool named: gone once kvkeepd exits


def _generate_stubs(out_dir):
    os.makedirs(out_dir)
    plugin = ARGS.grpc_python_plugin
    cmd = [
        ARGS.protoc,
        "-I",
        ARGS.proto_dir,
        "--python_out=" + out_dir,
        "--grpc_python_out=" + out_dir,
        "--plugin=protoc-gen-grpc_python=" + plugin,
        "kvkeep/v1/kvkeep.proto",
    ]
    subprocess.run(cmd, check=True)
    sys.path.insert(0, out_dir)
    global pb, pb_grpc
    # Generated modules live in kvkeep/v1/ (namespace packages: protoc writes
    # no __init__.py, and Python 3 needs none).
    from kvkeep.v1 import kvkeep_pb2 as generated_pb2
    from kvkeep.v1 import kvkeep_pb2_grpc as generated_pb2_grpc

    pb = generated_pb2
    pb_grpc = generated_pb2_grpc


def _die_with_parent():
    """In the child before exec: SIGKILL it if this test process dies, so
    that a crashed or killed test leaves no kvkeepd behind (Linux only)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _start_server(config_path):
    cmd = [
        ARGS.kvkeepd,
        "--listen=127.0.0.1:0",
        "--metrics_listen=127.0.0.1:0",
        "--self_check=false",
        "--drain_seconds=2",
        "--share_pools",  # host pools in POSIX shared memory (MapPool)
        "--config=" + config_path,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_die_with_parent,
    )
    prefix = "kvkeepd: grpc listening on "
    address = None
    for line in proc.stdout:
        _stdout_lines.append(line)
        if line.startswith(prefix):
            address = line[len(prefix) :].strip()
            break
    if address is None:
        proc.wait()
        raise RuntimeError(
            "kvkeepd exited (%s) without printing its address:\n%s"
            % (proc.returncode, "".join(_stdout_lines))
        )

    # Keep draining its output so it never blocks on a full pipe.
    def drain():
        for rest in proc.stdout:
            _stdout_lines.append(rest)

    threading.Thread(target=drain, daemon=True).start()
    return proc, address


def setUpModule():
    global _tmp, _server, _address
    _tmp = tempfile.mkdtemp(prefix="kvkeep_py_")
    _generate_stubs(os.path.join(_tmp, "stubs"))
    config_path = os.path.join(_tmp, "kvkeepd.json")
    with open(config_path, "w") as f:
        json.dump(
            {
                "layouts": [LAYOUT],
                "limits": {"max_message_bytes": MAX_MESSAGE_BYTES},
            },
            f,
        )
    _server, _address = _start_server(config_path)


def tearDownModule():
    try:
        if _server is not None and _server.poll() is None:
            _server.terminate()  # SIGTERM: kvkeepd drains and exits 0
            try:
                rc = _server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _server.kill()
                _server.wait()
                raise AssertionError("kvkeepd did not stop on SIGTERM")
            if rc != 0:
                raise AssertionError(
                    "kvkeepd exited %d on SIGTERM:\n%s" % (rc, "".join(_stdout_lines))
                )
            # A pool's shared-memory object lives only as long as kvkeepd.
            left = sorted(p for p in _shm_paths if os.path.exists(p))
            if left:
                raise AssertionError("kvkeepd left %s behind" % left)
    finally:
        if _tmp is not None:
            shutil.rmtree(_tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# Helpers a Python worker would write.


def f32_bytes(values):
    """Little-endian float32 bytes, as the .proto's Conventions say."""
    return struct.pack("<%df" % len(values), *values)


def token_kv(layer, position):
    """Distinct, exactly representable K and V for (layer, position)."""
    keys = [layer * 1000.0 + position + i / 16.0 for i in range(TOKEN_ELEMS)]
    values = [-(layer * 1000.0 + position) - i / 32.0 for i in range(TOKEN_ELEMS)]
    return f32_bytes(keys), f32_bytes(values)


def append_request(positions, session_id=""):
    req = pb.AppendRequest(session_id=session_id, positions=positions)
    for layer in range(LAYOUT["num_layers"]):
        keys = b""
        values = b""
        for p in positions:
            k, v = token_kv(layer, p)
            keys += k
            values += v
        req.layers.add(keys=keys, values=values)
    return req


class LayerMirror:
    """One layer's block table, kept from LayerChange replies only."""

    def __init__(self):
        self.pages = []  # the page list
        self.positions = []  # per slot: original position
        self.version = 0

    def apply(self, change, new_positions):
        """Follows `change` in the .proto's documented order.

        new_positions: the positions the call appended (empty for scores).
        """
        # 1. apply the moves in order.
        for move in change.moves:
            self.positions[move.to_slot] = self.positions[move.from_slot]
        # 2. keep slots [0, resident - k); drop pages_freed from the end.
        evicted = set(change.evicted_positions)
        kept_new = sorted(p for p in new_positions if p not in evicted)
        k = len(kept_new)
        del self.positions[change.resident - k :]
        freed = list(change.pages_freed)
        if freed:
            tail = self.pages[len(self.pages) - len(freed) :]
            if sorted(tail) != sorted(freed):
                raise AssertionError(
                    "pages_freed %s are not the tail %s of %s"
                    % (freed, tail, self.pages)
                )
            del self.pages[len(self.pages) - len(freed) :]
        # 3. append pages_added; the kept new tokens take the last slots.
        self.pages.extend(change.pages_added)
        self.positions.extend(kept_new)
        self.version = change.version
        if len(self.positions) != change.resident:
            raise AssertionError(
                "mirror holds %d slots, the reply says %d resident"
                % (len(self.positions), change.resident)
            )


class H2OReplica:
    """H2O as docs/policies.md states it, for one layer (slack 0).

    A token's score is the attention it received, summed over heads and
    steps (its own step included); over budget, the unprotected token with
    the lowest score goes, the older first on ties. Sinks are the first
    `sinks` positions, recent the `recent` newest.
    """

    def __init__(self, budget, sinks, recent):
        self.budget = budget
        self.sinks = sinks
        self.recent = recent
        self.score = {}  # position -> accumulated attention
        self.evicted_score = 0.0

    def append(self, position):
        self.score[position] = 0.0

    def attend(self, attention):
        """attention: position -> this step's head-summed probability."""
        for p, a in attention.items():
            self.score[p] += a
        evicted = []
        while len(self.score) > self.budget:
            order = sorted(self.score)
            protected = set(order[: self.sinks])
            if self.recent:
                protected |= set(order[-self.recent :])
            victim = min(
                (p for p in order if p not in protected),
                key=lambda p: (self.score[p], p),
            )
            self.evicted_score += self.score.pop(victim)
            evicted.append(victim)
        return sorted(evicted)


class DecodeStream:
    """A lock-step view of the bidirectional Decode stream."""

    def __init__(self, stub, metadata=None):
        self._requests = queue.Queue()
        self._call = stub.Decode(iter(self._requests.get, None), metadata=metadata)

    def step(self, request):
        self._requests.put(request)
        try:
            return next(self._call)  # raises grpc.RpcError with the status
        except grpc.RpcError:
            self._requests.put(None)  # lets gRPC's request thread end
            raise

    def close(self):
        self._requests.put(None)  # half-close
        for _ in self._call:
            raise AssertionError("a reply after the last step")
        return self._call.code()


def read_kv(stub, session_id):
    """ReadKv reassembled: ({layer: (version, positions, keys, values)},
    the number of chunks)."""
    out = {}
    chunks = 0
    for chunk in stub.ReadKv(pb.ReadKvRequest(session_id=session_id)):
        version, positions, keys, values = out.get(chunk.layer, (None, [], b"", b""))
        if version is not None and version != chunk.version:
            raise AssertionError("one layer's chunks at two versions")
        if chunk.first_slot != len(positions):
            raise AssertionError(
                "layer %d chunk starts at slot %d, expected %d"
                % (chunk.layer, chunk.first_slot, len(positions))
            )
        out[chunk.layer] = (
            chunk.version,
            positions + list(chunk.positions),
            keys + chunk.keys,
            values + chunk.values,
        )
        chunks += 1
    return out, chunks


# ---------------------------------------------------------------------------


class ProtoClientTest(unittest.TestCase):
    def setUp(self):
        self.channel = grpc.insecure_channel(_address)
        self.stub = pb_grpc.KvKeepStub(self.channel)
        self.sessions = []

    def tearDown(self):
        for sid in self.sessions:
            try:
                self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            except grpc.RpcError:
                pass  # closed by the test itself
        self.channel.close()

    def create_h2o(self, budget, sinks, recent):
        resp = self.stub.CreateSession(
            pb.CreateSessionRequest(
                layout=LAYOUT["name"],
                policy="h2o",
                policy_params={"sinks": str(sinks), "recent": str(recent)},
                budget=pb.Budget(tokens=budget),
            )
        )
        self.sessions.append(resp.session_id)
        return resp

    def test_server_info_describes_the_configured_layout(self):
        info = self.stub.GetServerInfo(pb.GetServerInfoRequest())
        self.assertTrue(info.version)
        self.assertEqual(info.backend, "host")
        self.assertIn("h2o", info.policies)
        self.assertEqual(info.max_message_bytes, MAX_MESSAGE_BYTES)
        self.assertEqual([l.name for l in info.layouts], [LAYOUT["name"]])
        layout = info.layouts[0]
        self.assertEqual(layout.num_layers, LAYOUT["num_layers"])
        self.assertEqual(layout.kv_heads, LAYOUT["kv_heads"])
        self.assertEqual(layout.query_heads, LAYOUT["query_heads"])
        self.assertEqual(layout.head_dim, LAYOUT["head_dim"])
        self.assertEqual(layout.dtype, pb.DTYPE_F32)
        self.assertEqual(layout.page_tokens, LAYOUT["page_tokens"])
        # 2 (K, V) * page_tokens * kv_heads * head_dim * 4 bytes.
        page_bytes = 2 * LAYOUT["page_tokens"] * TOKEN_ELEMS * F32_BYTES
        self.assertEqual(layout.page_bytes, page_bytes)
        self.assertEqual(len(info.pools), 1)
        self.assertEqual(info.pools[0].layout, LAYOUT["name"])
        self.assertEqual(info.pools[0].capacity_pages, LAYOUT["pool_pages"])
        self.assertEqual(info.pools[0].page_bytes, page_bytes)

    def prefill_and_decode(self, budget, sinks, recent, steps, seed):
        """Creates an h2o session, prefills 8 tokens and decodes `steps` more,
        checking every reply against the mirrors and the H2O replicas.

        Returns (session_id, mirrors, replicas, evictions, moves, pages_freed).
        """
        created = self.create_h2o(budget, sinks, recent)
        sid = created.session_id
        # "<replica>.<key>" (kvkeepd names itself after the host by default)
        self.assertRegex(sid, r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)?[0-9a-f]{16}$")
        layers = LAYOUT["num_layers"]
        self.assertEqual(list(created.layer_budgets), [budget] * layers)
        mirrors = [LayerMirror() for _ in range(layers)]
        replicas = [H2OReplica(budget, sinks, recent) for _ in range(layers)]
        for l in range(layers):
            mirrors[l].version = created.layer_versions[l]

        # Prefill 8 tokens in two chunks (client streaming): under budget,
        # so nothing is evicted.
        chunks = [append_request([0, 1, 2], sid), append_request([3, 4, 5, 6, 7])]
        prefill = self.stub.AppendPrefill(iter(chunks))
        self.assertEqual(len(prefill.chunks), 2)
        for chunk, result in zip(chunks, prefill.chunks):
            self.assertEqual(len(result.layers), layers)
            for l, change in enumerate(result.layers):
                self.assertEqual(change.layer, l)
                self.assertEqual(list(change.evicted_positions), [])
                mirrors[l].apply(change, list(chunk.positions))
                for p in chunk.positions:
                    replicas[l].append(p)

        # The decode steps, each appending one token and scoring it.
        rng = random.Random(seed)
        stream = DecodeStream(self.stub)
        evictions = moves = pages_freed = 0
        for step in range(steps):
            position = 8 + step
            request = pb.DecodeStep(append=append_request([position]))
            if step == 0:
                request.session_id = sid
            attention = []  # per layer: position -> head-summed probability
            for l in range(layers):
                # Attention covers the slots after the append: the mirror's
                # slots plus the new token in the next slot. Multiples of
                # 1/64 keep every float32 sum exact, so the replica's
                # comparisons match the server's bit for bit. Row sum
                # <= 13 * 19 / 64 < query_heads.
                slots = mirrors[l].positions + [position]
                row = [rng.randrange(20) / 64.0 for _ in slots]
                attention.append(dict(zip(slots, row)))
                request.scores.add(
                    layer=l,
                    version=mirrors[l].version,  # BEFORE the append
                    reduced=pb.ReducedProbabilities(rows=1, values=row),
                )
            reply = stream.step(request)
            self.assertEqual(len(reply.append.layers), layers)
            self.assertEqual(len(reply.scores.layers), layers)
            for l in range(layers):
                appended = reply.append.layers[l]
                self.assertEqual(list(appended.evicted_positions), [])
                mirrors[l].apply(appended, [position])
                replicas[l].append(position)
                expected = replicas[l].attend(attention[l])
                scored = reply.scores.layers[l]
                self.assertEqual(
                    list(scored.evicted_positions),
                    expected,
                    "step %d layer %d" % (step, l),
                )
                mirrors[l].apply(scored, [])
                self.assertEqual(
                    sorted(mirrors[l].positions), sorted(replicas[l].score)
                )
                evictions += len(scored.evicted_positions)
                moves += len(scored.moves)
                pages_freed += len(scored.pages_freed)
        self.assertEqual(stream.close(), grpc.StatusCode.OK)
        return sid, mirrors, replicas, evictions, moves, pages_freed

    def test_h2o_decode_stream_mirrors_block_tables_and_reads_kv_back(self):
        budget, sinks, recent = 12, 2, 4
        layers = LAYOUT["num_layers"]
        sid, mirrors, replicas, evictions, moves, pages_freed = (
            self.prefill_and_decode(budget, sinks, recent, 50, seed=20240503)
        )
        # 58 tokens into a budget of 12, one eviction per step per layer
        # once full: 46 per layer.
        self.assertEqual(evictions, layers * (58 - budget))
        # Evictions inside the table moved slots (so slot order is no longer
        # position order, which the mirror must follow) and emptied pages.
        self.assertGreater(moves, 0)
        self.assertGreater(pages_freed, 0)
        for mirror in mirrors:
            self.assertNotEqual(mirror.positions, sorted(mirror.positions))

        # The mirror is the server's block table.
        tables = self.stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid))
        self.assertEqual([t.layer for t in tables.tables], list(range(layers)))
        for l, table in enumerate(tables.tables):
            self.assertEqual(table.version, mirrors[l].version)
            self.assertEqual(table.page_tokens, LAYOUT["page_tokens"])
            self.assertEqual(list(table.pages), mirrors[l].pages)
            self.assertEqual(list(table.positions), mirrors[l].positions)
            ranks = {p: r for r, p in enumerate(sorted(mirrors[l].positions))}
            self.assertEqual(
                list(table.cache_positions), [ranks[p] for p in mirrors[l].positions]
            )
            pages_needed = -(-len(mirrors[l].positions) // LAYOUT["page_tokens"])
            self.assertEqual(len(table.pages), pages_needed)

        stats = self.stub.GetSessionStats(pb.GetSessionStatsRequest(session_id=sid))
        self.assertEqual(stats.policy, "h2o")
        self.assertEqual(stats.resident_tokens, layers * budget)
        self.assertEqual(stats.evicted_tokens, evictions)
        self.assertEqual(list(stats.layer_resident), [budget] * layers)
        self.assertEqual(list(stats.layer_version), [m.version for m in mirrors])
        self.assertEqual(stats.pages, sum(len(m.pages) for m in mirrors))
        self.assertEqual(
            stats.evicted_score, sum(r.evicted_score for r in replicas)
        )

        # ReadKv: every resident token's bytes exactly as appended, in slot
        # order, split over several chunks by the 4 KiB message limit.
        kv, chunks = read_kv(self.stub, sid)
        self.assertEqual(sorted(kv), list(range(layers)))
        self.assertGreater(chunks, layers)
        for l in range(layers):
            version, positions, keys, values = kv[l]
            self.assertEqual(version, mirrors[l].version)
            self.assertEqual(positions, mirrors[l].positions)
            expected_k = b"".join(token_kv(l, p)[0] for p in positions)
            expected_v = b"".join(token_kv(l, p)[1] for p in positions)
            self.assertEqual(keys, expected_k)
            self.assertEqual(values, expected_v)

        closed = self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        self.assertEqual(closed.freed_pages, stats.pages)
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.GetSessionStats(pb.GetSessionStatsRequest(session_id=sid))
        self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_stale_version_is_failed_precondition_and_changes_nothing(self):
        budget = 6
        created = self.create_h2o(budget, sinks=0, recent=0)
        sid = created.session_id
        layers = LAYOUT["num_layers"]
        self.stub.Append(append_request(list(range(budget + 1)), sid))
        # The layers are over budget now (an append alone does not evict
        # under h2o); attention at the creation version is stale.
        before = self.stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid))
        for table in before.tables:
            self.assertNotEqual(table.version, created.layer_versions[table.layer])
        request = pb.DecodeStep(session_id=sid)
        for l in range(layers):
            request.scores.add(
                layer=l,
                version=created.layer_versions[l],
                reduced=pb.ReducedProbabilities(
                    rows=1, values=[1.0 / (budget + 1)] * (budget + 1)
                ),
            )
        stream = DecodeStream(self.stub)
        with self.assertRaises(grpc.RpcError) as err:
            stream.step(request)
        self.assertEqual(err.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("stale version", err.exception.details())
        self.assertIn(sid, err.exception.details())
        after = self.stub.GetBlockTables(pb.GetBlockTablesRequest(session_id=sid))
        self.assertEqual(after, before)

        # The same attention at the current versions is taken and evicts.
        for l in range(layers):
            request.scores[l].version = before.tables[l].version
        stream = DecodeStream(self.stub)
        reply = stream.step(request)
        self.assertEqual(stream.close(), grpc.StatusCode.OK)
        for l in range(layers):
            # All scores equal: the oldest goes first.
            self.assertEqual(list(reply.scores.layers[l].evicted_positions), [0])
            self.assertEqual(reply.scores.layers[l].resident, budget)

    def test_map_pool_shares_the_host_pool_read_only(self):
        budget, sinks, recent = 10, 1, 3
        layers = LAYOUT["num_layers"]
        sid, mirrors, _, evictions, moves, _ = self.prefill_and_decode(
            budget, sinks, recent, 40, seed=7
        )
        # Compaction moved slots, so slot order is not position order: the
        # bytes below must follow the tables, not a guess.
        self.assertEqual(evictions, layers * (48 - budget))
        self.assertGreater(moves, 0)

        mapped = self.stub.MapPool(pb.MapPoolRequest(session_id=sid))
        page_tokens = LAYOUT["page_tokens"]
        token_bytes = TOKEN_ELEMS * F32_BYTES  # one token's K (or V), a layer
        self.assertEqual(mapped.layout.name, LAYOUT["name"])
        self.assertEqual(mapped.layout.page_tokens, page_tokens)
        self.assertEqual(mapped.layout.page_bytes, 2 * page_tokens * token_bytes)
        page_bytes = mapped.layout.page_bytes
        self.assertEqual(mapped.device, "host")
        self.assertEqual(mapped.capacity_pages, LAYOUT["pool_pages"])
        self.assertEqual(mapped.arena_bytes, mapped.capacity_pages * page_bytes)
        self.assertEqual(mapped.WhichOneof("handle"), "shm_name")
        self.assertTrue(mapped.shm_name.startswith("/"), mapped.shm_name)
        self.assertEqual(mapped.server_pid, _server.pid)
        # The tables are the session's, as the mirrors kept them.
        self.assertEqual([t.layer for t in mapped.tables], list(range(layers)))
        for l, table in enumerate(mapped.tables):
            self.assertEqual(table.version, mirrors[l].version)
            self.assertEqual(table.page_tokens, page_tokens)
            self.assertEqual(list(table.pages), mirrors[l].pages)
            self.assertEqual(list(table.positions), mirrors[l].positions)

        # The layout alone maps the same pool, without tables.
        by_layout = self.stub.MapPool(pb.MapPoolRequest(layout=LAYOUT["name"]))
        self.assertEqual(by_layout.shm_name, mapped.shm_name)
        self.assertEqual(by_layout.arena_bytes, mapped.arena_bytes)
        self.assertEqual(len(by_layout.tables), 0)

        # Map it the way a worker on this machine would: shm_open(name,
        # O_RDONLY) is /dev/shm/<name without its leading slash> on Linux.
        path = os.path.join("/dev/shm", mapped.shm_name[1:])
        _shm_paths.add(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            self.assertGreaterEqual(os.fstat(fd).st_size, mapped.arena_bytes)
            arena = mmap.mmap(fd, mapped.arena_bytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping outlives the descriptor
        kv, _ = read_kv(self.stub, sid)
        with arena:
            with self.assertRaises(TypeError):
                arena[0:1] = b"x"  # read-only
            for l, table in enumerate(mapped.tables):
                _, read_positions, read_keys, read_values = kv[l]
                self.assertEqual(read_positions, list(table.positions))
                for slot, position in enumerate(table.positions):
                    page = table.pages[slot // page_tokens]
                    self.assertLess(page, mapped.capacity_pages)
                    k_at = page * page_bytes + (slot % page_tokens) * token_bytes
                    v_at = k_at + page_tokens * token_bytes
                    keys = arena[k_at : k_at + token_bytes]
                    values = arena[v_at : v_at + token_bytes]
                    sent_k, sent_v = token_kv(l, position)
                    where = "layer %d slot %d position %d" % (l, slot, position)
                    self.assertEqual(keys, sent_k, where)
                    self.assertEqual(values, sent_v, where)
                    one = slice(slot * token_bytes, (slot + 1) * token_bytes)
                    self.assertEqual(keys, read_keys[one], where)
                    self.assertEqual(values, read_values[one], where)

    def test_map_pool_needs_a_known_layout_or_a_session(self):
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.MapPool(pb.MapPoolRequest())
        self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.MapPool(pb.MapPoolRequest(layout="no_such_layout"))
        self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_unknown_session_is_not_found(self):
        with self.assertRaises(grpc.RpcError) as err:
            self.stub.GetSessionStats(
                pb.GetSessionStatsRequest(session_id="00000000deadbeef")
            )
        self.assertEqual(err.exception.code(), grpc.StatusCode.NOT_FOUND)


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvkeepd", default=os.environ.get("KVKEEPD"))
    parser.add_argument("--proto_dir", default=os.environ.get("KVKEEP_PROTO_DIR"))
    parser.add_argument("--protoc", default=shutil.which("protoc") or "protoc")
    parser.add_argument(
        "--grpc_python_plugin", default="/usr/bin/grpc_python_plugin"
    )
    args, rest = parser.parse_known_args()
    if not args.kvkeepd or not args.proto_dir:
        parser.error("--kvkeepd and --proto_dir (or KVKEEPD, KVKEEP_PROTO_DIR)")
    return args, rest


if __name__ == "__main__":
    ARGS, _rest = _parse_args()
    unittest.main(argv=[sys.argv[0]] + _rest, verbosity=2)
