"""Fixtures: real kvkeepd processes on loopback, started from KVKEEPD.

KVKEEPD (or --kvkeepd) names the binary (build/bin/kvkeepd by default). Each
server runs with a config written here: small layouts of every dtype so every
byte and eviction can be checked, --share_pools for MapPool, no metrics
endpoint, and dies with the test process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from typing import Dict, List, Optional

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _layout(name: str, dtype: str, **kw) -> Dict:
    d = {"name": name, "num_layers": 2, "kv_heads": 2, "query_heads": 4,
         "head_dim": 8, "dtype": dtype, "page_tokens": 4, "pool_pages": 16384}
    d.update(kw)
    return d


LAYOUTS = [
    _layout("t_f32", "f32"),
    _layout("t_f16", "f16"),
    _layout("t_bf16", "bf16"),
    _layout("t_pre_rope", "f32", keys_pre_rope=True, pool_pages=1024),
    _layout("t_tiny_pool", "f32", pool_pages=8),
]
# Small enough that a prefill of a few hundred tokens takes several messages
# and ReadKv several chunks per layer.
MAX_MESSAGE_BYTES = 16384
# Every test server takes transfers from the others (docs/security.md).
PEER_TOKEN = "python-test-peer-token"


def pytest_addoption(parser):
    parser.addoption("--kvkeepd", default=os.environ.get(
        "KVKEEPD", os.path.join(REPO, "build", "bin", "kvkeepd")))


# kvkeepd dies with the test process (a crashed pytest leaves none behind).
# Through setpriv rather than a preexec_fn: forking a process whose gRPC
# threads are running and then running Python in the child breaks gRPC's fork
# handlers (the child aborts); without preexec_fn, subprocess execs at once.
_PDEATHSIG = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


class Server:
    """One kvkeepd process; `address` is where it listens."""

    def __init__(self, binary: str, tmpdir: str, name: str = "kvkeepd",
                 extra: Optional[List[str]] = None, config: Optional[Dict] = None):
        cfg = {"layouts": LAYOUTS, "limits": {"max_message_bytes": MAX_MESSAGE_BYTES},
               "peers": {"token": PEER_TOKEN}}
        cfg.update(config or {})
        path = os.path.join(tmpdir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        cmd = _PDEATHSIG + [binary, "--listen=127.0.0.1:0", "--metrics_listen=off",
               "--self_check=false", "--drain_seconds=2", "--share_pools",
               f"--config={path}"] + (extra or [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: List[str] = []
        self.address = ""
        prefix = "kvkeepd: grpc listening on "
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(prefix):
                self.address = line[len(prefix):].strip()
                break
        if not self.address:
            self.proc.wait()
            raise RuntimeError(f"kvkeepd exited ({self.proc.returncode}) without an "
                               f"address:\n{''.join(self.lines)}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError("kvkeepd did not stop on SIGTERM")
        return self.proc.returncode


@pytest.fixture(scope="session")
def kvkeepd_binary(request) -> str:
    path = request.config.getoption("--kvkeepd")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no kvkeepd at {path} (set KVKEEPD or --kvkeepd)")
    return path


@pytest.fixture(scope="session")
def server(kvkeepd_binary, tmp_path_factory):
    s = Server(kvkeepd_binary, str(tmp_path_factory.mktemp("kvkeepd")))
    yield s
    rc = s.stop()
    assert rc == 0, f"kvkeepd exited {rc} on SIGTERM:\n{''.join(s.lines)}"


@pytest.fixture
def make_server(kvkeepd_binary, tmp_path):
    """Starts extra servers for one test (killed at its end)."""
    started = []

    def make(**kw) -> Server:
        s = Server(kvkeepd_binary, str(tmp_path), name=f"kvkeepd{len(started)}", **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.kill()


@pytest.fixture
def client(server):
    import kvkeep
    c = kvkeep.Client(server.address)
    yield c
    c.close_channel()


FLEET_NAMES = ("fleet-a", "fleet-b", "fleet-c")


@pytest.fixture
def fleet_servers(make_server) -> Dict[str, Server]:
    """Three kvkeepd replicas on loopback named fleet-a, fleet-b and fleet-c
    (the fleet of tests/service/fleet_process_test.cc), killed at the end."""
    return {name: make_server(extra=[f"--replica_name={name}"]) for name in FLEET_NAMES}
