"""Fleet mode's shared part (docs/fleet.md): what ``kvkeep.Fleet`` and
``kvkeep.aio.Fleet`` both do, with no I/O in here.

Session ids and replica names (services/common/fleet_names.h), the fleet's
view of its replicas (names, addresses, last ServerInfo and when it was
read), placement by free pages, routing by id, the redirect a moved
session's old replica answers with, and :class:`Route`, the part of a
connection that follows it. The sync and asyncio clients do the calls.

Thread-safety: a FleetState is thread-safe (one lock; no call is made
under it). A replica's connection (a Route) is shared and never switches;
the copy a session handle (or one routed call) follows moves with belongs
to that handle, as the handle does.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from kvkeep.errors import (FailedPrecondition, InvalidArgument, KvKeepError, NotFound,
                           Unavailable, error_for)
from kvkeep._core import Options
from kvkeep.v1 import kvkeep_pb2 as pb

# Trailing metadata of the NOT_FOUND a replica answers for a session that
# moved away from it: the replica that holds it now, and the address the
# transfer was sent to.
MOVED_TO = "kvkeep-moved-to"
MOVED_TO_ADDRESS = "kvkeep-moved-to-address"

_LABEL_CHARS = re.compile(r"[a-z0-9-]*\Z")
_KEY = re.compile(r"[0-9a-f]{16}\Z")
_MAX_NAME = 63


def check_replica_name(name: str) -> None:
    """InvalidArgument unless `name` is a DNS label (1-63 of a-z 0-9 -, not
    starting or ending with '-'), with the server's words."""
    if not 0 < len(name) <= _MAX_NAME:
        raise InvalidArgument(f"replica name {name!r} must have 1 to {_MAX_NAME} "
                              "characters (a DNS label)", client_side=True)
    if not _LABEL_CHARS.match(name):
        raise InvalidArgument(f"replica name {name!r} may hold only lowercase "
                              "letters, digits and '-' (a DNS label)", client_side=True)
    if name[0] == "-" or name[-1] == "-":
        raise InvalidArgument(f"replica name {name!r} must not begin or end with "
                              "'-' (a DNS label)", client_side=True)


def parse_session_id(session_id: str) -> Tuple[str, str]:
    """(replica, key) of "<replica>.<key>"; replica "" for a bare key (an
    unnamed server's id). InvalidArgument saying what is wrong."""
    replica, dot, key = session_id.rpartition(".")
    if not _KEY.match(key):
        raise InvalidArgument(
            f"session_id {session_id[:80]!r} is not a kvkeep session id (16 "
            "lowercase hex digits, after '<replica>.' on a fleet)", client_side=True)
    if dot:
        try:
            check_replica_name(replica)
        except InvalidArgument as e:
            raise InvalidArgument(f"session_id {session_id[:80]!r}: {e.message}",
                                  client_side=True) from None
    return replica, key


def is_resolved_target(target: str) -> bool:
    """Whether `target` is one gRPC target resolving to every replica (a
    scheme: dns:///..., ipv4:a:p,b:q) rather than one replica's host:port."""
    return ":///" in target or target.startswith(("ipv4:", "ipv6:", "dns:"))


def moved_to(trailing: Optional[Sequence[Tuple[str, Any]]]) -> Optional[Tuple[str, str]]:
    """(replica, address) from a moved session's trailing metadata, or None."""
    found = {k: v for k, v in (trailing or ()) if k in (MOVED_TO, MOVED_TO_ADDRESS)}
    to = found.get(MOVED_TO, "")
    if isinstance(to, bytes):
        to = to.decode()
    if not to:
        return None
    address = found.get(MOVED_TO_ADDRESS, "")
    return to, address.decode() if isinstance(address, bytes) else address


class Route:
    """The part of a connection that says where its calls go, shared by the
    sync and asyncio connections (which add the calls).

    A connection made for a session handle of a fleet (`follows`) switches
    to the replica a moved session's old replica names, once per call: the
    caller sends the refused call again, and every later call goes there.
    """

    def __init__(self, address: str, options: Any, metadata: Tuple[Tuple[str, str], ...],
                 channel: Any, stub: Any, replica: str = "",
                 redirect: Optional[Callable[[str, str], Optional["Route"]]] = None):
        self.address = address
        self.options = options
        self.metadata = metadata
        self.channel = channel
        self.stub = stub
        self.replica = replica  # the fleet replica it reaches ("" : no fleet)
        self.redirect = redirect  # (name, address) -> that replica's connection
        self.follows = False
        # Called after a switch, before the call goes again: a session
        # handle reloads its block tables there (a move keeps slots,
        # positions and versions, but the pages are the new replica's).
        self.on_move: Optional[Callable[[], Any]] = None
        self._info: Optional[pb.ServerInfo] = None

    def route(self) -> Any:
        """A copy for one session handle (or one call) that follows moves."""
        out = copy.copy(self)
        out.follows = self.redirect is not None
        return out

    def follow(self, e: grpc.RpcError) -> bool:
        """After a failed call: if it is a moved session's NOT_FOUND and this
        connection follows moves, switches to the new replica (True). The
        caller then runs on_move (the sync and aio connections' followed())."""
        if not self.follows or self.redirect is None or \
                e.code() != grpc.StatusCode.NOT_FOUND:
            return False
        try:
            where = moved_to(e.trailing_metadata())
        except Exception:  # noqa: BLE001 (a call without metadata)
            return False
        target = self.redirect(*where) if where else None
        if target is None:
            return False  # the caller sees the moved NOT_FOUND
        self.address, self.channel, self.stub = target.address, target.channel, target.stub
        self.replica, self._info = target.replica, target._info
        return True

    def moved_error(self, err: KvKeepError, method: str) -> KvKeepError:
        """A handle's table reload after a switch failed (the session moved
        again, say): `method`'s error. The handle stays switched; its next
        call follows the next move and reloads again."""
        return error_for(err.code, err.message, method=method)

    def where(self) -> str:
        return f"replica {self.replica} at {self.address}" if self.replica \
            else self.address

    def unavailable(self, method: str, attempts: int, details: str) -> Unavailable:
        """A call's UNAVAILABLE in the C++ client's words, naming the replica."""
        return Unavailable(f"{method} to {self.where()} failed after {attempts} "
                           f"attempt{'s' if attempts > 1 else ''}: {details}",
                           method=method)

    def name_unavailable(self, err: KvKeepError, method: str) -> KvKeepError:
        """A stream's UNAVAILABLE, naming the fleet replica it went to."""
        if err.code != grpc.StatusCode.UNAVAILABLE or not self.replica:
            return err
        return self.unavailable(method, 1, err.message)


class ClientBase:
    """What kvkeep.Client and kvkeep.aio.Client share: a connection (the
    `_connection` class's) to one server, made here or handed over."""

    _connection: Any = None

    def __init__(self, address: str = "127.0.0.1:50051", token: Optional[str] = None,
                 tls: Any = None, options: Any = None):
        if not address:
            raise InvalidArgument("Client: empty address", client_side=True)
        self._c = self._connection.open(address, token, tls, options or Options())

    @classmethod
    def _over(cls, conn: Route) -> Any:
        """A client on an open connection (a fleet's replica)."""
        client = cls.__new__(cls)
        client._c = conn
        return client

    @property
    def address(self) -> str:
        return self._c.address


@dataclass
class Replica:
    """One replica: where it is and what it last said about itself."""

    name: str
    address: str
    conn: Route  # its own connection (calls that do not follow moves)
    info: Optional[pb.ServerInfo]  # None: it did not answer at the last read
    read_at: float  # time.monotonic()


class FleetState:
    """The replicas of a fleet, by name. Thread-safe.

    make_conn(address, replica_name) opens a connection (sync or asyncio,
    no call made) to a replica a session moved to that joined since."""

    def __init__(self, make_conn: Callable[[str, str], Route]):
        self._make_conn = make_conn
        self._lock = threading.Lock()
        self._replicas: Dict[str, Replica] = {}

    def add(self, target: str, address: str, conn: Route, info: pb.ServerInfo) -> bool:
        """Adds the replica `info` describes (found at `target`, reached at
        `address`); False when it is known already. FailedPrecondition for
        a replica without a name, InvalidArgument for two with one."""
        name = info.replica
        if not name:
            raise FailedPrecondition(
                f"the kvkeepd at {target} has no replica name: every replica of a "
                "fleet needs one (replica_name)", client_side=True)
        with self._lock:
            known = self._replicas.get(name)
            if known is not None:
                if known.address != address:
                    raise InvalidArgument(
                        f"two replicas call themselves '{name}': at {known.address} "
                        f"and {address}", client_side=True)
                return False
            conn.replica = name
            conn._info = info
            self._replicas[name] = Replica(name, address, conn, info, time.monotonic())
            return True

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self._replicas)

    def conns(self) -> List[Route]:
        with self._lock:
            return [r.conn for r in self._replicas.values()]

    def known(self, name: str) -> bool:
        with self._lock:
            return name in self._replicas

    def get(self, name: str) -> Replica:
        with self._lock:
            r = self._replicas.get(name)
            if r is None:
                raise NotFound(f"replica {name} is not in the fleet "
                               f"({len(self._replicas)} replicas)", client_side=True)
            return r

    def stale(self, staleness: float) -> List[Tuple[str, Route]]:
        """The replicas read longer than `staleness` seconds ago."""
        now = time.monotonic()
        with self._lock:
            return [(n, r.conn) for n, r in self._replicas.items()
                    if now - r.read_at >= staleness]

    def record(self, name: str, info: Optional[pb.ServerInfo]) -> None:
        """A replica's new ServerInfo (None: it did not answer; placement
        skips it until it does)."""
        with self._lock:
            r = self._replicas[name]
            r.info, r.read_at = info, time.monotonic()
            if info is not None:
                r.conn._info = info

    def choose(self, layout: str) -> str:
        """The replica with the most free pages of `layout` (ties: fewer
        sessions, then the first name). NotFound when none serves it."""
        best: Optional[Tuple[int, int, str]] = None
        with self._lock:
            for name, r in sorted(self._replicas.items()):
                if r.info is None:
                    continue
                free = [p.free_pages for p in r.info.pools if p.layout == layout]
                if not free:
                    continue
                sessions = sum(p.sessions for p in r.info.pools)
                key = (-free[0], sessions, name)
                if best is None or key < best:
                    best = key
        if best is None:
            raise NotFound(f"no reachable replica of the fleet serves layout "
                           f"'{layout}'", client_side=True)
        return best[2]

    def route(self, session_id: str) -> str:
        """The replica a session id names (see FleetClient::Route)."""
        replica, _ = parse_session_id(session_id)
        with self._lock:
            if not replica:
                if len(self._replicas) == 1:
                    return next(iter(self._replicas))
                raise FailedPrecondition(
                    f"session {session_id} names no replica (a server without "
                    f"replica_name made it), and this fleet has "
                    f"{len(self._replicas)} replicas", client_side=True)
            if replica not in self._replicas:
                raise NotFound(f"session {session_id} lives on replica {replica}, "
                               "which is not in the fleet (it is gone, or never was)",
                               client_side=True)
        return replica

    def session_conn(self, name: str) -> Route:
        """A connection for one session handle on replica `name` that
        follows the session's moves."""
        return self.get(name).conn.route()

    def redirect(self, name: str, address: str) -> Optional[Route]:
        """Where a moved session went: the known replica `name`, else a new
        connection to `address` (a replica that joined since)."""
        with self._lock:
            r = self._replicas.get(name)
        if r is not None:
            return r.conn
        if not address:
            return None
        conn = self._make_conn(address, name)
        conn.redirect = self.redirect
        return conn


def discovery_address(info: pb.ServerInfo, target: str) -> str:
    """The address a replica found through a resolved target is reached at:
    the one it reports. FailedPrecondition when it reports none."""
    if not info.address:
        raise FailedPrecondition(
            f"replica '{info.replica}' (found through {target}) reports no address: "
            "set its advertise_address", client_side=True)
    return info.address


def check_targets(targets: Any, discovery_calls: int,
                  placement_staleness: float) -> List[str]:
    """The fleet's targets as a list, checked."""
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise InvalidArgument("Fleet: no targets (give each replica's host:port, or "
                              "one dns:/// target)", client_side=True)
    if discovery_calls < 1 or placement_staleness < 0:
        raise InvalidArgument("Fleet: discovery_calls must be >= 1 and "
                              "placement_staleness >= 0", client_side=True)
    return targets


def placement_layout(layout: str, replica: Optional[str], prefix: str) -> None:
    """A placed create needs a layout: a prefix lives on one replica."""
    if not layout and not replica:
        raise InvalidArgument(
            "Fleet.create_session: name the layout to place by"
            f"{' (or the replica holding prefix ' + repr(prefix) + ')' if prefix else ''}",
            client_side=True)


class FleetBase:
    """What kvkeep.Fleet and kvkeep.aio.Fleet share: the state and the
    calls that need no I/O. Subclasses set _connection (the sync or aio
    _Connection class) and _client_class (Client)."""

    _connection: Any = None
    _client_class: Any = None

    def __init__(self, targets: Any, token: Optional[str], tls: Any, options: Any,
                 placement_staleness: float, discovery_calls: int):
        self._targets = check_targets(targets, discovery_calls, placement_staleness)
        self._discovery_calls = discovery_calls
        self._options = options
        self._staleness = placement_staleness
        self._token, self._tls = token, tls
        self._state = FleetState(self._open)

    def _open(self, address: str, replica: str = "", round_robin: bool = False) -> Route:
        return self._connection.open(address, self._token, self._tls, self._options,
                                     round_robin=round_robin, replica=replica)

    def _add(self, target: str, address: str, conn: Route, info: pb.ServerInfo) -> bool:
        """Adds a replica; False (its channel closed) when it is known."""
        conn.redirect = self._state.redirect
        if self._state.add(target, address, conn, info):
            return True
        self._drop(conn)
        return False

    def _drop(self, conn: Route) -> Any:
        raise NotImplementedError

    def _discovered(self, target: str, info: pb.ServerInfo) -> bool:
        """Adds the replica a resolved target's answer came from, at the
        address it reports; False when it is known already."""
        if self._state.known(info.replica):
            return False
        address = discovery_address(info, target)
        return self._add(target, address, self._open(address), info)

    def replicas(self) -> List[str]:
        """The replicas' names, sorted."""
        return self._state.names()

    def replica(self, name: str) -> Any:
        """A Client of one replica, for what is not routed (info, list,
        transfer); sessions it makes or opens follow their moves.
        NotFound for a name not in the fleet."""
        return self._client_class._over(self._state.get(name).conn)

    def route(self, session_id: str) -> str:
        """The replica a session id names. InvalidArgument for a malformed
        id; NotFound when that replica is not in the fleet; a bare key goes
        to the only replica (FailedPrecondition on a fleet of several)."""
        return self._state.route(session_id)

    def _client(self, replica: str) -> Any:
        """A Client whose calls (and sessions) follow moves, at `replica`."""
        return self._client_class._over(self._state.session_conn(replica))

    def _routed(self, session_id: str) -> Any:
        return self._client(self.route(session_id))
