"""A submitted request as its consumer sees it: the engine thread delivers events to it,
a synchronous or an asyncio consumer reads them."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator

from dspark_jax.serve.requests import Delta, Result


class RequestHandle:
    """A submitted request: iterate its events (``Delta``…, then one ``Result``).

    Sync consumers use ``events()`` / ``result()``; asyncio consumers pass ``loop`` to
    ``Engine.submit`` and use ``aevents()`` / ``aresult()``. The engine thread delivers
    events through ``loop.call_soon_threadsafe`` (asyncio) or a ``queue.Queue`` (sync).
    """

    def __init__(self, request_id, prompt_ids, params, loop=None):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self._loop = loop
        self._q: queue.Queue | None = None if loop else queue.Queue()
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._cancelled = threading.Event()
        self.done = threading.Event()
        self.submitted_at = time.perf_counter()
        self.keys = None  # the request's random stream (key data), set by the engine
        self.coupled = False  # position-keyed verification (seeded requests, by default)

    # -- engine side ---------------------------------------------------------------------
    def _deliver(self, item) -> None:
        if self._loop is None:
            self._q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    # -- consumer side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next round."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Delta | Result]:
        if self._q is None:
            raise RuntimeError("this handle was submitted with an event loop; use aevents()")
        while True:
            item = self._q.get(timeout=timeout)
            yield item
            if isinstance(item, Result):
                return

    def result(self, timeout: float | None = None) -> Result:
        for item in self.events(timeout):
            if isinstance(item, Result):
                return item
        raise RuntimeError("event stream ended without a result")  # pragma: no cover

    async def aevents(self) -> AsyncIterator[Delta | Result]:
        if self._aq is None:
            raise RuntimeError("this handle was submitted without an event loop; use events()")
        while True:
            item = await self._aq.get()
            yield item
            if isinstance(item, Result):
                return

    async def aresult(self) -> Result:
        async for item in self.aevents():
            if isinstance(item, Result):
                return item
        raise RuntimeError("event stream ended without a result")  # pragma: no cover


__all__ = ["RequestHandle"]
