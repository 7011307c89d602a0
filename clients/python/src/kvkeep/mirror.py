"""BlockTableMirror: a worker's copy of a session's block tables.

The store reports, for every call that changes slots, one ``LayerChange`` per
layer. Applying them in the documented order (proto ``LayerChange``;
docs/policies.md) keeps this copy equal to ``GetBlockTables`` after every
call, so a worker always knows which original position sits in which slot,
which pages hold them and at which version to compute attention:

0. replace ``pages[index]`` by ``to_page`` for each of ``pages_copied``
   (copy-on-write in a session that shares pages with a fork);
1. apply ``moves`` in order;
2. keep slots ``[0, resident - k)`` (k: the call's new tokens not in
   ``evicted_positions``) and drop ``pages_freed`` from the end of the page
   list;
3. append ``pages_added``; the k kept new tokens take the last slots, in
   position order.

Every result is checked against the mirror before anything changes (layer
count, slots and pages in range, freed pages being the tail), so a result of
another session or a skipped call raises ``InvalidArgument`` and leaves the
mirror as it was. Not thread-safe: one thread (or task) drives a session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence

import numpy as np

from kvkeep.errors import InvalidArgument
from kvkeep.v1 import kvkeep_pb2 as pb

__all__ = ["BlockTableMirror", "LayerTable"]


@dataclass
class LayerTable:
    """One layer's table: its version, page list and per-slot positions."""

    version: int
    pages: List[int] = field(default_factory=list)
    positions: List[int] = field(default_factory=list)  # per slot

    @property
    def resident(self) -> int:
        return len(self.positions)


def _kept_new(new_positions: Sequence[int], evicted: Sequence[int]) -> List[int]:
    if not evicted:
        return list(new_positions)
    ev = set(evicted)
    return [p for p in new_positions if p not in ev]


class BlockTableMirror:
    """Per layer: version, pages and the original position in each slot."""

    def __init__(self, page_tokens: int, versions: Iterable[int]):
        """An empty session: every layer empty at its starting version."""
        self.page_tokens = int(page_tokens)
        self.layers: List[LayerTable] = [LayerTable(int(v)) for v in versions]

    @classmethod
    def from_tables(cls, response: pb.GetBlockTablesResponse) -> "BlockTableMirror":
        """The store's tables (every layer, in layer order)."""
        tables = list(response.tables)
        if not tables:
            raise InvalidArgument("no block tables to mirror", client_side=True)
        m = cls(tables[0].page_tokens, [])
        for i, t in enumerate(tables):
            if t.layer != i:
                raise InvalidArgument(
                    f"block table {i} is of layer {t.layer}: a mirror needs every "
                    "layer, in layer order", client_side=True)
            m.layers.append(LayerTable(t.version, list(t.pages), list(t.positions)))
        return m

    # -- reading ---------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def version(self, layer: int) -> int:
        return self.layers[layer].version

    def versions(self) -> List[int]:
        return [t.version for t in self.layers]

    def resident(self, layer: int) -> int:
        return len(self.layers[layer].positions)

    def positions(self, layer: int) -> np.ndarray:
        """Per slot, the original position (int64 array, slot order)."""
        return np.asarray(self.layers[layer].positions, dtype=np.int64)

    def pages(self, layer: int) -> np.ndarray:
        return np.asarray(self.layers[layer].pages, dtype=np.int32)

    def cache_positions(self, layer: int) -> np.ndarray:
        """Per slot, the rank of its position among the resident tokens."""
        pos = self.positions(layer)
        rank = np.empty(len(pos), dtype=np.int64)
        rank[np.argsort(pos, kind="stable")] = np.arange(len(pos), dtype=np.int64)
        return rank

    def slot_of(self, layer: int, position: int) -> Optional[int]:
        """The slot holding `position` in `layer`, or None if not resident."""
        try:
            return self.layers[layer].positions.index(int(position))
        except ValueError:
            return None

    def table(self, layer: int) -> pb.BlockTable:
        """The layer's table in GetBlockTables' form (for comparison)."""
        t = self.layers[layer]
        return pb.BlockTable(layer=layer, version=t.version,
                             page_tokens=self.page_tokens, pages=t.pages,
                             positions=t.positions,
                             cache_positions=self.cache_positions(layer).tolist())

    def tables(self) -> pb.GetBlockTablesResponse:
        return pb.GetBlockTablesResponse(
            tables=[self.table(i) for i in range(self.num_layers)])

    # -- applying --------------------------------------------------------------

    def _check(self, result: pb.StepResult, new_positions: Sequence[int]) -> None:
        if len(result.layers) != self.num_layers:
            raise InvalidArgument(
                f"a result of {len(result.layers)} layers for a mirror of "
                f"{self.num_layers}", client_side=True)
        for i, c in enumerate(result.layers):
            layer = self.layers[i]
            size = len(layer.positions)
            where = f"layer {i}: "
            if c.layer != i:
                raise InvalidArgument(where + f"the result names layer {c.layer}",
                                      client_side=True)
            for cp in c.pages_copied:
                if not (0 <= cp.index < len(layer.pages)
                        and layer.pages[cp.index] == cp.from_page):
                    raise InvalidArgument(
                        where + f"a copy of page {cp.from_page} at index "
                        f"{cp.index} that the table does not hold there",
                        client_side=True)
            for m in c.moves:
                if not (0 <= m.from_slot < size and 0 <= m.to_slot < size):
                    raise InvalidArgument(
                        where + f"move {m.from_slot} -> {m.to_slot} outside the "
                        f"{size} resident slots", client_side=True)
            kept_old = c.resident - len(_kept_new(new_positions, c.evicted_positions))
            if not 0 <= kept_old <= size:
                raise InvalidArgument(
                    where + f"resident {c.resident} with {len(new_positions)} new "
                    f"tokens from {size}", client_side=True)
            freed = len(c.pages_freed)
            pages = len(layer.pages)
            if freed > pages or sorted(c.pages_freed) != sorted(
                    layer.pages[pages - freed:]):
                raise InvalidArgument(
                    where + f"the {freed} freed pages are not the last of {pages}",
                    client_side=True)
            if (pages - freed + len(c.pages_added)) * self.page_tokens < c.resident:
                raise InvalidArgument(
                    where + f"{pages - freed + len(c.pages_added)} pages cannot "
                    f"hold {c.resident} tokens", client_side=True)

    def apply(self, result: pb.StepResult, new_positions: Sequence[int] = ()) -> None:
        """Applies one call's result; `new_positions`: what the call appended."""
        new_positions = [int(p) for p in new_positions]
        self._check(result, new_positions)
        for i, c in enumerate(result.layers):
            layer = self.layers[i]
            pos = layer.positions
            for cp in c.pages_copied:
                layer.pages[cp.index] = cp.to_page
            for m in c.moves:
                pos[m.to_slot] = pos[m.from_slot]
            kept = _kept_new(new_positions, c.evicted_positions)
            del pos[c.resident - len(kept):]
            if c.pages_freed:
                del layer.pages[len(layer.pages) - len(c.pages_freed):]
            layer.pages.extend(c.pages_added)
            pos.extend(kept)
            layer.version = c.version

    def apply_decode(self, result: pb.DecodeStepResult,
                     new_positions: Sequence[int] = ()) -> None:
        """A decode step: its append (with `new_positions`), then its scores."""
        if result.HasField("append") and result.append.layers:
            self.apply(result.append, new_positions)
        elif len(new_positions):
            raise InvalidArgument(
                "new positions given for a decode step that appended nothing",
                client_side=True)
        if result.HasField("scores") and result.scores.layers:
            self.apply(result.scores)

    def equals(self, response: pb.GetBlockTablesResponse) -> bool:
        """Whether this mirror equals the store's tables exactly."""
        return self.diff(response) is None

    def diff(self, response: pb.GetBlockTablesResponse) -> Optional[str]:
        """None when equal to `response`, else where the first difference is."""
        tables = list(response.tables)
        if len(tables) != self.num_layers:
            return f"{len(tables)} tables for {self.num_layers} layers"
        for i, t in enumerate(tables):
            mine = self.table(i)
            if mine != t:
                return (f"layer {i}: mirror version {mine.version} pages "
                        f"{list(mine.pages)} positions {list(mine.positions)}; "
                        f"store version {t.version} pages {list(t.pages)} "
                        f"positions {list(t.positions)}")
        return None

