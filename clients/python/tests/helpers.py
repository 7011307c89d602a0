"""Test data: random keys/values and attention for a layout."""

from __future__ import annotations

import numpy as np

import kvkeep
from kvkeep import pb


def random_kv(rng: np.random.Generator, layout: pb.Layout, n: int):
    """keys, values [num_layers][n][kv_heads][head_dim] in the layout's dtype,
    with every bit pattern a real model could send (bf16 as uint16 bits)."""
    shape = (layout.num_layers, n, layout.kv_heads, layout.head_dim)
    out = []
    for _ in range(2):
        f = rng.standard_normal(shape).astype(np.float32)
        if layout.dtype == pb.DTYPE_F32:
            out.append(f)
        elif layout.dtype == pb.DTYPE_F16:
            out.append(f.astype(np.float16))
        else:
            out.append(kvkeep.f32_to_bf16(f))
    return out[0], out[1]


def reduced_rows(rng: np.random.Generator, layout: pb.Layout, resident: int, rows: int = 1):
    """Head-summed probabilities [rows][resident]: each row sums to at most
    query_heads, as query_heads softmax rows would."""
    p = rng.random((rows, resident)).astype(np.float64) ** 4
    p /= p.sum(axis=1, keepdims=True)
    return (p * layout.query_heads * 0.98).astype(np.float32)


def per_head_rows(rng: np.random.Generator, layout: pb.Layout, resident: int, rows: int = 1):
    p = rng.random((layout.query_heads, rows, resident)).astype(np.float64) ** 4
    p /= p.sum(axis=2, keepdims=True)
    return (p * 0.98).astype(np.float32)


def query_rows(rng: np.random.Generator, layout: pb.Layout, rows: int = 1):
    return rng.standard_normal((rows, layout.query_heads, layout.head_dim)).astype(np.float32)


def assert_mirror_equals_store(session) -> None:
    for l in range(session.tables.num_layers):
        store = session.block_tables([l]).tables[0]
        assert session.tables.table(l) == store, f"session {session.id} layer {l}"
