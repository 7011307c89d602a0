"""The synchronous kvkeep client (``kvkeep.Client``).

    import kvkeep, numpy as np
    client = kvkeep.Client("127.0.0.1:50051")
    with client.create_session("demo", "h2o", budget=512, recent=64) as s:
        s.append_prefill(keys, values, positions)   # [layers][n][kv_heads][head_dim]
        result = s.step((k, v, pos), scores=kvkeep.reduced(rows))
        s.tables.positions(0)                        # which position is in which slot

Thread-safety: a Client is thread-safe (each call is its own RPC). A Session,
its DecodeStream and its mirror are driven by one thread at a time: the
store applies one session's calls in arrival order, and the mirror follows
them in that order.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence

import grpc

from kvkeep import _core, _fleet, _watch
from kvkeep._core import (BudgetArg, LayerKv, Options, Scores, SessionHandle, TlsArg,
                          TokensArg)
from kvkeep.errors import (AMBIGUOUS_CODES, Aborted, FailedPrecondition, KvKeepError,
                           Unavailable, error_for, from_rpc_error)
from kvkeep.mirror import BlockTableMirror
from kvkeep.pool import MappedPool
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

__all__ = ["Client", "Session", "DecodeStream", "EventWatch"]


class _Connection(_fleet.Route):
    """Channel, stub, options and the cached ServerInfo of one client (or,
    in a fleet, of one replica or one session handle: _fleet.Route)."""

    @classmethod
    def open(cls, address: str, token: Optional[str], tls: TlsArg, options: Options,
             *, round_robin: bool = False, replica: str = "") -> "_Connection":
        creds = _core.channel_credentials(tls)
        opts = _core.channel_options(options, round_robin)
        channel = (grpc.secure_channel(address, creds, opts) if creds
                   else grpc.insecure_channel(address, opts))
        return cls(address, options, _core.metadata(token), channel,
                   pb_grpc.KvKeepStub(channel), replica)

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self._lock = threading.Lock()

    def followed(self, e: grpc.RpcError, method: str) -> bool:
        """follow(e), then on_move once switched (see Route.moved_error)."""
        if not self.follow(e):
            return False
        if self.on_move is not None:
            self.follows = False  # one move per call: the reload follows none
            try:
                self.on_move()
            except KvKeepError as err:
                raise self.moved_error(err, method) from None
            finally:
                self.follows = True
        return True

    def call(self, method: str, request: Any, *, retry: Optional[bool] = None,
             on_attempt_error: Optional[Callable[[grpc.RpcError, int], Any]] = None,
             stream: bool = False) -> Any:
        """One RPC with the token, a deadline per attempt and the retry rule;
        a moved session is followed once (fleet handles).

        on_attempt_error(err, attempt) may return a value to end with (e.g.
        CloseSession's NOT_FOUND after a lost attempt)."""
        retry = method in _core.RETRIED if retry is None else retry
        waits = self.options.waits() if retry else iter(())
        attempt = 0
        followed = False
        while True:
            attempt += 1
            fn = getattr(self.stub, method)
            try:
                if stream:
                    return list(fn(request, metadata=self.metadata,
                                   timeout=self.options.deadline))
                return fn(request, metadata=self.metadata, timeout=self.options.deadline)
            except grpc.RpcError as e:
                if not followed and self.followed(e, method):
                    followed = True  # once: a second move is the caller's to see
                    continue
                if on_attempt_error is not None:
                    handled = on_attempt_error(e, attempt)
                    if handled is not None:
                        return handled
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    wait = next(waits, None)
                    if wait is not None:
                        time.sleep(wait)
                        continue
                    if attempt > 1 or self.replica:
                        raise self.unavailable(method, attempt, e.details()) from None
                raise from_rpc_error(e, method) from None

    def info(self, refresh: bool = False) -> pb.ServerInfo:
        with self._lock:
            if self._info is not None and not refresh:
                return self._info
        info = self.call("GetServerInfo", pb.GetServerInfoRequest())
        with self._lock:
            self._info = info
        return info

    def block_tables(self, session_id: str,
                     layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        """Every page of GetBlockTables, joined; asked again (twice at most)
        when the session changed between pages (ABORTED)."""
        for attempt in range(3):
            whole = pb.GetBlockTablesResponse()
            token = ""
            try:
                while True:
                    page = self.call("GetBlockTables", pb.GetBlockTablesRequest(
                        session_id=session_id, layers=list(layers), page_token=token))
                    _core.add_block_table_page(whole, page)
                    token = page.next_page_token
                    if not token:
                        return whole
            except Aborted:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def layout(self, name: str) -> pb.Layout:
        layout = _core.find_layout(self.info(), name)
        if layout is None:  # layouts do not change, but a new name may be new
            info = self.info(refresh=True)
            layout = _core.find_layout(info, name)
            if layout is None:
                raise _core.not_found_layout(name, info)
        return layout


class Client(_fleet.ClientBase):
    """A connection to one kvkeepd. Thread-safe; connects lazily.

    address: host:port (or any gRPC target).
    token: bearer token, for servers with tenants configured.
    tls: None/False plaintext; True TLS with the system roots; bytes a PEM CA;
      str the path of a PEM CA file.
    options: deadlines and retries (:class:`kvkeep.Options`).
    """

    _connection = _Connection

    def close_channel(self) -> None:
        """Closes the channel (open sessions stay open on the server)."""
        self._c.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close_channel()

    # -- server ----------------------------------------------------------------

    def info(self, refresh: bool = True) -> pb.ServerInfo:
        """GetServerInfo: layouts, pools, policies (with their parameters), limits."""
        return self._c.info(refresh=refresh)

    def policy(self, name: str) -> pb.PolicyInfo:
        """What policy `name` takes and needs (ServerInfo.policy_info)."""
        return _core.find_policy(self._c.info(), name)

    def layout(self, name: str) -> pb.Layout:
        return self._c.layout(name)

    # -- sessions --------------------------------------------------------------

    def create_session(self, layout: str, policy: str = "", budget: BudgetArg = None, *,
                       idempotency_key: Optional[str] = None,
                       idle_timeout_seconds: float = 0, prefix: str = "",
                       prefix_evictable: bool = False, **params: Any) -> "Session":
        """Opens a session: use it as a context manager to close it at the end.

        policy: a name from ServerInfo.policies ("" : the server's default).
        budget: tokens per layer (int), one int per layer, or a Budget.
        params: the policy's parameters (sinks=4, recent=64, ...), checked here
          against what the server publishes for the policy; the server checks
          the budget rule and any rule in words.
        idempotency_key: a retried create with the same key returns the first
          attempt's session (default: a fresh random key, so the create is
          retried on UNAVAILABLE without ever making two sessions).
        idle_timeout_seconds: the session's lease: the server closes it once no
          call has named it for this long (0: the server's default, see
          ServerInfo.default_idle_timeout_seconds; at most
          ServerInfo.max_idle_timeout_seconds). keep_alive() renews it.
        prefix: start from this named prefix (Session.publish; docs/prefixes.md),
          sharing its pages; layout may then be "" (the prefix's). Its tokens
          are protected from eviction unless prefix_evictable.
        """
        info = self._c.info()
        lay = self._c.layout(layout) if layout or not prefix else None
        req, pinfo = _core.create_request(
            info, layout, policy, budget, params, idempotency_key=idempotency_key,
            idle_timeout_seconds=idle_timeout_seconds, prefix=prefix,
            prefix_evictable=prefix_evictable)
        resp = self._c.call("CreateSession", req)
        if pinfo is None:  # the server's default: learn it from the stats
            stats = self.stats(resp.session_id)
            pinfo = _core.find_policy(info, stats.policy)
        if prefix:  # starts with the prefix's tokens: its tables, its layout
            lay = self._c.layout(resp.layout)
            tables = BlockTableMirror.from_tables(self._c.block_tables(resp.session_id))
        else:
            tables = BlockTableMirror(lay.page_tokens, resp.layer_versions)
        handle = SessionHandle(
            id=resp.session_id, layout=lay, policy=pinfo,
            layer_budgets=list(resp.layer_budgets),
            max_message_bytes=info.max_message_bytes, tables=tables)
        return Session(self._c, handle)

    def unpublish_prefix(self, name: str, is_public: bool = False) -> int:
        """Removes a named prefix (UnpublishPrefix); returns the sessions still
        holding it (its pages go back when the last one closes)."""
        return self._c.call("UnpublishPrefix", pb.UnpublishPrefixRequest(
            name=name, is_public=is_public)).holders

    def list_prefixes(self) -> List[pb.PrefixInfo]:
        """The tenant's named prefixes and the public ones (ListPrefixes)."""
        return list(self._c.call("ListPrefixes", pb.ListPrefixesRequest()).prefixes)

    def open_session(self, session_id: str) -> "Session":
        """A handle on an existing session (e.g. one a prefill worker made);
        its mirror starts from the store's block tables."""
        stats = self.stats(session_id)
        info = self._c.info()
        lay = self._c.layout(stats.layout)
        tables = self._c.block_tables(session_id)
        handle = SessionHandle(
            id=session_id, layout=lay, policy=_core.find_policy(info, stats.policy),
            layer_budgets=list(stats.layer_budget),
            max_message_bytes=info.max_message_bytes,
            tables=BlockTableMirror.from_tables(tables))
        return Session(self._c, handle)

    def stats(self, session_id: str) -> pb.SessionStats:
        return self._c.call("GetSessionStats",
                            pb.GetSessionStatsRequest(session_id=session_id))

    def keep_alive(self, session_id: str) -> pb.KeepAliveResponse:
        """Renews a session's lease (any call does; this one only renews): for
        a caller that holds a session between turns without calling it. NOT_FOUND
        (kvkeep.NotFound), saying "expired", once the lease has run out."""
        return self._c.call("KeepAlive", pb.KeepAliveRequest(session_id=session_id))

    def list(self) -> List[pb.SessionStats]:
        """The caller's tenant's sessions (every session without tenants).
        Listing does not renew their leases."""
        return list(self._c.call("ListSessions", pb.ListSessionsRequest()).sessions)

    def close(self, session_id: str) -> Optional[int]:
        """Closes a session; the pages it freed, or None when a retry found it
        already closed by an attempt whose reply was lost."""
        return _close(self._c, session_id)

    def block_tables(self, session_id: str,
                     layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        return self._c.block_tables(session_id, layers)

    def transfer(self, session_id: str, target: str, *, target_token: str = "",
                 transport: str = "", transfer_id: Optional[str] = None
                 ) -> pb.TransferSessionResponse:
        """Moves a session to the kvkeepd at `target` (TransferSession).

        A transfer id is made when none is given, so a lost attempt is retried
        safely (the target never makes a second copy of one transfer). Each
        attempt has Options.deadline: raise it for large sessions."""
        req = pb.TransferSessionRequest(
            session_id=session_id, target=target, target_token=target_token,
            transport=transport, transfer_id=transfer_id or _core.new_id())
        return self._c.call("TransferSession", req)

    def watch_events(self, kinds: Sequence[int] = (), *, after_sequence: int = 0,
                     incarnation: int = 0) -> "EventWatch":
        """The server's events (WatchEvents, docs/events.md): iterate the
        EventWatch for pb.Event messages; it resumes after the last one
        seen when iterated again after its stream ended."""
        return EventWatch(self._c, list(kinds), after_sequence, incarnation)

    def map_pool(self, layout: str = "", session_id: str = "") -> MappedPool:
        """Maps a layout's host pool (shared memory) read-only into numpy.

        kvkeepd must run with --share_pools (FailedPrecondition otherwise).
        With session_id the reply also carries that session's block tables."""
        resp = self._c.call("MapPool", pb.MapPoolRequest(layout=layout,
                                                         session_id=session_id))
        return MappedPool(resp)


def _close(c: _Connection, session_id: str) -> Optional[int]:
    lost = []

    def on_error(e: grpc.RpcError, attempt: int) -> Any:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            lost.append(attempt)
        if attempt > 1 and lost and e.code() == grpc.StatusCode.NOT_FOUND:
            return _UNKNOWN
        return None

    resp = c.call("CloseSession", pb.CloseSessionRequest(session_id=session_id),
                  on_attempt_error=on_error)
    return None if resp is _UNKNOWN else resp.freed_pages


_UNKNOWN = object()


class Session:
    """One open session. A context manager: leaving the block closes it.

    Attributes:
      id, layout (proto Layout), policy (proto PolicyInfo), layer_budgets.
      tables: the BlockTableMirror, updated by every call made through this
        object; `tables.positions(l)` is the original position in each slot
        of layer l, `tables.version(l)` the version to compute attention at.
    """

    def __init__(self, conn: _Connection, handle: SessionHandle):
        # In a fleet each handle has its own route: it follows its session.
        self._c = conn.route() if conn.redirect is not None else conn
        self._h = handle
        self._stream: Optional[DecodeStream] = None
        if self._c.follows:
            self._c.on_move = self._reload_tables

    def _reload_tables(self) -> None:
        """After a move: the same slots on the new replica's pages (a resync;
        until one succeeds, changes raise OutOfSync)."""
        self._h.in_sync = False
        self._h.tables = BlockTableMirror.from_tables(self._c.block_tables(self.id))
        self._h.in_sync = True

    # -- what it is ------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._h.id

    @property
    def layout(self) -> pb.Layout:
        return self._h.layout

    @property
    def policy(self) -> Optional[pb.PolicyInfo]:
        return self._h.policy

    @property
    def layer_budgets(self) -> List[int]:
        return list(self._h.layer_budgets)

    @property
    def tables(self) -> BlockTableMirror:
        return self._h.tables

    @property
    def in_sync(self) -> bool:
        """False after a call whose outcome is unknown: call resync()."""
        return self._h.in_sync

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._h.closed:
            try:
                self.close()
            except KvKeepError:
                if exc[0] is None:
                    raise

    def __repr__(self) -> str:
        return f"Session({self.id}, layout={self.layout.name}, " \
               f"policy={self.policy.name if self.policy else '?'})"

    # -- changing it -----------------------------------------------------------

    def _mutating(self, method: str, fn: Callable[[], Any]) -> Any:
        _core.check_step(self._h, None, None)
        try:
            return fn()
        except KvKeepError as e:
            if e.code in AMBIGUOUS_CODES and not e.client_side:
                self._h.in_sync = False
            raise

    def append(self, keys: Any, values: Any, positions: Any) -> pb.StepResult:
        """Appends tokens in one message (typically one decode token).

        keys, values: [num_layers][n][kv_heads][head_dim] of the layout's dtype;
        positions: n strictly increasing original positions."""
        packed = _core.pack_tokens(self.layout, (keys, values, positions))
        req = packed.to_proto(pb.AppendRequest(session_id=self.id))
        result = self._mutating("Append", lambda: self._c.call("Append", req))
        self.tables.apply(result, packed.positions)
        return result

    def append_prefill(self, keys: Any, values: Any, positions: Any, *,
                       max_chunk_tokens: int = 0) -> List[pb.StepResult]:
        """Appends a prompt of any length on one AppendPrefill stream, cut
        into chunks under the server's message limit; one result per chunk."""
        packed = _core.pack_tokens(self.layout, (keys, values, positions))
        ranges = _core.chunk_tokens(self.layout, packed, self._h.max_message_bytes,
                                    max_chunk_tokens)

        def requests() -> Iterator[pb.AppendRequest]:
            for i, (a, b) in enumerate(ranges):
                yield packed.to_proto(pb.AppendRequest(session_id=self.id if i == 0 else ""),
                                      a, b)

        def send() -> pb.AppendPrefillResponse:
            # A moved session refuses the first chunk (nothing appended):
            # the whole prompt goes once more, to its new replica.
            for followed in (False, True):
                try:
                    return self._c.stub.AppendPrefill(
                        requests(), metadata=self._c.metadata,
                        timeout=self._c.options.stream_deadline)
                except grpc.RpcError as e:
                    if not followed and self._c.followed(e, "AppendPrefill"):
                        continue
                    raise self._c.name_unavailable(
                        from_rpc_error(e, "AppendPrefill"), "AppendPrefill") from None
            raise AssertionError("unreachable")

        resp = self._mutating("AppendPrefill", send)
        if len(resp.chunks) != len(ranges):
            self._h.in_sync = False
            raise error_for(grpc.StatusCode.INTERNAL,
                            f"AppendPrefill answered {len(resp.chunks)} chunks for "
                            f"{len(ranges)}", method="AppendPrefill")
        for (a, b), chunk in zip(ranges, resp.chunks):
            self.tables.apply(chunk, packed.positions[a:b])
        return list(resp.chunks)

    def decode(self, *, reopen: bool = False) -> "DecodeStream":
        """A Decode stream (one write and one read per step). With reopen, a
        step after a failed one opens a new stream instead of raising."""
        return DecodeStream(self, reopen=reopen)

    def step(self, token: Optional[TokensArg] = None, scores: Optional[Scores] = None
             ) -> pb.DecodeStepResult:
        """One decode step on the session's own stream (opened on first use,
        reopened after an error): the token (keys, values, positions) is
        appended first, then `scores` (kvkeep.reduced/per_head/queries)
        apply, at the versions the mirror holds before the append."""
        if self._stream is None:
            self._stream = DecodeStream(self, reopen=True)
        return self._stream.step(token, scores)

    def score(self, scores: Scores) -> pb.DecodeStepResult:
        """A score-only step (no new token)."""
        return self.step(None, scores)

    def compress(self, scores: Scores, *, causal: bool = True) -> pb.StepResult:
        """SnapKV's one-shot compression: the observation window's attention,
        per layer `rows` = the policy's window. With causal (default), what
        each window row cannot see (later slots) is zeroed here."""
        _core.check_step(self._h, None, None)
        if causal:
            scores = _core.causal_window(scores, self.tables)
        window = _core.scores_to_proto(scores, self.layout, self.policy, self.tables,
                                       compress=True)
        req = pb.CompressPromptRequest(session_id=self.id, window=window)
        result = self._mutating("CompressPrompt",
                                lambda: self._c.call("CompressPrompt", req))
        self.tables.apply(result)
        return result

    def resync(self) -> BlockTableMirror:
        """Rebuilds the mirror from GetBlockTables (after an unknown outcome)."""
        tables = self._c.block_tables(self.id)
        self._h.tables = BlockTableMirror.from_tables(tables)
        self._h.in_sync = True
        return self._h.tables

    def close(self) -> Optional[int]:
        """Closes the session (and its stream); the pages it freed (None when
        unknown: a lost attempt closed it)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        freed = _close(self._c, self.id)
        self._h.closed = True
        return freed

    # -- reading it ------------------------------------------------------------

    def block_tables(self, layers: Sequence[int] = ()) -> pb.GetBlockTablesResponse:
        return self._c.block_tables(self.id, layers)

    def read_kv(self, layers: Sequence[int] = ()) -> List[LayerKv]:
        """The resident keys and values of `layers` (default all), slot order."""
        chunks = self._c.call("ReadKv", pb.ReadKvRequest(session_id=self.id,
                                                         layers=list(layers)),
                              stream=True)
        return _core.assemble_kv(self.layout, chunks, list(layers))

    def stats(self) -> pb.SessionStats:
        return self._c.call("GetSessionStats", pb.GetSessionStatsRequest(session_id=self.id))

    def keep_alive(self) -> pb.KeepAliveResponse:
        """Renews the session's lease; see Client.keep_alive."""
        return self._c.call("KeepAlive", pb.KeepAliveRequest(session_id=self.id))

    def map_pool(self) -> MappedPool:
        """Maps this session's layout's pool; `.tables` has its block tables."""
        resp = self._c.call("MapPool", pb.MapPoolRequest(session_id=self.id))
        return MappedPool(resp)

    # -- forking it ------------------------------------------------------------

    def publish(self, name: str, is_public: bool = False) -> pb.PrefixInfo:
        """Publishes this session's current state as a named prefix
        (PublishPrefix): Client.create_session(prefix=name) then starts
        sessions from it, sharing its pages. This session lives on."""
        return self._c.call("PublishPrefix", pb.PublishPrefixRequest(
            session_id=self.id, name=name, is_public=is_public))

    def fork(self, policy: str = "", budget: BudgetArg = None, *,
             idempotency_key: Optional[str] = None, **params: Any) -> "Session":
        """A child session at this one's current state, sharing its pages
        copy-on-write (ForkSession): no prefill, no copy until either writes.

        policy, params: the child's policy and its parameters ("" : this
          session's, parameters and all). budget: the child's budget (None:
          this session's per-layer budgets).
        idempotency_key: a retried fork with the same key returns the first
          attempt's child (default: a fresh random key, so the fork is retried
          on UNAVAILABLE without ever making two children).
        The child's mirror starts as a copy of this one's block tables.
        """
        info = self._c.info()
        req, pinfo = _core.fork_request(info, self._h, policy, budget, params,
                                        idempotency_key)
        resp = self._c.call("ForkSession", req)
        tables = BlockTableMirror.from_tables(self._c.block_tables(resp.session_id))
        handle = SessionHandle(
            id=resp.session_id, layout=self.layout, policy=pinfo,
            layer_budgets=list(resp.layer_budgets),
            max_message_bytes=info.max_message_bytes, tables=tables)
        return Session(self._c, handle)


class DecodeStream:
    """A Decode stream of one session: step() is one write and one read.

    A failed step changed nothing on the server when the server refused it
    (the exception's class says why); the stream then ends. Without reopen,
    later steps raise FailedPrecondition; with reopen, the next step opens a
    new stream. When the outcome is unknown (the connection broke: the
    exception is Unavailable or another ambiguous code), the session's
    mirror is marked out of sync and steps raise OutOfSync until
    Session.resync(). A context manager: leaving it half-closes the stream.
    """

    _END = object()

    def __init__(self, session: Session, *, reopen: bool = False):
        self._s = session
        self.reopen = reopen
        self._queue: Optional["queue.Queue[Any]"] = None
        self._call: Any = None
        self._ended: Optional[KvKeepError] = None
        self._finished = False

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _open(self) -> None:
        q: "queue.Queue[Any]" = queue.Queue()
        END = self._END

        def requests() -> Iterator[pb.DecodeStep]:
            while True:
                item = q.get()
                if item is END:
                    return
                yield item

        c = self._s._c
        self._queue = q
        self._call = c.stub.Decode(requests(), metadata=c.metadata,
                                   timeout=c.options.stream_deadline)
        self._first = True
        self._ended = None

    def _end(self, cancel: bool) -> None:
        if self._queue is not None:
            self._queue.put(self._END)
        if cancel and self._call is not None:
            self._call.cancel()
        self._queue = None
        self._call = None

    def step(self, token: Optional[TokensArg] = None, scores: Optional[Scores] = None
             ) -> pb.DecodeStepResult:
        """One step: `token` (keys, values, positions; or None) is appended
        first, then `scores` apply at the mirror's versions before the append.
        Returns the DecodeStepResult, already applied to session.tables."""
        return self._step(token, scores, may_follow=True)

    def _step(self, token: Optional[TokensArg], scores: Optional[Scores],
              may_follow: bool) -> pb.DecodeStepResult:
        h = self._s._h
        req, packed = _core.decode_step_request(h, token, scores, self._ended,
                                                self._finished, self.reopen)
        if self._call is None:
            self._open()
        first = self._first
        if first:
            req.session_id = h.id
            self._first = False
        assert self._queue is not None
        self._queue.put(req)
        try:
            result = next(self._call)
        except StopIteration:
            err = error_for(grpc.StatusCode.INTERNAL,
                            f"the server ended the decode stream of session {h.id} "
                            "without answering a step", method="Decode")
            return self._fail(err)
        except grpc.RpcError as e:
            # A moved session refuses a stream's first step (nothing applied):
            # it goes once more, on a stream to the new replica.
            try:
                moved = first and may_follow and self._s._c.followed(e, "Decode")
            except KvKeepError as err:
                return self._fail(err)
            if moved:
                self._end(cancel=True)
                return self._step(token, scores, may_follow=False)
            return self._fail(self._s._c.name_unavailable(from_rpc_error(e, "Decode"),
                                                          "Decode"))
        h.tables.apply_decode(result, packed.positions if packed is not None else ())
        return result

    def _fail(self, err: KvKeepError) -> Any:
        if err.code in AMBIGUOUS_CODES:
            self._s._h.in_sync = False
        self._ended = err
        self._end(cancel=True)
        raise err

    def close(self) -> None:
        """Half-closes the stream and waits for its end. Idempotent."""
        if self._call is not None:
            call = self._call
            self._end(cancel=False)
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass
        self._finished = True


class EventWatch(_watch.EventWatchBase):
    """A WatchEvents stream that remembers where it is. start() opens it
    (resuming after `last_sequence` of `incarnation`) and returns once the
    server watches; iterating yields each event once, in order (starting
    the stream if needed). The stream's end raises its KvKeepError
    (OutOfRange: resync with Client.list and watch from now); iterating
    again then resumes. cancel() ends it from another thread."""

    def _read(self) -> pb.WatchEventsResponse:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            self._call = None
            raise from_rpc_error(e, "WatchEvents") from None
        except StopIteration:
            self._call = None
            raise error_for(grpc.StatusCode.UNAVAILABLE,
                            "the server ended the event stream",
                            method="WatchEvents") from None

    def start(self) -> "EventWatch":
        self._open()
        self._started(self._read())
        return self

    def __iter__(self) -> Iterator[pb.Event]:
        if self._call is None:
            self.start()
        while True:
            while self._pending:
                yield self._next_pending()
            self._pending = list(self._read().events)
