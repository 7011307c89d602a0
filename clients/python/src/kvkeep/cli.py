"""python -m kvkeep: info | sessions | stats ID | close ID (the C++ CLI's
read-and-close commands, same flags, exit status 0 / 1 refused or
unreachable / 2 usage; --json prints the proto's field names), and
fork ID | prefixes | publish ID NAME | unpublish NAME (docs/prefixes.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from google.protobuf import json_format

import kvkeep
from kvkeep import _core
from kvkeep.v1 import kvkeep_pb2 as pb


def _json(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _lease(s) -> str:
    """A session's lease: "never", "held" (a stream or a transfer holds it)
    or the whole seconds left."""
    if s.idle_timeout_seconds <= 0:
        return "never"
    return "held" if s.lease_held else f"{int(s.lease_seconds_left)}s"


def _info(client, args) -> None:
    info = client.info()
    if args.json:
        print(json.dumps(_json(info), indent=2))
        return
    print(f"kvkeepd {info.version} at {args.server}, backend {info.backend}")
    print(f"limits: {info.max_sessions} sessions, "
          f"{_mib(info.max_message_bytes)} per message")
    print("policies:")
    for p in info.policy_info:
        inp = {1: "none", 2: "per-step", 3: "compress"}.get(p.input, "?")
        print(f"  {p.name:<14} {p.summary}")
        print(f"  {'':<14} input: {inp}; budget: {p.budget_rule}")
        for param in p.params:
            print(f"  {'':<16} {_core.describe_param(param)}")
    print()
    print("LAYOUT  LAYERS  KV/Q HEADS  HEAD_DIM  DTYPE  PAGE_TOKENS  PAGES_USED  PAGES")
    pools = {p.layout: p for p in info.pools}
    for l in info.layouts:
        pool = pools.get(l.name)
        print(f"{l.name}  {l.num_layers}  {l.kv_heads}/{l.query_heads}  "
              f"{l.head_dim}  {_core.DTYPE_NAME.get(l.dtype, '?')}  "
              f"{l.page_tokens}  {pool.used_pages if pool else '-'}  "
              f"{pool.capacity_pages if pool else '-'}")


def _sessions(client, args) -> None:
    sessions = client.list()
    if args.json:
        print(json.dumps({"sessions": [_json(s) for s in sessions]}, indent=2))
        return
    print("SESSION  LAYOUT  POLICY  TENANT  RESIDENT  PAGES  BYTES  EVICTED  LEASE")
    for s in sessions:
        print(f"{s.session_id}  {s.layout}  {s.policy}  {s.tenant or '-'}  "
              f"{s.resident_tokens}  {s.pages}  {_mib(s.resident_bytes)}  "
              f"{s.evicted_tokens}  {_lease(s)}")


def _stats(client, args) -> None:
    s = client.stats(args.args[0])
    if args.json:
        print(json.dumps(_json(s), indent=2))
        return
    print(f"session {s.session_id}: layout {s.layout}, policy {s.policy}")
    print(f"resident {s.resident_tokens} tokens in {s.pages} pages "
          f"({_mib(s.resident_bytes)}); evicted {s.evicted_tokens} tokens "
          f"(score {s.evicted_score:.1f}); {s.score_updates} score updates")
    print(f"lease: {_lease(s)} left of {s.idle_timeout_seconds:g}s"
          if s.idle_timeout_seconds > 0 else "lease: none (never expires)")
    print("LAYER  RESIDENT  BUDGET  VERSION")
    for i, (r, b, v) in enumerate(zip(s.layer_resident, s.layer_budget,
                                      s.layer_version)):
        print(f"{i}  {r}  {b}  {v}")


def _close(client, args) -> None:
    freed = client.close(args.args[0])
    if args.json:
        print(json.dumps({"session_id": args.args[0], "closed": True,
                          "freed_pages": freed}))
        return
    print(f"closed {args.args[0]}: freed "
          f"{'an unknown number of' if freed is None else freed} pages")


def _fork(client, args) -> None:
    # The parent's policy, parameters and budget; retried safely (the key).
    resp = client._c.call("ForkSession", pb.ForkSessionRequest(
        session_id=args.args[0], idempotency_key=_core.new_id()))
    if args.json:
        print(json.dumps(_json(resp), indent=2))
        return
    print(f"forked {args.args[0]}: child {resp.session_id} shares "
          f"{resp.shared_pages} pages")


def _prefixes(client, args) -> None:
    prefixes = client.list_prefixes()
    if args.json:
        print(json.dumps({"prefixes": [_json(p) for p in prefixes]}, indent=2))
        return
    print("PREFIX  TENANT  PUBLIC  PUBLISHED  LAYOUT  TOKENS  PAGES  SHARED  "
          "HOLDERS  SOURCE")
    for p in prefixes:
        print(f"{p.name}  {p.tenant or '-'}  {'yes' if p.is_public else 'no'}  "
              f"{'yes' if p.published else 'no'}  {p.layout}  {p.tokens}  {p.pages}  "
              f"{p.shared_pages}  {p.holders}  {p.source_session_id}")


def _publish(client, args) -> None:
    session_id, name = args.args
    p = client._c.call("PublishPrefix", pb.PublishPrefixRequest(
        session_id=session_id, name=name, is_public=args.public))
    if args.json:
        print(json.dumps(_json(p), indent=2))
        return
    print(f"published {session_id} as {p.name}: {p.tokens} tokens in {p.pages} pages")


def _unpublish(client, args) -> None:
    holders = client.unpublish_prefix(args.args[0], is_public=args.public)
    if args.json:
        print(json.dumps({"name": args.args[0], "unpublished": True,
                          "holders": holders}))
        return
    print(f"unpublished {args.args[0]}: {holders} sessions still hold it")


# command: (what it does, its arguments, the function)
COMMANDS = {
    "info": ("layouts, pools, policies and limits", [], _info),
    "sessions": ("the tenant's sessions", [], _sessions),
    "stats": ("one session's statistics", ["SESSION"], _stats),
    "close": ("closes a session", ["SESSION"], _close),
    "fork": ("forks a session (the child shares its pages)", ["SESSION"], _fork),
    "prefixes": ("the tenant's and the public prefixes", [], _prefixes),
    "publish": ("publishes a session as a named prefix", ["SESSION", "NAME"],
                _publish),
    "unpublish": ("unpublishes a named prefix", ["NAME"], _unpublish),
}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvkeep", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(
            f"  {' '.join([c] + a):<22} {what}" for c, (what, a, _) in COMMANDS.items()))
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--token", default=os.environ.get("KVKEEP_TOKEN"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tls", action="store_true", help="TLS with the system roots")
    ap.add_argument("--tls_ca", help="PEM CA file; enables TLS")
    ap.add_argument("--deadline", type=float, default=10.0, help="seconds per call")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--public", action="store_true",
                    help="publish, unpublish: the public prefix of that name")
    ap.add_argument("command", choices=list(COMMANDS))
    ap.add_argument("args", nargs="*")
    args = ap.parse_args(argv)
    want = COMMANDS[args.command][1]
    if len(args.args) != len(want):
        ap.print_usage(sys.stderr)
        print(f"python -m kvkeep: {args.command} takes "
              f"{' '.join(want) or 'no arguments'}", file=sys.stderr)
        return 2
    tls = args.tls_ca or (True if args.tls else None)
    client = kvkeep.Client(args.server, token=args.token, tls=tls,
                           options=kvkeep.Options(deadline=args.deadline,
                                                  retries=args.retries))
    try:
        COMMANDS[args.command][2](client, args)
    except kvkeep.KvKeepError as e:
        print(f"python -m kvkeep: {args.command}: {e.code.name}: {e.message}",
              file=sys.stderr)
        if args.json:
            print(json.dumps({"error": {"code": e.code.name, "message": e.message}}))
        return 1
    finally:
        client.close_channel()
    return 0
