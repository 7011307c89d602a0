"""A fleet of kvkeepd replicas (``kvkeep.Fleet``; docs/fleet.md).

    fleet = kvkeep.Fleet("dns:///kvkeepd-fleet.kvkeep.svc.cluster.local:50051")
    with fleet.create_session("demo", "h2o", budget=512) as s:   # placed
        ...
    same = fleet.open_session(s.id)                               # routed
    pinned = fleet.create_session("demo", "h2o", 512, replica="kvkeepd-2")

The Python twin of the C++ FleetClient: it finds the replicas, places a
new session on the one with the most free pages for its layout (numbers at
most `placement_staleness` old), sends every call on a session to the
replica its id names, and follows a moved session once, transparently.
What is shared with kvkeep.aio.Fleet is in kvkeep._fleet.

Thread-safety: a Fleet is thread-safe; its sessions are a Client's.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from kvkeep import _fleet
from kvkeep._core import BudgetArg, Options, TlsArg
from kvkeep.client import Client, Session, _Connection
from kvkeep.errors import KvKeepError
from kvkeep.v1 import kvkeep_pb2 as pb

__all__ = ["Fleet"]

Targets = Union[str, Sequence[str]]


class Fleet(_fleet.FleetBase):
    """The replicas of a fleet, found at once (the constructor calls each).

    targets: one host:port per replica (a static list), or one gRPC target
      that resolves to all of them (the headless Service's "dns:///...", or
      "ipv4:a:p,b:q"), asked for ServerInfo over round_robin until
      `discovery_calls` answers in a row bring no new replica; each replica
      is then reached at the address it reports (advertise_address).
    token, tls, options: as kvkeep.Client's, for every replica.
    placement_staleness: seconds a replica's free pages may be old when a
      session is placed (0: read every replica before every placement).

    Raises InvalidArgument for no targets or two replicas with one name,
    FailedPrecondition for a replica without a name (or, found through a
    resolved target, without an address), Unavailable naming the target
    that did not answer.
    """

    _connection = _Connection
    _client_class = Client

    def __init__(self, targets: Targets, token: Optional[str] = None,
                 tls: TlsArg = None, options: Optional[Options] = None, *,
                 placement_staleness: float = 1.0, discovery_calls: int = 8):
        super().__init__(targets, token, tls, options or Options(),
                         placement_staleness, discovery_calls)
        try:
            for target in self._targets:
                if _fleet.is_resolved_target(target):
                    self._discover(target)
                else:
                    conn = self._open(target)
                    self._add(target, target, conn, _server_info(conn))
        except BaseException:
            self.close_channel()
            raise

    def _discover(self, target: str) -> None:
        everyone = self._open(target, round_robin=True)
        try:
            quiet = 0  # answers in a row that brought no new replica
            while quiet < self._discovery_calls:
                new = self._discovered(target, _server_info(everyone))
                quiet = 0 if new else quiet + 1
        finally:
            everyone.channel.close()

    def _drop(self, conn: _Connection) -> None:
        conn.channel.close()

    def close_channel(self) -> None:
        """Closes every replica's channel (sessions stay open on them)."""
        for conn in self._state.conns():
            conn.channel.close()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close_channel()

    def refresh(self) -> None:
        """Reads every replica's ServerInfo now."""
        self._refresh(0.0)

    def _refresh(self, staleness: float) -> None:
        for name, conn in self._state.stale(staleness):
            try:  # no retries: a placement does not wait on a dead replica
                info: Optional[pb.ServerInfo] = conn.call(
                    "GetServerInfo", pb.GetServerInfoRequest(), retry=False)
            except KvKeepError:
                info = None
            self._state.record(name, info)

    # -- sessions --------------------------------------------------------------

    def create_session(self, layout: str, policy: str = "", budget: BudgetArg = None,
                       *, replica: Optional[str] = None, **kw: Any) -> Session:
        """Client.create_session on `replica`, or (None) on the replica with
        the most free pages of `layout` (ties: fewer sessions, then the
        first name; NotFound when no reachable replica serves it)."""
        _fleet.placement_layout(layout, replica, kw.get("prefix", ""))
        if not replica:
            self._refresh(self._staleness)
            replica = self._state.choose(layout)
        return self._client(replica).create_session(layout, policy, budget, **kw)

    def open_session(self, session_id: str) -> Session:
        """A handle on a session, at the replica its id names."""
        return self._routed(session_id).open_session(session_id)

    def stats(self, session_id: str) -> pb.SessionStats:
        return self._routed(session_id).stats(session_id)

    def keep_alive(self, session_id: str) -> pb.KeepAliveResponse:
        return self._routed(session_id).keep_alive(session_id)

    def close(self, session_id: str) -> Optional[int]:
        """Closes a session wherever it is; see Client.close."""
        return self._routed(session_id).close(session_id)


def _server_info(conn: _Connection) -> pb.ServerInfo:
    return conn.call("GetServerInfo", pb.GetServerInfoRequest())
