#!/usr/bin/env python3
"""Regenerates src/kvkeep/v1/kvkeep_pb2{,_grpc}.py{,i} from proto/ with grpcio-tools.

    python tools/generate_stubs.py            # rewrite the committed stubs
    python tools/generate_stubs.py --out DIR  # write them to DIR instead

Run it in the venv of scripts/python-client-test (pinned grpcio-tools, so the
output is byte-for-byte reproducible) whenever proto/kvkeep/v1/kvkeep.proto
changes; tests/test_stubs.py fails until you do.
"""

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(HERE)                                   # clients/python
DEFAULT_PROTO = os.path.join(PACKAGE_ROOT, "..", "..", "proto")        # repo/proto
DEFAULT_OUT = os.path.join(PACKAGE_ROOT, "src", "kvkeep", "v1")
FILES = ("kvkeep_pb2.py", "kvkeep_pb2_grpc.py", "kvkeep_pb2.pyi")


def generate(proto_dir: str, out_dir: str) -> None:
    from grpc_tools import protoc  # pinned in clients/python/requirements-test.txt

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{os.path.abspath(proto_dir)}",
                          f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                          f"--pyi_out={tmp}", "kvkeep/v1/kvkeep.proto"])
        if rc != 0:
            raise SystemExit(f"protoc failed with {rc}")
        os.makedirs(out_dir, exist_ok=True)
        for name in FILES:
            shutil.copyfile(os.path.join(tmp, "kvkeep", "v1", name),
                            os.path.join(out_dir, name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proto_dir", default=DEFAULT_PROTO)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    generate(args.proto_dir, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
