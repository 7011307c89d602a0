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
from typing import Any, AsyncIterator, Callable, List, Optional, Sequence

import grpc
import grpc.aio

from kvkeep import _core, _fleet, _watch
from kvkeep._core import (BudgetArg, LayerKv, Options, Scores, SessionHandle, TlsArg,
                          TokensArg)
from kvkeep.errors import (AMBIGUOUS_CODES, Aborted, KvKeepError, Unavailable,
                           error_for, from_rpc_error)
from kvkeep.mirror import BlockTableMirror
from kvkeep.pool import MappedPool
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

__all__ = ["Client", "Session", "DecodeStream", "EventWatch", "Fleet"]

_UNKNOWN = object()


class _Connection(_fleet.Route):
    """The sync client's _Connection on grpc.aio."""

    @classmethod
    def open(cls, address: str, token: Optional[str], tls: TlsArg, options: Options,
             *, round_robin: bool = False, replica: str = "") -> "_Connection":
        creds = _core.channel_credentials(tls)
        opts = _core.channel_options(options, round_robin)
        channel = (grpc.aio.secure_channel(address, creds, opts) if creds
                   else grpc.aio.insecure_channel(address, opts))
        return cls(address, options, _core.metadata(token), channel,
                   pb_grpc.KvKeepStub(channel), replica)

    async def followed(self, e: grpc.RpcError, method: str) -> bool:
        """follow(e), then on_move once switched (see Route.moved_error)."""
        if not self.follow(e):
            return False
        if self.on_move is not None:
            self.follows = False  # one move per call: the reload follows none
            try:
                await self.on_move()
            except KvKeepError as err:
                raise self.moved_error(err, method) from None
            finally:
                self.follows = True
        return True

    async def call(self, method: str, request: Any, *, retry: Optional[bool] = None,
                   on_attempt_error: Optional[Callable[[grpc.RpcError, int], Any]] = None,
                   stream: bool = False) -> Any:
        retry = method in _core.RETRIED if retry is None else retry
        waits = self.options.waits() if retry else iter(())
        attempt = 0
        followed = False
        while True:
            attempt += 1
            fn = getattr(self.stub, method)
            try:
                if stream:
                    call = fn(request, metadata=self.metadata,
                              timeout=self.options.deadline)
                    return [m async for m in call]
                return await fn(request, metadata=self.metadata,
                                timeout=self.options.deadline)
            except grpc.RpcError as e:
                if not followed and await self.followed(e, method):
                    followed = True  # once: a second move is the caller's to see
                    continue
                if on_attempt_error is not None:
                    handled = on_attempt_error(e, attempt)
                    if handled is not None:
                        return handled
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    wait = next(waits, None)
                    if wait is not None:
                        await asyncio.sleep(wait)
                        continue
                    if attempt > 1 or self.replica:
                        raise self.unavailable(method, attempt, e.details()) from None
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


class Client(_fleet.ClientBase):
    """kvkeep.Client on asyncio; the same arguments and methods, awaited."""

    _connection = _Connection

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
                             idle_timeout_seconds: float = 0, prefix: str = "",
                             prefix_evictable: bool = False,
                             **params: Any) -> "Session":
        """See kvkeep.Client.create_session (prefix: start from a named
        prefix, sharing its pages; layout may then be "")."""
        info = await self._c.info()
        lay = await self._c.layout(layout) if layout or not prefix else None
        req, pinfo = _core.create_request(
            info, layout, policy, budget, params, idempotency_key=idempotency_key,
            idle_timeout_seconds=idle_timeout_seconds, prefix=prefix,
            prefix_evictable=prefix_evictable)
        resp = await self._c.call("CreateSession", req)
        if pinfo is None:
            stats = await self.stats(resp.session_id)
            pinfo = _core.find_policy(info, stats.policy)
        if prefix:  # starts with the prefix's tokens: its tables, its layout
            lay = await self._c.layout(resp.layout)
            tables = BlockTableMirror.from_tables(
                await self._c.block_tables(resp.session_id))
        else:
            tables = BlockTableMirror(lay.page_tokens, resp.layer_versions)
        handle = SessionHandle(
            id=resp.session_id, layout=lay, policy=pinfo,
            layer_budgets=list(resp.layer_budgets),
            max_message_bytes=info.max_message_bytes, tables=tables)
        return Session(self._c, handle)

    async def unpublish_prefix(self, name: str, is_public: bool = False) -> int:
        """See kvkeep.Client.unpublish_prefix."""
        return (await self._c.call("UnpublishPrefix", pb.UnpublishPrefixRequest(
            name=name, is_public=is_public))).holders

    async def list_prefixes(self) -> List[pb.PrefixInfo]:
        """See kvkeep.Client.list_prefixes."""
        return list((await self._c.call("ListPrefixes",
                                        pb.ListPrefixesRequest())).prefixes)

    def watch_events(self, kinds: Sequence[int] = (), *, after_sequence: int = 0,
                     incarnation: int = 0) -> "EventWatch":
        """See kvkeep.Client.watch_events: ``async for event in watch``."""
        return EventWatch(self._c, list(kinds), after_sequence, incarnation)

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
        # In a fleet each handle has its own route: it follows its session.
        self._c = conn.route() if conn.redirect is not None else conn
        self._h = handle
        self._stream: Optional[DecodeStream] = None
        if self._c.follows:
            self._c.on_move = self._reload_tables

    async def _reload_tables(self) -> None:
        """After a move: the same slots on the new replica's pages (see the
        sync client)."""
        self._h.in_sync = False
        self._h.tables = BlockTableMirror.from_tables(
            await self._c.block_tables(self.id))
        self._h.in_sync = True

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
            for followed in (False, True):  # a moved session: see the sync client
                try:
                    return await self._c.stub.AppendPrefill(
                        iter(reqs), metadata=self._c.metadata,
                        timeout=self._c.options.stream_deadline)
                except grpc.RpcError as e:
                    if not followed and await self._c.followed(e, "AppendPrefill"):
                        continue
                    raise self._c.name_unavailable(
                        from_rpc_error(e, "AppendPrefill"), "AppendPrefill") from None
            raise AssertionError("unreachable")

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

    async def publish(self, name: str, is_public: bool = False) -> pb.PrefixInfo:
        """See kvkeep.Session.publish."""
        return await self._c.call("PublishPrefix", pb.PublishPrefixRequest(
            session_id=self.id, name=name, is_public=is_public))

    async def fork(self, policy: str = "", budget: BudgetArg = None, *,
                   idempotency_key: Optional[str] = None, **params: Any) -> "Session":
        """See kvkeep.Session.fork: a child sharing this session's pages."""
        info = await self._c.info()
        req, pinfo = _core.fork_request(info, self._h, policy, budget, params,
                                        idempotency_key)
        resp = await self._c.call("ForkSession", req)
        tables = BlockTableMirror.from_tables(
            await self._c.block_tables(resp.session_id))
        handle = SessionHandle(
            id=resp.session_id, layout=self.layout, policy=pinfo,
            layer_budgets=list(resp.layer_budgets),
            max_message_bytes=info.max_message_bytes, tables=tables)
        return Session(self._c, handle)


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
        return await self._step(token, scores, may_follow=True)

    async def _step(self, token: Optional[TokensArg], scores: Optional[Scores],
                    may_follow: bool) -> pb.DecodeStepResult:
        h = self._s._h
        req, packed = _core.decode_step_request(h, token, scores, self._ended,
                                                self._finished, self.reopen)
        c = self._s._c
        if self._call is None:
            self._call = c.stub.Decode(metadata=c.metadata,
                                       timeout=c.options.stream_deadline)
            self._first = True
            self._ended = None
        first = self._first
        if first:
            req.session_id = h.id
            self._first = False
        try:
            result = await self._exchange(req)
        except grpc.RpcError as e:
            # A moved session refuses a stream's first step (nothing applied):
            # it goes once more, on a stream to the new replica.
            try:
                moved = first and may_follow and await c.followed(e, "Decode")
            except KvKeepError as err:
                return await self._fail(err)
            if moved:
                self._call.cancel()
                self._call = None
                return await self._step(token, scores, may_follow=False)
            return await self._fail(c.name_unavailable(from_rpc_error(e, "Decode"),
                                                       "Decode"))
        except KvKeepError as e:
            return await self._fail(e)
        h.tables.apply_decode(result, packed.positions if packed is not None else ())
        return result

    async def _exchange(self, req: pb.DecodeStep) -> pb.DecodeStepResult:
        """Writes one step and reads its answer; the stream's end raises its
        status as an RpcError."""
        c, h = self._s._c, self._s._h
        try:
            await self._call.write(req)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INTERNAL and "from Core" in (e.details() or ""):
                # grpc.aio reports a write on a broken connection (kvkeepd
                # gone) as INTERNAL "Internal error from Core"; a stream the
                # server ended raises the server's status instead.
                raise Unavailable(f"the connection to {c.where()} broke during the "
                                  f"decode stream of session {h.id} ({e.details()})",
                                  method="Decode") from None
            raise
        try:
            result = await self._call.read()
        except asyncio.InvalidStateError:
            result = grpc.aio.EOF
        if result is not grpc.aio.EOF:
            return result
        code = await self._call.code()
        details = await self._call.details()
        if code == grpc.StatusCode.OK:
            code, details = grpc.StatusCode.INTERNAL, (
                f"the server ended the decode stream of session {h.id} "
                "without answering a step")
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                   await self._call.trailing_metadata(), details)

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


class EventWatch(_watch.EventWatchBase):
    """kvkeep.EventWatch on asyncio: ``await watch.start()``, then ``async
    for event in watch`` yields each event once, in order; iterating again
    after the stream ended resumes after the last one seen."""

    async def _read(self) -> pb.WatchEventsResponse:
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            self._call = None
            raise from_rpc_error(e, "WatchEvents") from None
        if msg is grpc.aio.EOF:
            self._call = None
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            "the server ended the event stream", method="WatchEvents")
        return msg

    async def start(self) -> "EventWatch":
        self._open()
        self._started(await self._read())
        return self

    async def __aiter__(self) -> AsyncIterator[pb.Event]:
        if self._call is None:
            await self.start()
        while True:
            while self._pending:
                yield self._next_pending()
            self._pending = list((await self._read()).events)


from kvkeep.aio_fleet import Fleet  # noqa: E402  (it builds on the classes above)
