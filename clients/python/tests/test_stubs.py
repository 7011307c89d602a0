"""The committed stubs in kvkeep/v1 are what the pinned grpcio-tools makes
from proto/kvkeep/v1/kvkeep.proto: fails when the .proto changed and
tools/generate_stubs.py was not run."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))


def test_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    import generate_stubs
    generate_stubs.generate(generate_stubs.DEFAULT_PROTO, str(tmp_path))
    stale = []
    for name in generate_stubs.FILES:
        with open(os.path.join(generate_stubs.DEFAULT_OUT, name), "rb") as f:
            committed = f.read()
        with open(os.path.join(tmp_path, name), "rb") as f:
            fresh = f.read()
        if committed != fresh:
            stale.append(name)
    assert not stale, (f"stale stubs {stale}: run clients/python/tools/generate_stubs.py "
                       "in .cache/venv-python-client")
