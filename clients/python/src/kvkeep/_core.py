"""What the sync and the asyncio clients share: no I/O in here.

Channel options, retry rules, request building from numpy arrays (with every
shape and dtype checked before anything is sent), policy-parameter checks
against ``ServerInfo.policy_info``, and the conversions of replies.
"""

from __future__ import annotations

import math
import os
import random
import uuid
from dataclasses import dataclass, field
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc
import numpy as np

from kvkeep.errors import (FailedPrecondition, InvalidArgument, KvKeepError,
                           NotFound, ResourceExhausted)
from kvkeep.mirror import BlockTableMirror
from kvkeep.v1 import kvkeep_pb2 as pb

ArrayLike = Any  # numpy array, or anything np.asarray takes

# ---------------------------------------------------------------------------
# Options, channels, retries


@dataclass(frozen=True)
class Options:
    """How a client calls: deadlines in seconds, retries on UNAVAILABLE.

    deadline: of each attempt of a unary or server-streaming call.
    stream_deadline: of a whole Decode or AppendPrefill stream (None: none;
      a decode loop lives as long as its sequence).
    retries, backoff, max_backoff: an idempotent call that fails with
      UNAVAILABLE is sent again up to `retries` times, the first after
      `backoff` seconds, each later wait doubled up to `max_backoff`, each
      jittered by +-20% (the C++ client's schedule). The channel's reconnect
      backoff follows the same bounds.
    """

    deadline: float = 30.0
    stream_deadline: Optional[float] = None
    retries: int = 4
    backoff: float = 0.1
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.max_backoff < self.backoff:
            raise InvalidArgument("Options: retries and backoff must be >= 0 and "
                                  "max_backoff >= backoff", client_side=True)
        if self.deadline <= 0 or (self.stream_deadline is not None and
                                  self.stream_deadline <= 0):
            raise InvalidArgument("Options: deadlines must be positive",
                                  client_side=True)

    def waits(self) -> Iterator[float]:
        """The waits before each retry, jittered."""
        wait = self.backoff
        for _ in range(self.retries):
            yield wait * random.uniform(0.8, 1.2)
            wait = min(wait * 2, self.max_backoff)


# Whether a method is retried on UNAVAILABLE (docs/cli.md "Retries"): reads
# always; CreateSession and ForkSession with an idempotency key (this client
# always sends one); CloseSession (NOT_FOUND after a lost attempt means it closed);
# TransferSession with a transfer id (always sent). Calls that change a
# session are never retried: after a lost reply only the caller can decide.
RETRIED = frozenset({
    "GetServerInfo", "GetSessionStats", "ListSessions", "GetBlockTables",
    "ReadKv", "MapPool", "CreateSession", "ForkSession", "CloseSession",
    "TransferSession", "KeepAlive", "ListPrefixes",
})

TlsArg = Union[None, bool, str, bytes]


def channel_credentials(tls: TlsArg) -> Optional[grpc.ChannelCredentials]:
    """None/False: plaintext. True: TLS with the system roots. bytes: a PEM CA.
    str: the path of a PEM CA file."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, str):
        with open(tls, "rb") as f:
            tls = f.read()
    return grpc.ssl_channel_credentials(root_certificates=tls)


def channel_options(options: Options, round_robin: bool = False) -> List[Tuple[str, Any]]:
    """round_robin: spread calls over every address the target resolves to
    (a fleet's discovery)."""
    ms = lambda s: max(1, min(int(s * 1000), 1 << 30))  # noqa: E731
    return [
        ("grpc.initial_reconnect_backoff_ms", ms(options.backoff)),
        ("grpc.max_reconnect_backoff_ms", ms(options.max_backoff)),
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
    ] + ([("grpc.lb_policy_name", "round_robin")] if round_robin else [])


def metadata(token: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def new_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------
# Layouts and dtypes

_NP_DTYPE = {
    pb.DTYPE_F32: np.dtype("<f4"),
    pb.DTYPE_F16: np.dtype("<f2"),
    pb.DTYPE_BF16: np.dtype("<u2"),  # raw bfloat16 bits
}
DTYPE_NAME = {pb.DTYPE_F32: "f32", pb.DTYPE_F16: "f16", pb.DTYPE_BF16: "bf16"}


def numpy_dtype(layout: pb.Layout) -> np.dtype:
    """The numpy dtype KV of `layout` is returned in (bf16: uint16 bits)."""
    try:
        return _NP_DTYPE[layout.dtype]
    except KeyError:
        raise InvalidArgument(f"layout '{layout.name}' has dtype {layout.dtype}, "
                              "which this client does not know",
                              client_side=True) from None


def kv_array(a: ArrayLike, layout: pb.Layout, what: str) -> np.ndarray:
    """`a` as a little-endian array of the layout's dtype, without conversion.

    f32 layouts take float32, f16 take float16, bf16 take uint16 (the bits) or
    a ``bfloat16`` dtype (ml_dtypes, what JAX and others use): the bytes are
    sent as they are, so a wrong dtype is refused rather than converted.
    """
    arr = np.asarray(a)
    want = numpy_dtype(layout)
    got = arr.dtype
    ok = (got.kind == want.kind and got.itemsize == want.itemsize) or (
        layout.dtype == pb.DTYPE_BF16 and got.name == "bfloat16")
    if not ok:
        raise InvalidArgument(
            f"{what}: dtype {got} for layout '{layout.name}' of "
            f"{DTYPE_NAME[layout.dtype]} (send "
            f"{'uint16 bits or bfloat16' if layout.dtype == pb.DTYPE_BF16 else want.name};"
            " the client does not convert)", client_side=True)
    if got.name == "bfloat16":
        arr = arr.view(np.uint16)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def f32_to_bf16(a: ArrayLike) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even (NaN kept)."""
    f = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_to_f32(bits: ArrayLike) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    b = np.asarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------
# Tokens (keys, values, positions)


@dataclass
class Tokens:
    """n tokens for every layer: a prompt, a chunk or one decode token.

    keys, values: [num_layers][n][kv_heads][head_dim] of the layout's dtype
      (one array, or a sequence of num_layers arrays [n][kv_heads][head_dim]).
      With a scalar `positions` (one token), [num_layers][kv_heads][head_dim].
    positions: the tokens' original positions, strictly increasing and
      greater than any appended to the session before.
    """

    keys: Any
    values: Any
    positions: Any


TokensArg = Union[Tokens, Tuple[Any, Any, Any]]


def _as_tokens(t: TokensArg) -> Tokens:
    if isinstance(t, Tokens):
        return t
    try:
        k, v, p = t
    except (TypeError, ValueError):
        raise InvalidArgument("a token argument is Tokens or (keys, values, "
                              "positions)", client_side=True) from None
    return Tokens(k, v, p)


@dataclass
class PackedTokens:
    """Checked tokens: positions and per layer the key and value bytes."""

    positions: List[int]
    keys: List[bytes]  # per layer
    values: List[bytes]

    @property
    def n(self) -> int:
        return len(self.positions)

    def token_bytes(self) -> int:
        return (len(self.keys[0]) + len(self.values[0])) // max(1, self.n) * len(self.keys)

    def to_proto(self, out: pb.AppendRequest, start: int = 0,
                 stop: Optional[int] = None) -> pb.AppendRequest:
        stop = self.n if stop is None else stop
        per = len(self.keys[0]) // max(1, self.n)
        out.positions.extend(self.positions[start:stop])
        for k, v in zip(self.keys, self.values):
            out.layers.add(keys=k[start * per:stop * per], values=v[start * per:stop * per])
        return out


def pack_tokens(layout: pb.Layout, tokens: TokensArg) -> PackedTokens:
    """Checks tokens against `layout` and takes their bytes (one copy)."""
    t = _as_tokens(tokens)
    scalar = np.ndim(t.positions) == 0
    positions = np.atleast_1d(np.asarray(t.positions))
    if positions.ndim != 1 or not (positions.dtype.kind in "iu" or positions.size == 0):
        raise InvalidArgument(
            f"positions: a 1-D integer array, got dtype {positions.dtype} shape "
            f"{positions.shape}", client_side=True)
    n = positions.size
    if n == 0:
        raise InvalidArgument("positions: no tokens", client_side=True)
    if positions[0] < 0 or (n > 1 and np.any(np.diff(positions) <= 0)):
        raise InvalidArgument("positions: must be >= 0 and strictly increasing",
                              client_side=True)
    shape = (layout.num_layers, n, layout.kv_heads, layout.head_dim)
    out: Dict[str, List[bytes]] = {}
    for what, a in (("keys", t.keys), ("values", t.values)):
        if isinstance(a, (list, tuple)):
            layers = [kv_array(x, layout, f"{what}[{i}]") for i, x in enumerate(a)]
            if len(layers) != layout.num_layers:
                raise InvalidArgument(
                    f"{what}: {len(layers)} layers for layout '{layout.name}' of "
                    f"{layout.num_layers}", client_side=True)
            arrs = layers
        else:
            arr = kv_array(a, layout, what)
            if arr.ndim < 1 or arr.shape[0] != layout.num_layers:
                raise InvalidArgument(
                    f"{what}: shape {arr.shape}; layout '{layout.name}' wants "
                    f"[num_layers][n][kv_heads][head_dim] = {list(shape)}",
                    client_side=True)
            arrs = [arr[i] for i in range(arr.shape[0])]
        blobs = []
        for i, x in enumerate(arrs):
            if scalar and x.shape == shape[2:]:
                x = x[None]
            if x.shape != shape[1:]:
                raise InvalidArgument(
                    f"{what}: layer {i} has shape {x.shape}; layout '{layout.name}' "
                    f"wants [num_layers][n][kv_heads][head_dim] = {list(shape)}",
                    client_side=True)
            blobs.append(np.ascontiguousarray(x).tobytes())
        out[what] = blobs
    return PackedTokens([int(p) for p in positions], out["keys"], out["values"])


def chunk_tokens(layout: pb.Layout, packed: PackedTokens, max_message_bytes: int,
                 max_chunk_tokens: int = 0) -> List[Tuple[int, int]]:
    """[start, stop) ranges of tokens whose AppendRequests fit the limit."""
    per_token = packed.token_bytes() + 10  # + the position's varint
    room = max_message_bytes - 1024 - 32 * layout.num_layers if max_message_bytes > 0 \
        else 1 << 62
    if per_token > room:
        raise ResourceExhausted(
            f"one token ({per_token} bytes) does not fit the server's message "
            f"limit of {max_message_bytes} bytes", client_side=True)
    step = max(1, room // per_token)
    if max_chunk_tokens > 0:
        step = min(step, max_chunk_tokens)
    return [(s, min(s + step, packed.n)) for s in range(0, packed.n, step)]


# ---------------------------------------------------------------------------
# Scores


class Scores:
    """One step's attention for some layers, in one of the three forms.

    Build it with :func:`reduced`, :func:`per_head` or :func:`queries`. The
    layers are a sequence (index = layer; every layer), a mapping {layer:
    array} (any subset), or one array whose first axis is the layer.
    """

    KINDS = ("per_head", "reduced", "queries")

    def __init__(self, kind: str, layers: Any):
        if kind not in self.KINDS:
            raise InvalidArgument(f"scores kind '{kind}': one of {self.KINDS}",
                                  client_side=True)
        self.kind = kind
        if isinstance(layers, Mapping):
            items = {int(k): v for k, v in layers.items()}
        elif isinstance(layers, np.ndarray):
            items = {i: layers[i] for i in range(layers.shape[0])}
        else:
            items = {i: v for i, v in enumerate(layers)}
        self.layers: Dict[int, np.ndarray] = {
            k: np.asarray(v) for k, v in sorted(items.items())}

    def __repr__(self) -> str:
        return f"Scores({self.kind}, layers {list(self.layers)})"


def reduced(layers: Any) -> Scores:
    """Probabilities summed over query heads: per layer [rows][resident] (or
    [resident] for one row), over the layer's slots in slot order."""
    return Scores("reduced", layers)


def per_head(layers: Any) -> Scores:
    """Per-head probabilities: per layer [query_heads][rows][resident] (or
    [query_heads][resident] for one row), slots in slot order."""
    return Scores("per_head", layers)


def queries(layers: Any) -> Scores:
    """Query vectors: per layer [rows][query_heads][head_dim] (or
    [query_heads][head_dim]); row r is the query of the token that arrived
    rows - 1 - r tokens before the newest. The store computes the softmax."""
    return Scores("queries", layers)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _packed_source(rows: int, values: np.ndarray) -> bytes:
    # PerHeadProbabilities / ReducedProbabilities / Queries all are
    # {int32 rows = 1; repeated float values = 2;}: their wire form is built
    # here from the float32 bytes at once, instead of a Python loop over
    # `values.extend`.
    raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return b"\x08" + _varint(rows) + b"\x12" + _varint(len(raw)) + raw


def scores_to_proto(scores: Scores, layout: pb.Layout, policy: Optional[pb.PolicyInfo],
                    mirror: BlockTableMirror, appended: int = 0,
                    compress: bool = False) -> List[pb.LayerScores]:
    """LayerScores for `scores`, versions from `mirror`, shapes checked.

    `appended`: tokens the same decode step appends first (their attention is
    over the slots after the append)."""
    if policy is not None:
        if policy.input == pb.PolicyInfo.INPUT_NONE:
            raise FailedPrecondition(
                f"policy '{policy.name}' takes no scores (it evicts on append or "
                "never)", client_side=True)
        if policy.input == pb.PolicyInfo.INPUT_COMPRESS and not compress:
            raise FailedPrecondition(
                f"policy '{policy.name}' takes scores only once, in "
                "compress(); decode sends none", client_side=True)
        if policy.input == pb.PolicyInfo.INPUT_PER_STEP and compress:
            raise FailedPrecondition(
                f"policy '{policy.name}' takes no compress(): send its "
                "scores with each step", client_side=True)
        if scores.kind == "queries" and not policy.accepts_queries:
            raise FailedPrecondition(
                f"policy '{policy.name}' does not take query vectors",
                client_side=True)
        if scores.kind != "queries" and not policy.accepts_probabilities:
            raise FailedPrecondition(
                f"policy '{policy.name}' does not take probabilities",
                client_side=True)
    if scores.kind == "queries" and layout.keys_pre_rope:
        raise FailedPrecondition(
            f"layout '{layout.name}' stores keys before RoPE: query scoring needs "
            "them after; send probabilities", client_side=True)
    out = []
    qh, hd = layout.query_heads, layout.head_dim
    for layer, a in scores.layers.items():
        if not 0 <= layer < layout.num_layers:
            raise InvalidArgument(f"scores for layer {layer} of a {layout.num_layers}"
                                  "-layer layout", client_side=True)
        resident = mirror.resident(layer) + appended
        where = f"scores of layer {layer} ({scores.kind})"
        if scores.kind == "reduced":
            if a.ndim == 1:
                a = a[None]
            ok = a.ndim == 2 and a.shape[1] == resident
            want = f"[rows][{resident}]"
            rows = a.shape[0] if a.ndim == 2 else 0
        elif scores.kind == "per_head":
            if a.ndim == 2:
                a = a[:, None]
            ok = a.ndim == 3 and a.shape[0] == qh and a.shape[2] == resident
            want = f"[{qh}][rows][{resident}]"
            rows = a.shape[1] if a.ndim == 3 else 0
        else:
            if a.ndim == 2:
                a = a[None]
            ok = a.ndim == 3 and a.shape[1:] == (qh, hd)
            want = f"[rows][{qh}][{hd}]"
            rows = a.shape[0] if a.ndim == 3 else 0
        if not ok or rows < 1:
            raise InvalidArgument(
                f"{where}: shape {a.shape}, want {want} (resident slots at version "
                f"{mirror.version(layer)}{' plus the appended tokens' if appended else ''})",
                client_side=True)
        if a.dtype.kind not in "fiu":
            raise InvalidArgument(f"{where}: dtype {a.dtype} is not numeric",
                                  client_side=True)
        f = a.astype(np.float32, copy=False)
        if not np.all(np.isfinite(f)):
            raise InvalidArgument(f"{where}: not finite", client_side=True)
        if scores.kind != "queries" and np.any(f < 0):
            raise InvalidArgument(f"{where}: negative probabilities",
                                  client_side=True)
        ls = pb.LayerScores(layer=layer, version=mirror.version(layer))
        getattr(ls, scores.kind).MergeFromString(_packed_source(rows, f))
        out.append(ls)
    return out


def causal_window(scores: Scores, mirror: BlockTableMirror) -> Scores:
    """Zeroes what each observation-window row cannot see (causal mask).

    For compress(): row r of `rows` belongs to the token in slot
    resident - rows + r (no eviction before compression, so slots are in
    position order) and attends only to slots <= that one."""
    if scores.kind == "queries":
        return scores  # the store applies the mask to queries itself
    out = {}
    for layer, a in scores.layers.items():
        a = np.array(a, dtype=np.float32, copy=True)
        resident = mirror.resident(layer)
        rows_axis = 0 if scores.kind == "reduced" else 1
        if a.ndim == (1 if scores.kind == "reduced" else 2):
            a = np.expand_dims(a, rows_axis)
        rows = a.shape[rows_axis]
        if a.shape[-1] == resident:
            own = resident - rows + np.arange(rows)
            future = np.arange(resident)[None, :] > own[:, None]  # [rows][resident]
            if scores.kind == "reduced":
                a[future] = 0
            else:
                a[:, future] = 0
        out[layer] = a
    return Scores(scores.kind, out)


# ---------------------------------------------------------------------------
# Policies, budgets


@dataclass(frozen=True)
class Budget:
    """Tokens per layer: `tokens` for every layer, or one entry per layer in
    `per_layer`, or the PyramidKV schedule (`schedule="pyramid"`: `tokens` is
    the mean; `pyramid_beta` defaults to 20)."""

    tokens: int = 0
    per_layer: Tuple[int, ...] = ()
    schedule: str = ""
    pyramid_beta: float = 0.0

    def to_proto(self) -> pb.Budget:
        return pb.Budget(tokens=self.tokens, per_layer=list(self.per_layer),
                         schedule=self.schedule, pyramid_beta=self.pyramid_beta)


BudgetArg = Union[int, Sequence[int], Budget, pb.Budget, None]


def budget_proto(b: BudgetArg) -> pb.Budget:
    if b is None:
        return pb.Budget()
    if isinstance(b, pb.Budget):
        return b
    if isinstance(b, Budget):
        return b.to_proto()
    if isinstance(b, (int, np.integer)):
        return pb.Budget(tokens=int(b))
    return pb.Budget(per_layer=[int(x) for x in b])


def find_policy(info: pb.ServerInfo, name: str) -> pb.PolicyInfo:
    for p in info.policy_info:
        if p.name == name:
            return p
    raise InvalidArgument(
        f"unknown policy '{name}'; the server takes {', '.join(info.policies)}",
        client_side=True)


def find_layout(info: pb.ServerInfo, name: str) -> Optional[pb.Layout]:
    for layout in info.layouts:
        if layout.name == name:
            return layout
    return None


def describe_param(p: pb.PolicyParam) -> str:
    if p.type == pb.PolicyParam.TYPE_CHOICE:
        what = "one of " + ", ".join(p.choices)
    else:
        kind = "int" if p.type == pb.PolicyParam.TYPE_INT else "number"
        what = f"{kind} in [{_num(p.min)}, {_num(p.max)}]"
    rule = f", {p.rule}" if p.rule else ""
    return f"{p.name} = {p.default_value}: {what}{rule}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def check_policy_params(policy: pb.PolicyInfo, params: Mapping[str, Any]) -> Dict[str, str]:
    """The params as the text the server takes, checked against `policy`.

    Names, types, ranges and choices come from ServerInfo.policy_info; a
    rule in words (e.g. "odd") and the budget rule are left to the server."""
    by_name = {p.name: p for p in policy.params}
    takes = "; ".join(describe_param(p) for p in policy.params) or "no parameters"
    out = {}
    for name, value in params.items():
        p = by_name.get(name)
        if p is None:
            raise InvalidArgument(
                f"policy '{policy.name}' has no parameter '{name}' (it takes {takes})",
                client_side=True)
        bad = InvalidArgument(
            f"policy '{policy.name}': {name}={value!r} is not {describe_param(p)}",
            client_side=True)
        if p.type == pb.PolicyParam.TYPE_CHOICE:
            text = str(value)
            if text not in p.choices:
                raise bad
        elif p.type == pb.PolicyParam.TYPE_INT:
            if isinstance(value, bool):
                raise bad
            if isinstance(value, (int, np.integer)):
                v = int(value)
            elif isinstance(value, float) and value.is_integer():
                v = int(value)
            elif isinstance(value, str):
                try:
                    v = int(value.strip(), 10)
                except ValueError:
                    raise bad from None
            else:
                raise bad
            if not p.min <= v <= p.max:
                raise bad
            text = str(v)
        elif p.type == pb.PolicyParam.TYPE_DOUBLE:
            if isinstance(value, bool):
                raise bad
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise bad from None
            if not math.isfinite(v) or not p.min <= v <= p.max:
                raise bad
            text = repr(v) if not isinstance(value, str) else value.strip()
        else:
            text = str(value)
        out[name] = text
    return out


# ---------------------------------------------------------------------------
# Replies


@dataclass
class LayerKv:
    """A layer's resident keys and values (ReadKv), in slot order.

    keys, values: [resident][kv_heads][head_dim] of the layout's dtype (bf16
    as uint16 bits; `.view(ml_dtypes.bfloat16)` if you use ml_dtypes)."""

    layer: int
    version: int
    positions: np.ndarray  # int64, per slot
    keys: np.ndarray
    values: np.ndarray


def assemble_kv(layout: pb.Layout, chunks: Sequence[pb.KvChunk],
                layers: Sequence[int]) -> List[LayerKv]:
    dt = numpy_dtype(layout)
    per = (layout.kv_heads, layout.head_dim)
    acc: Dict[int, Dict[str, Any]] = {}
    for c in chunks:
        a = acc.setdefault(c.layer, {"version": c.version, "pos": [], "k": [], "v": [],
                                     "next": 0})
        if c.first_slot != a["next"]:
            raise InvalidArgument(
                f"ReadKv: layer {c.layer} chunk at slot {c.first_slot}, expected "
                f"{a['next']}", client_side=True)
        a["next"] += len(c.positions)
        a["pos"].extend(c.positions)
        a["k"].append(c.keys)
        a["v"].append(c.values)
    if not layers:
        layers = sorted(acc) if acc else list(range(layout.num_layers))
    out = []
    for layer in layers:
        a = acc.get(layer, {"version": 0, "pos": [], "k": [], "v": []})
        n = len(a["pos"])
        keys = np.frombuffer(b"".join(a["k"]), dtype=dt).reshape((n,) + per)
        values = np.frombuffer(b"".join(a["v"]), dtype=dt).reshape((n,) + per)
        out.append(LayerKv(layer, a["version"], np.asarray(a["pos"], dtype=np.int64),
                           keys, values))
    return out


def shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


@dataclass
class SessionHandle:
    """What a Session knows about itself; shared by the sync and aio classes."""

    id: str
    layout: pb.Layout
    policy: Optional[pb.PolicyInfo]
    layer_budgets: List[int]
    max_message_bytes: int
    tables: BlockTableMirror
    in_sync: bool = True
    closed: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)


def create_request(info: pb.ServerInfo, layout: str, policy: str, budget: "BudgetArg",
                   params: Mapping[str, Any], *, idempotency_key: Optional[str],
                   idle_timeout_seconds: float, prefix: str, prefix_evictable: bool
                   ) -> Tuple[pb.CreateSessionRequest, Optional[pb.PolicyInfo]]:
    """CreateSession's request, its policy parameters checked, and the
    policy (None: the server's default, learnt after the create)."""
    pinfo = find_policy(info, policy) if policy else None
    checked = check_policy_params(pinfo, params) if pinfo else \
        {k: str(v) for k, v in params.items()}
    req = pb.CreateSessionRequest(
        layout=layout, policy=policy, policy_params=checked,
        budget=budget_proto(budget), idempotency_key=idempotency_key or new_id(),
        idle_timeout_seconds=idle_timeout_seconds, prefix=prefix,
        prefix_evictable=prefix_evictable)
    return req, pinfo


def fork_request(info: pb.ServerInfo, parent: SessionHandle, policy: str,
                 budget: "BudgetArg", params: Mapping[str, Any],
                 idempotency_key: Optional[str]
                 ) -> Tuple[pb.ForkSessionRequest, Optional[pb.PolicyInfo]]:
    """ForkSession's request for a child of `parent`, and the child's policy."""
    pinfo = find_policy(info, policy) if policy else parent.policy
    checked = check_policy_params(pinfo, params) if policy and pinfo \
        else {k: str(v) for k, v in params.items()}
    req = pb.ForkSessionRequest(
        session_id=parent.id, policy=policy, policy_params=checked,
        idempotency_key=idempotency_key or new_id())
    if budget is not None:  # set even when all zero: "this budget"
        req.budget.SetInParent()
        req.budget.CopyFrom(budget_proto(budget))
    return req, pinfo


def over_budget_layers(h: SessionHandle, layers: Sequence[int]) -> List[int]:
    return [l for l in layers
            if l < len(h.layer_budgets) and h.layer_budgets[l] > 0
            and h.tables.resident(l) > h.layer_budgets[l]]


def check_step(h: SessionHandle, packed: Optional[PackedTokens],
               scores: Optional[Scores]) -> None:
    """Client-side refusals of a decode step, before anything is sent."""
    if h.closed:
        raise FailedPrecondition(f"session {h.id} is closed", client_side=True)
    if not h.in_sync:
        from kvkeep.errors import OutOfSync
        raise OutOfSync(
            f"session {h.id}: a call's outcome is unknown (its reply was lost); "
            "call resync() and recompute attention over the slots it shows",
            client_side=True)
    if packed is not None and scores is not None and h.policy is not None and \
            h.policy.input == pb.PolicyInfo.INPUT_PER_STEP:
        over = over_budget_layers(h, list(scores.layers))
        if over:
            raise FailedPrecondition(
                f"session {h.id}: layers {over} are over budget (their last "
                "scores never came); a step with an append cannot score them, "
                "since the append's settle eviction would move slots under the "
                "attention. Send a score-only step first.", client_side=True)


def not_found_layout(name: str, info: pb.ServerInfo) -> NotFound:
    return NotFound(f"layout '{name}' is not served (layouts: "
                    f"{', '.join(l.name for l in info.layouts)})", client_side=True)


def decode_step_request(h: Any, token: Any, scores: Optional[Scores],
                        ended: Optional[Exception], finished: bool, reopen: bool
                        ) -> Tuple[pb.DecodeStep, Any]:
    """The DecodeStep for one step of session `h`'s decode stream, checked
    before anything is sent, and the packed token (None without one): the
    same for the sync and the asyncio stream."""
    if ended is not None and not reopen:
        raise FailedPrecondition(
            f"the decode stream of session {h.id} has ended ({ended}); "
            "open another (or decode(reopen=True))", client_side=True)
    if finished:
        raise FailedPrecondition(f"the decode stream of session {h.id} is closed",
                                 client_side=True)
    packed = pack_tokens(h.layout, token) if token is not None else None
    check_step(h, packed, scores)
    req = pb.DecodeStep()
    if packed is not None:
        packed.to_proto(req.append)
    if scores is not None:
        req.scores.extend(scores_to_proto(
            scores, h.layout, h.policy, h.tables,
            appended=packed.n if packed is not None else 0))
    return req, packed


def add_block_table_page(whole: pb.GetBlockTablesResponse,
                         page: pb.GetBlockTablesResponse) -> None:
    """Adds one page of a GetBlockTables answer to `whole`: a table part that
    does not start at slot 0 continues the last table (kvkeep.proto)."""
    for part in page.tables:
        if part.first_slot == 0:
            whole.tables.append(part)
            continue
        last = whole.tables[-1] if whole.tables else None
        if (last is None or last.layer != part.layer or last.version != part.version
                or len(last.positions) != part.first_slot):
            raise KvKeepError(
                f"GetBlockTables: a part of layer {part.layer} from slot "
                f"{part.first_slot} continues no table received")
        last.pages.extend(part.pages)
        last.positions.extend(part.positions)
        last.cache_positions.extend(part.cache_positions)
