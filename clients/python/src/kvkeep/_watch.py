"""What kvkeep.EventWatch and kvkeep.aio.EventWatch share (no I/O): where
a WatchEvents stream is (docs/events.md) and the request that resumes it."""

from __future__ import annotations

from typing import Any, List

from kvkeep.v1 import kvkeep_pb2 as pb


class EventWatchBase:
    """The watch's position: the last event seen of which incarnation."""

    def __init__(self, conn: Any, kinds: List[int], after_sequence: int,
                 incarnation: int):
        self._c = conn
        self._kinds = kinds
        self.last_sequence = after_sequence
        self.incarnation = incarnation
        self._call: Any = None
        self._pending: List[pb.Event] = []

    def _open(self) -> Any:
        """Opens the stream after the last event seen (its call object)."""
        self.cancel()
        req = pb.WatchEventsRequest(after_sequence=self.last_sequence,
                                    incarnation=self.incarnation, kinds=self._kinds)
        self._call = self._c.stub.WatchEvents(req, metadata=self._c.metadata,
                                              timeout=self._c.options.stream_deadline)
        return self._call

    def _started(self, first: pb.WatchEventsResponse) -> None:
        """The stream's first answer: the incarnation, where it starts."""
        self.incarnation = first.incarnation
        if self.last_sequence == 0:
            self.last_sequence = first.latest_sequence
        self._pending = list(first.events)

    def _next_pending(self) -> pb.Event:
        event = self._pending.pop(0)
        self.last_sequence = event.sequence
        return event

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
