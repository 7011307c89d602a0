"""python -m kvkeep, and the examples, run as a user runs them."""

import json
import os
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))


def _cli(server, *args):
    return subprocess.run([sys.executable, "-m", "kvkeep", "--server", server.address,
                           *args], capture_output=True, text=True, timeout=60)


def test_cli(server, client):
    r = _cli(server, "info")
    assert r.returncode == 0, r.stderr
    assert "snapkv" in r.stdout and "kernel = 5: int in [1, 1025], odd" in r.stdout
    s = client.create_session("t_f32", "h2o", 16)
    r = _cli(server, "--json", "sessions")
    assert s.id in [x["session_id"] for x in json.loads(r.stdout)["sessions"]]
    r = _cli(server, "stats", s.id)
    assert r.returncode == 0 and f"session {s.id}: layout t_f32, policy h2o" in r.stdout
    r = _cli(server, "close", s.id)
    assert r.returncode == 0 and "freed 0 pages" in r.stdout
    r = _cli(server, "--json", "stats", s.id)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "NOT_FOUND"
    assert "NOT_FOUND" in r.stderr and s.id in r.stderr
    assert _cli(server, "stats").returncode == 2


def test_cli_fork_and_prefixes(server, client):
    import numpy as np
    from helpers import random_kv
    s = client.create_session("t_f32", "full", budget=64)
    k, v = random_kv(np.random.default_rng(31), s.layout, 8)
    s.append(k, v, np.arange(8))  # 2 full pages a layer
    r = _cli(server, "fork", s.id)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"forked {s.id}: child ") and "shares 4 pages" in r.stdout
    child = r.stdout.split()[3]
    assert client.stats(child).shared_pages == 4
    r = _cli(server, "--json", "fork", s.id)
    forked = json.loads(r.stdout)
    assert forked["shared_pages"] == "4"  # int64: a JSON string
    client.close(forked["session_id"])
    r = _cli(server, "publish", s.id, "cli/system")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"published {s.id} as cli/system: 8 tokens in 4 pages\n"
    assert _cli(server, "publish", s.id, "cli/system").returncode == 1  # twice
    r = _cli(server, "prefixes")
    rows = [l.split() for l in r.stdout.splitlines()]
    assert rows[0][:3] == ["PREFIX", "TENANT", "PUBLIC"]
    assert ["cli/system", "-", "no", "yes", "t_f32", "8", "4"] == rows[1][:7]
    agent = client.create_session("", "full", budget=64, prefix="cli/system")
    r = _cli(server, "--json", "prefixes")
    assert [(p["name"], p["holders"]) for p in json.loads(r.stdout)["prefixes"]] == \
        [("cli/system", "1")]
    r = _cli(server, "unpublish", "cli/system")
    assert r.stdout == "unpublished cli/system: 1 sessions still hold it\n"
    r = _cli(server, "--json", "unpublish", "cli/system")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "NOT_FOUND"
    assert _cli(server, "fork").returncode == 2
    assert _cli(server, "publish", s.id).returncode == 2
    for x in (agent, s):
        x.close()
    client.close(child)


def test_examples_run(server):
    for name in ("agent_loop.py", "numpy_worker.py"):
        path = os.path.join(HERE, "..", "examples", name)
        r = subprocess.run([sys.executable, path, "--server", server.address,
                            "--layout", "t_f32"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
        assert "ok" in r.stdout.splitlines()[-1]
