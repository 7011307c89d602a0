"""MappedPool: a host page pool mapped read-only into numpy (MapPool).

kvkeepd started with ``--share_pools`` keeps each host pool in POSIX shared
memory; ``Client.map_pool`` / ``Session.map_pool`` map it here with no copy.
``pool.pages`` is the arena as ``[capacity_pages][2][page_tokens][kv_heads]
[head_dim]`` (index 0 keys, 1 values; kernels/page_layout.h), bf16 as uint16
bits. A mapping shows every session of the layout.

The contract (docs/gpu.md): the store moves or frees a session's pages only
while it handles that session's own messages, so between its own calls a
worker reads exactly the slots its block tables (its mirror) name.

A GPU pool answers with a CUDA IPC handle instead: ``cuda_ipc_handle`` is
exposed, but mapping it needs CUDA (not done here). Not thread-safe to
close while another thread reads.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Optional, Tuple

import numpy as np

from kvkeep import _core
from kvkeep.errors import FailedPrecondition, InvalidArgument
from kvkeep.v1 import kvkeep_pb2 as pb

__all__ = ["MappedPool"]


class MappedPool:
    """A layout's pool, mapped read-only. A context manager (unmaps on exit)."""

    def __init__(self, response: pb.MapPoolResponse):
        self.response = response
        self.layout: pb.Layout = response.layout
        self.device: str = response.device
        self.capacity_pages: int = response.capacity_pages
        self.tables = list(response.tables)
        self.cuda_ipc_handle: Optional[bytes] = (
            response.cuda_ipc_handle if response.WhichOneof("handle") == "cuda_ipc_handle"
            else None)
        self._mmap: Optional[mmap.mmap] = None
        self.pages: Optional[np.ndarray] = None
        if response.WhichOneof("handle") != "shm_name":
            return
        path = _core.shm_path(response.shm_name)
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(fd, response.arena_bytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ)
        finally:
            os.close(fd)
        lay = self.layout
        dt = _core.numpy_dtype(lay)
        shape = (response.capacity_pages, 2, lay.page_tokens, lay.kv_heads, lay.head_dim)
        if int(np.prod(shape)) * dt.itemsize != response.arena_bytes:
            raise InvalidArgument(
                f"MapPool: arena of {response.arena_bytes} bytes is not "
                f"{shape} of {dt}", client_side=True)
        self.pages = np.frombuffer(self._mmap, dtype=dt).reshape(shape)

    def __enter__(self) -> "MappedPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Unmaps the pool. Arrays taken from it must be dropped first."""
        self.pages = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still alive: the mapping goes with it
            self._mmap = None

    def _need(self) -> np.ndarray:
        if self.pages is None:
            raise FailedPrecondition(
                f"pool of layout '{self.layout.name}' on {self.device} is not mapped "
                "here (a GPU pool, or closed)", client_side=True)
        return self.pages

    def slot(self, table: pb.BlockTable, slot: int) -> Tuple[np.ndarray, np.ndarray]:
        """Views of the keys and values [kv_heads][head_dim] of `slot` in the
        layer `table` describes (no copy)."""
        pages = self._need()
        pt = self.layout.page_tokens
        page = table.pages[slot // pt]
        return pages[page, 0, slot % pt], pages[page, 1, slot % pt]

    def gather(self, table: Any, resident: Optional[int] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """Copies of a layer's resident keys and values [resident][kv_heads]
        [head_dim], slot order. `table`: a BlockTable, or (pages, resident)
        from a mirror: ``pool.gather((s.tables.pages(l), s.tables.resident(l)))``."""
        pages = self._need()
        if isinstance(table, pb.BlockTable):
            page_list, n = list(table.pages), len(table.positions)
        else:
            page_list, n = list(table[0]), int(table[1])
        if resident is not None:
            n = resident
        lay = self.layout
        if not page_list:
            empty = np.empty((0, lay.kv_heads, lay.head_dim), dtype=pages.dtype)
            return empty, empty.copy()
        sel = pages[np.asarray(page_list, dtype=np.int64)]  # [p][2][pt][kvh][hd]
        keys = sel[:, 0].reshape(-1, lay.kv_heads, lay.head_dim)[:n]
        values = sel[:, 1].reshape(-1, lay.kv_heads, lay.head_dim)[:n]
        return keys, values
