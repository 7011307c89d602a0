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


def test_examples_run(server):
    for name in ("agent_loop.py", "numpy_worker.py"):
        path = os.path.join(HERE, "..", "examples", name)
        r = subprocess.run([sys.executable, path, "--server", server.address,
                            "--layout", "t_f32"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
        assert "ok" in r.stdout.splitlines()[-1]
