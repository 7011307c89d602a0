"""kvkeep: the Python client of kvkeepd, the KV-cache store for LLM inference.

    import kvkeep
    client = kvkeep.Client("127.0.0.1:50051")
    with client.create_session("demo", "h2o", budget=512, recent=64) as s:
        s.append_prefill(keys, values, positions)
        s.step((k, v, pos), scores=kvkeep.reduced(attention))

``kvkeep.Fleet`` routes sessions over a fleet of replicas (docs/fleet.md).
``kvkeep.aio`` is the same API on asyncio. The proto messages the calls
return are ``kvkeep.pb`` (kvkeep.v1 of proto/kvkeep/v1/kvkeep.proto).
"""

from kvkeep._core import (Budget, LayerKv, Options, Scores, Tokens, bf16_to_f32,
                          f32_to_bf16, numpy_dtype, per_head, queries, reduced)
from kvkeep.client import Client, DecodeStream, EventWatch, Session
from kvkeep.fleet import Fleet
from kvkeep.errors import *  # noqa: F401,F403  (one class per gRPC code)
from kvkeep.errors import __all__ as _errors_all
from kvkeep.mirror import BlockTableMirror, LayerTable
from kvkeep.pool import MappedPool
from kvkeep.v1 import kvkeep_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "Client", "Fleet", "Session", "DecodeStream", "EventWatch", "Options", "Budget", "Tokens", "Scores",
    "reduced", "per_head", "queries", "LayerKv", "BlockTableMirror", "LayerTable",
    "MappedPool", "pb", "f32_to_bf16", "bf16_to_f32", "numpy_dtype",
] + list(_errors_all)
