"""The asyncio kvkeep client, on grpc.aio: the sync API with ``await``.

    import kvkeep.aio
    async with kvkeep.aio.Client("127.0.0.1:50051") as client:
        async with await client.create_session("demo", "h2o", budget=512) as s:
            await s.append_prefill(keys, values, positions)
            result = await s.step((k, v, pos), scores=kvkeep.reduced(rows))

Checks, mirror, retries and errors are the sync client's (kvkeep._core). A
Client may serve many tasks at once (one channel); a Session, its stream and
its mirror belong to one task at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, List, Optional, Sequence

import grpc
import grpc.aio

from kvkeep import _core
from kvkeep._core import (BudgetArg, LayerKv, Options, Scores, SessionHandle, TlsArg,
                          TokensArg)
from kvkeep.errors import (AMBIGUOUS_CODES, Aborted, FailedPrecondition,
                           InvalidArgument, KvKeepError, Unavailable, error_for,
                           from_rpc_error)
from kvkeep.mirror import BlockTableMirror
from kvkeep.pool import MappedPool
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

__all__ = ["Client", "Session", "DecodeStream"]

_UNKNOWN = object()


class _Connection:
    def __init__(self, address: str, token: Optional[str], tls: TlsArg,
                 options: Options):
        self.address = address
        self.options = options
        self.metadata = _core.metadata(token)
        creds = _core.channel_credentials(tls)
        opts = _core.channel_options(options)
        self.channel = (grpc.aio.secure_channel(address, creds, opts) if creds
                        else grpc.aio.insecure_channel(address, opts))
        self.stub = pb_grpc.KvKeepStub(self.channel)
        self._info: Optional[pb.ServerInfo] = None

    async def call(self, method: str, request: Any, *,
                   on_attempt_error: Optional[Callable[[grpc.RpcError, int], Any]] = None,
                   stream: bool = False) -> Any:
        retry = method in _core.RETRIED
        waits = self.options.waits() if retry else iter(())
        fn = getattr(self.stub, method)
        attempt = 0
        while True:
            attempt += 1
            try:
                if stream:
                    call = fn(request, metadata=self.metadata,
                              timeout=self.options.deadline)
                    return [m async for m in call]
                return await fn(request, metadata=self.metadata,
                                timeout=self.options.deadline)
            except grpc.RpcError as e:
                if on_attempt_error is not None:
                    handled = on_attempt_error(e, attempt)
                    if handled is not None:
                        return handled
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    wait = next(waits, None)
                    if wait is not None:
                        await asyncio.sleep(wait)
                        continue
                    if attempt > 1:
                        raise Unavailable(
                            f"{method} to {self.address} failed after {attempt} "
                            f"attempts: {e.details()}", method=method) from None
                raise from_rpc_error(e, method) from None

    async def info(self, refresh: bool = False) -> pb.ServerInfo:
        if self._info is not None and not refresh:
            return self._info
        self._info = await self.call("GetServerInfo", pb.GetServerInfoRequest())
        return self._info

    async def block_tables(self, session_id: str,
                           layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        """Every page of GetBlockTables, joined (see the sync client)."""
        for attempt in range(3):
            whole = pb.GetBlockTablesResponse()
            token = ""
            try:
                while True:
                    page = await self.call("GetBlockTables", pb.GetBlockTablesRequest(
                        session_id=session_id, layers=list(layers), page_token=token))
                    _core.add_block_table_page(whole, page)
                    token = page.next_page_token
                    if not token:
                        return whole
            except Aborted:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def layout(self, name: str) -> pb.Layout:
        layout = _core.find_layout(await self.info(), name)
        if layout is None:
            info = await self.info(refresh=True)
            layout = _core.find_layout(info, name)
            if layout is None:
                raise _core.not_found_layout(name, info)
        return layout


async def _close(c: _Connection, session_id: str) -> Optional[int]:
    lost = []

    def on_error(e: grpc.RpcError, attempt: int) -> Any:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            lost.append(attempt)
        if attempt > 1 and lost and e.code() == grpc.StatusCode.NOT_FOUND:
            return _UNKNOWN
        return None

    resp = await c.call("CloseSession", pb.CloseSessionRequest(session_id=session_id),
                        on_attempt_error=on_error)
    return None if resp is _UNKNOWN else resp.freed_pages


class Client:
    """kvkeep.Client on asyncio; the same arguments and methods, awaited."""

    def __init__(self, address: str = "127.0.0.1:50051", token: Optional[str] = None,
                 tls: TlsArg = None, options: Optional[Options] = None):
        if not address:
            raise InvalidArgument("Client: empty address", client_side=True)
        self._c = _Connection(address, token, tls, options or Options())

    @property
    def address(self) -> str:
        return self._c.address

    async def close_channel(self) -> None:
        await self._c.channel.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close_channel()

    async def info(self, refresh: bool = True) -> pb.ServerInfo:
        return await self._c.info(refresh=refresh)

    async def policy(self, name: str) -> pb.PolicyInfo:
        return _core.find_policy(await self._c.info(), name)

    async def create_session(self, layout: str, policy: str = "",
                             budget: BudgetArg = None, *,
                             idempotency_key: Optional[str] = None,
                             idle_timeout_seconds: float = 0,
                             **params: Any) -> "Session":
        """See kvkeep.Client.create_session."""
        info = await self._c.info()
        lay = await self._c.layout(layout)
        pinfo = _core.find_policy(info, policy) if policy else None
        checked = _core.check_policy_params(pinfo, params) if pinfo else \
            {k: str(v) for k, v in params.items()}
        req = pb.CreateSessionRequest(
            layout=layout, policy=policy, policy_params=checked,
            budget=_core.budget_proto(budget),
            idempotency_key=idempotency_key or _core.new_id(),
            idle_timeout_seconds=idle_timeout_seconds)
        resp = await self._c.call("CreateSession", req)
        if pinfo is None:
            stats = await self.stats(resp.session_id)
            pinfo = _core.find_policy(info, stats.policy)
        handle = SessionHandle(
            id=resp.session_id, layout=lay, policy=pinfo,
            layer_budgets=list(resp.layer_budgets),
            max_message_bytes=info.max_message_bytes,
            tables=BlockTableMirror(lay.page_tokens, resp.layer_versions))
        return Session(self._c, handle)

    async def open_session(self, session_id: str) -> "Session":
        stats = await self.stats(session_id)
        info = await self._c.info()
        lay = await self._c.layout(stats.layout)
        tables = await self._c.block_tables(session_id)
        handle = SessionHandle(
            id=session_id, layout=lay, policy=_core.find_policy(info, stats.policy),
            layer_budgets=list(stats.layer_budget),
            max_message_bytes=info.max_message_bytes,
            tables=BlockTableMirror.from_tables(tables))
        return Session(self._c, handle)

    async def stats(self, session_id: str) -> pb.SessionStats:
        return await self._c.call("GetSessionStats",
                                  pb.GetSessionStatsRequest(session_id=session_id))

    async def keep_alive(self, session_id: str) -> pb.KeepAliveResponse:
        """See kvkeep.Client.keep_alive."""
        return await self._c.call("KeepAlive",
                                  pb.KeepAliveRequest(session_id=session_id))

    async def list(self) -> List[pb.SessionStats]:
        return list((await self._c.call("ListSessions",
                                        pb.ListSessionsRequest())).sessions)

    async def close(self, session_id: str) -> Optional[int]:
        return await _close(self._c, session_id)

    async def block_tables(self, session_id: str,
                           layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        return await self._c.block_tables(session_id, layers)

    async def transfer(self, session_id: str, target: str, *, target_token: str = "",
                       transport: str = "", transfer_id: Optional[str] = None
                       ) -> pb.TransferSessionResponse:
        req = pb.TransferSessionRequest(
            session_id=session_id, target=target, target_token=target_token,
            transport=transport, transfer_id=transfer_id or _core.new_id())
        return await self._c.call("TransferSession", req)

    async def map_pool(self, layout: str = "", session_id: str = "") -> MappedPool:
        return MappedPool(await self._c.call(
            "MapPool", pb.MapPoolRequest(layout=layout, session_id=session_id)))


class Session:
    """kvkeep.Session on asyncio: ``async with`` closes it."""

    def __init__(self, conn: _Connection, handle: SessionHandle):
        self._c = conn
        self._h = handle
        self._stream: Optional[DecodeStream] = None

    id = property(lambda self: self._h.id)
    layout = property(lambda self: self._h.layout)
    policy = property(lambda self: self._h.policy)
    layer_budgets = property(lambda self: list(self._h.layer_budgets))
    tables = property(lambda self: self._h.tables)
    in_sync = property(lambda self: self._h.in_sync)

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self._h.closed:
            try:
                await self.close()
            except KvKeepError:
                if exc[0] is None:
                    raise

    async def _mutating(self, coro: Any) -> Any:
        try:
            return await coro
        except KvKeepError as e:
            if e.code in AMBIGUOUS_CODES and not e.client_side:
                self._h.in_sync = False
            raise

    async def append(self, keys: Any, values: Any, positions: Any) -> pb.StepResult:
        _core.check_step(self._h, None, None)
        packed = _core.pack_tokens(self.layout, (keys, values, positions))
        req = packed.to_proto(pb.AppendRequest(session_id=self.id))
        result = await self._mutating(self._c.call("Append", req))
        self.tables.apply(result, packed.positions)
        return result

    async def append_prefill(self, keys: Any, values: Any, positions: Any, *,
                             max_chunk_tokens: int = 0) -> List[pb.StepResult]:
        _core.check_step(self._h, None, None)
        packed = _core.pack_tokens(self.layout, (keys, values, positions))
        ranges = _core.chunk_tokens(self.layout, packed, self._h.max_message_bytes,
                                    max_chunk_tokens)
        reqs = [packed.to_proto(pb.AppendRequest(session_id=self.id if i == 0 else ""),
                                a, b) for i, (a, b) in enumerate(ranges)]

        async def send() -> pb.AppendPrefillResponse:
            try:
                return await self._c.stub.AppendPrefill(
                    iter(reqs), metadata=self._c.metadata,
                    timeout=self._c.options.stream_deadline)
            except grpc.RpcError as e:
                raise from_rpc_error(e, "AppendPrefill") from None

        resp = await self._mutating(send())
        if len(resp.chunks) != len(ranges):
            self._h.in_sync = False
            raise error_for(grpc.StatusCode.INTERNAL,
                            f"AppendPrefill answered {len(resp.chunks)} chunks for "
                            f"{len(ranges)}", method="AppendPrefill")
        for (a, b), chunk in zip(ranges, resp.chunks):
            self.tables.apply(chunk, packed.positions[a:b])
        return list(resp.chunks)

    def decode(self, *, reopen: bool = False) -> "DecodeStream":
        return DecodeStream(self, reopen=reopen)

    async def step(self, token: Optional[TokensArg] = None,
                   scores: Optional[Scores] = None) -> pb.DecodeStepResult:
        if self._stream is None:
            self._stream = DecodeStream(self, reopen=True)
        return await self._stream.step(token, scores)

    async def score(self, scores: Scores) -> pb.DecodeStepResult:
        return await self.step(None, scores)

    async def compress(self, scores: Scores, *, causal: bool = True) -> pb.StepResult:
        _core.check_step(self._h, None, None)
        if causal:
            scores = _core.causal_window(scores, self.tables)
        window = _core.scores_to_proto(scores, self.layout, self.policy, self.tables,
                                       compress=True)
        req = pb.CompressPromptRequest(session_id=self.id, window=window)
        result = await self._mutating(self._c.call("CompressPrompt", req))
        self.tables.apply(result)
        return result

    async def resync(self) -> BlockTableMirror:
        tables = await self._c.block_tables(self.id)
        self._h.tables = BlockTableMirror.from_tables(tables)
        self._h.in_sync = True
        return self._h.tables

    async def close(self) -> Optional[int]:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        freed = await _close(self._c, self.id)
        self._h.closed = True
        return freed

    async def block_tables(self, layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        return await self._c.block_tables(self.id, layers)

    async def read_kv(self, layers: Sequence[int] = ()) -> List[LayerKv]:
        chunks = await self._c.call("ReadKv", pb.ReadKvRequest(
            session_id=self.id, layers=list(layers)), stream=True)
        return _core.assemble_kv(self.layout, chunks, list(layers))

    async def stats(self) -> pb.SessionStats:
        return await self._c.call("GetSessionStats",
                                  pb.GetSessionStatsRequest(session_id=self.id))

    async def keep_alive(self) -> pb.KeepAliveResponse:
        """Renews the session's lease; see kvkeep.Client.keep_alive."""
        return await self._c.call("KeepAlive",
                                  pb.KeepAliveRequest(session_id=self.id))

    async def map_pool(self) -> MappedPool:
        return MappedPool(await self._c.call("MapPool",
                                             pb.MapPoolRequest(session_id=self.id)))


class DecodeStream:
    """kvkeep.DecodeStream on asyncio (same rules; ``async with`` closes it)."""

    def __init__(self, session: Session, *, reopen: bool = False):
        self._s = session
        self.reopen = reopen
        self._call: Any = None
        self._ended: Optional[KvKeepError] = None
        self._finished = False
        self._first = True

    async def __aenter__(self) -> "DecodeStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def step(self, token: Optional[TokensArg] = None,
                   scores: Optional[Scores] = None) -> pb.DecodeStepResult:
        h = self._s._h
        req, packed = _core.decode_step_request(h, token, scores, self._ended,
                                                self._finished, self.reopen)
        c = self._s._c
        if self._call is None:
            self._call = c.stub.Decode(metadata=c.metadata,
                                       timeout=c.options.stream_deadline)
            self._first = True
            self._ended = None
        if self._first:
            req.session_id = h.id
            self._first = False
        try:
            wrote = False
            await self._call.write(req)
            wrote = True
            result = await self._call.read()
        except grpc.RpcError as e:
            err = from_rpc_error(e, "Decode")
            if not wrote and err.code == grpc.StatusCode.INTERNAL and \
                    "from Core" in err.message:
                # grpc.aio reports a write on a broken connection (kvkeepd
                # gone) as INTERNAL "Internal error from Core"; a stream the
                # server ended raises the server's status instead.
                err = Unavailable(f"the connection to {c.address} broke during the "
                                  f"decode stream of session {h.id} ({err.message})",
                                  method="Decode")
            return await self._fail(err)
        except asyncio.InvalidStateError:
            result = grpc.aio.EOF
        if result is grpc.aio.EOF:
            code = await self._call.code()
            details = await self._call.details()
            if code == grpc.StatusCode.OK:
                code, details = grpc.StatusCode.INTERNAL, (
                    f"the server ended the decode stream of session {h.id} "
                    "without answering a step")
            return await self._fail(error_for(code, details or "", method="Decode"))
        h.tables.apply_decode(result, packed.positions if packed is not None else ())
        return result

    async def _fail(self, err: KvKeepError) -> Any:
        if err.code in AMBIGUOUS_CODES:
            self._s._h.in_sync = False
        self._ended = err
        if self._call is not None:
            self._call.cancel()
        self._call = None
        raise err

    async def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            try:
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass
        self._finished = True
