"""kvkeep.Fleet on asyncio (``kvkeep.aio.Fleet``): the same routing,
placement and redirects, awaited. Connect with ``await Fleet.connect(...)``.

    fleet = await kvkeep.aio.Fleet.connect(["10.0.0.1:50051", "10.0.0.2:50051"])
    async with await fleet.create_session("demo", "h2o", budget=512) as s:
        ...

A Fleet may serve many tasks at once; its sessions are kvkeep.aio's.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence, Union

from kvkeep import _fleet
from kvkeep._core import BudgetArg, Options, TlsArg
from kvkeep.aio import Client, Session, _Connection
from kvkeep.errors import KvKeepError
from kvkeep.v1 import kvkeep_pb2 as pb

__all__ = ["Fleet"]


class Fleet(_fleet.FleetBase):
    """See kvkeep.Fleet; made by ``await Fleet.connect(...)``."""

    _connection = _Connection
    _client_class = Client

    @classmethod
    async def connect(cls, targets: Union[str, Sequence[str]],
                      token: Optional[str] = None, tls: TlsArg = None,
                      options: Optional[Options] = None, *,
                      placement_staleness: float = 1.0,
                      discovery_calls: int = 8) -> "Fleet":
        """Finds the replicas and reads their ServerInfo (errors: see
        kvkeep.Fleet)."""
        fleet = cls(targets, token, tls, options or Options(), placement_staleness,
                    discovery_calls)
        try:
            for target in fleet._targets:
                if _fleet.is_resolved_target(target):
                    await fleet._discover(target)
                else:
                    conn = fleet._open(target)
                    fleet._add(target, target, conn, await _server_info(conn))
        except BaseException:
            await fleet.close_channel()
            raise
        return fleet

    async def _discover(self, target: str) -> None:
        everyone = self._open(target, round_robin=True)
        try:
            quiet = 0  # answers in a row that brought no new replica
            while quiet < self._discovery_calls:
                new = self._discovered(target, await _server_info(everyone))
                quiet = 0 if new else quiet + 1
        finally:
            await everyone.channel.close()

    def _drop(self, conn: _Connection) -> None:
        asyncio.ensure_future(conn.channel.close())

    async def close_channel(self) -> None:
        for conn in self._state.conns():
            await conn.channel.close()

    async def __aenter__(self) -> "Fleet":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close_channel()

    async def refresh(self) -> None:
        """Reads every replica's ServerInfo now (all at once)."""
        await self._refresh(0.0)

    async def _refresh(self, staleness: float) -> None:
        async def read(name: str, conn: _Connection) -> None:
            try:  # no retries: a placement does not wait on a dead replica
                info: Optional[pb.ServerInfo] = await conn.call(
                    "GetServerInfo", pb.GetServerInfoRequest(), retry=False)
            except KvKeepError:
                info = None
            self._state.record(name, info)

        await asyncio.gather(*(read(n, c) for n, c in self._state.stale(staleness)))

    async def create_session(self, layout: str, policy: str = "",
                             budget: BudgetArg = None, *, replica: Optional[str] = None,
                             **kw: Any) -> Session:
        """See kvkeep.Fleet.create_session."""
        _fleet.placement_layout(layout, replica, kw.get("prefix", ""))
        if not replica:
            await self._refresh(self._staleness)
            replica = self._state.choose(layout)
        return await self._client(replica).create_session(layout, policy, budget, **kw)

    async def open_session(self, session_id: str) -> Session:
        return await self._routed(session_id).open_session(session_id)

    async def stats(self, session_id: str) -> pb.SessionStats:
        return await self._routed(session_id).stats(session_id)

    async def keep_alive(self, session_id: str) -> pb.KeepAliveResponse:
        return await self._routed(session_id).keep_alive(session_id)

    async def close(self, session_id: str) -> Optional[int]:
        return await self._routed(session_id).close(session_id)


async def _server_info(conn: _Connection) -> pb.ServerInfo:
    return await conn.call("GetServerInfo", pb.GetServerInfoRequest())
