"""Exceptions: one class per gRPC status code, each carrying the server's message.

Every call of the client raises a subclass of :class:`KvKeepError` on failure;
none lets a bare ``grpc.RpcError`` through. The class says what happened
(``NotFound``: unknown session or layout; ``ResourceExhausted``: pool full or a
limit; ``FailedPrecondition``: a stale version or a call the policy does not
take; ...), ``message`` is the server's text, which names the session and the
field. Checks the client makes before sending anything raise the same classes
with ``client_side`` set, so ``except kvkeep.InvalidArgument`` catches a bad
shape whether the client or the server saw it first.
"""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = [
    "KvKeepError",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "StaleVersion",
    "OutOfSync",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "error_for",
    "from_rpc_error",
]


class KvKeepError(Exception):
    """A failed kvkeep call.

    Attributes:
      code: the gRPC status code (``grpc.StatusCode``).
      message: the server's message (or the client's, when ``client_side``).
      method: the RPC that failed (``"CreateSession"``), or ``""``.
      client_side: True when the client refused the call before sending it.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, method: str = "", client_side: bool = False,
                 code: Optional[grpc.StatusCode] = None):
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
        self.client_side = client_side
        where = f"{method}: " if method else ""
        origin = " (checked by the client; nothing was sent)" if client_side else ""
        super().__init__(f"{where}{self.code.name}: {message}{origin}")


class Cancelled(KvKeepError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KvKeepError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvKeepError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvKeepError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvKeepError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvKeepError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvKeepError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvKeepError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KvKeepError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleVersion(FailedPrecondition):
    """Attention named a layer version the store no longer holds."""


class OutOfSync(FailedPrecondition):
    """The session's block-table mirror may differ from the store's.

    Raised client-side after a call whose outcome is unknown (the connection
    broke before its reply): call ``Session.resync()`` and recompute attention
    over the slots it then shows.
    """


class Aborted(KvKeepError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvKeepError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvKeepError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvKeepError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvKeepError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvKeepError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvKeepError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound,
                AlreadyExists, PermissionDenied, ResourceExhausted,
                FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal,
                Unavailable, DataLoss, Unauthenticated)
}


def error_for(code: grpc.StatusCode, message: str, *, method: str = "",
              client_side: bool = False) -> KvKeepError:
    """The exception for `code` (``StaleVersion`` for a stale-version refusal)."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and "stale version" in message:
        cls = StaleVersion
    else:
        cls = _BY_CODE.get(code, Unknown)
    err = cls(message, method=method, client_side=client_side)
    if cls is Unknown and code != grpc.StatusCode.UNKNOWN:
        err.code = code  # OK or an unexpected code: keep what came
    return err


def from_rpc_error(e: grpc.RpcError, method: str = "") -> KvKeepError:
    """Converts a grpc.RpcError (sync or aio) into its KvKeepError."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", method=method)


# Codes after which a call that changes a session may or may not have been
# applied (the reply was lost): the caller must resync before relying on its
# mirror. Every other code is a refusal, and a refused call changed nothing.
AMBIGUOUS_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
})
