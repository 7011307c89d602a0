"""kvkeepd killed mid-stream: a clear exception, no hang; retries."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

import kvkeep
import kvkeep.aio

from conftest import Server
from helpers import random_kv


def _run_bounded(fn, seconds=20):
    """Runs fn in a thread; fails the test if it hangs."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s"
    return out


def test_killed_mid_stream_sync(make_server):
    srv = make_server()
    client = kvkeep.Client(srv.address, options=kvkeep.Options(retries=2, deadline=5))
    lay = client.layout("t_f32")
    rng = np.random.default_rng(1)
    s = client.create_session("t_f32", "h2o", 8)
    stream = s.decode()
    for p in range(5):
        stream.step(random_kv(rng, lay, 1) + ([p],))
    srv.kill()

    def step():
        return stream.step(random_kv(rng, lay, 1) + ([5],))

    start = time.monotonic()
    out = _run_bounded(step)
    assert isinstance(out.get("error"), kvkeep.Unavailable), out
    assert time.monotonic() - start < 10
    assert not s.in_sync  # the outcome of the lost step is unknown
    with pytest.raises(kvkeep.OutOfSync):
        s.step(random_kv(rng, lay, 1) + ([6],))
    # Reads retry, then say how often they tried.
    out = _run_bounded(s.stats)
    assert isinstance(out.get("error"), kvkeep.Unavailable)
    assert "after 3 attempts" in str(out["error"])


def test_killed_mid_stream_aio(make_server):
    srv = make_server()

    async def main():
        client = kvkeep.aio.Client(srv.address, options=kvkeep.Options(retries=1))
        lay = (await client.info()).layouts[0]
        rng = np.random.default_rng(2)
        s = await client.create_session("t_f32", "h2o", 8)
        for p in range(5):
            await s.step(random_kv(rng, lay, 1) + ([p],))
        srv.kill()
        with pytest.raises(kvkeep.Unavailable):
            await asyncio.wait_for(s.step(random_kv(rng, lay, 1) + ([5],)), 10)
        assert not s.in_sync
        await client.close_channel()

    asyncio.run(main())


def test_reads_and_creates_retry_until_the_server_is_back(kvkeepd_binary, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"127.0.0.1:{port}"
    client = kvkeep.Client(address, options=kvkeep.Options(retries=8, backoff=0.1,
                                                           max_backoff=0.4))
    # The server starts from this thread (kvkeepd's pdeathsig follows the
    # thread that started it); the call that must wait for it runs in another.
    out = {}
    t = threading.Thread(target=lambda: out.update(info=client.info()))
    t.start()
    time.sleep(0.5)
    srv = Server(kvkeepd_binary, str(tmp_path), extra=[f"--listen={address}"])
    try:
        t.join(20)
        assert not t.is_alive()
        # UNAVAILABLE at first; retried until the server was up.
        assert out["info"].layouts[0].name == "t_f32"
        s = client.create_session("t_f32", "full", idempotency_key="retry-1")
        # The same key returns the same session, never a second one.
        again = client.create_session("t_f32", "full", idempotency_key="retry-1")
        assert again.id == s.id and len(client.list()) == 1
    finally:
        srv.kill()
    # Nothing listening and no retries left: Unavailable, promptly.
    quick = kvkeep.Client(address, options=kvkeep.Options(retries=1, backoff=0.05,
                                                          max_backoff=0.05))
    with pytest.raises(kvkeep.Unavailable):
        quick.list()
    # A create retried only with its key; an append never.
    with pytest.raises(kvkeep.Unavailable):
        quick.create_session("t_f32", "full")
