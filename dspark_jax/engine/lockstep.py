"""Serving on several processes: process 0 leads, the others replay its core, turn by turn.

Every process of a multi-host mesh must dispatch the same device programs in the same
order (each runs its own devices' share of every round). Offline jobs get that for free:
every process runs the same loop over the same requests. A server cannot: requests
arrive over HTTP at process 0 alone, at times no other process knows. So the engine core
(``engine.core.EngineCore``) is made a function of its operations: the leader's core
(:class:`LeaderCore`) logs each operation that changes it (``add`` a request, ``end`` one)
and, at each ``step``, publishes the turn's log; a follower (:func:`follow`) applies the
same operations to its own core in the same order. The round outputs every core reads
are gathered onto every device (``SpeculativeDecoder.spans_processes``), so both cores
make the same admissions, budgets and finishes from the same values, and their device
programs match. Only the leader detokenises and answers clients.

The channel is JAX's coordination service (its key-value store, hosted by process 0):
turn ``n`` is the key ``dspark/serve/turn/<n>``, a JSON list of operations. A turn with
no admission is a few bytes (``[["s"]]``); an admission carries its prompt ids and
sampling settings, so a turn is bounded by the slots times the longest prompt.

Liveness: every process sets its heartbeat key every ``interval`` seconds; a
:class:`Watchdog` on every process watches the others' and calls ``on_silent`` when one
has not beaten for ``timeout`` seconds (a process killed, a host gone, the coordinator
gone), so a failure ends every process within that bound instead of leaving them waiting
in a collective or for a turn that never comes.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from dspark_jax import distributed
from dspark_jax.decode.step import FINISH_NONE
from dspark_jax.engine.core import CoreRequest, Emitted, EngineCore

__all__ = ["Exchange", "LeaderCore", "Watchdog", "admission", "encode", "follow"]

log = logging.getLogger(__name__)
PREFIX = "dspark/serve"


class Exchange:
    """Turns and heartbeats through the coordination service's key-value store."""

    def __init__(self, client=None, keep: int = 64):
        self.client = client if client is not None else distributed.kv_client()
        if self.client is None:
            raise RuntimeError("serving on several processes needs jax.distributed started")
        # Turns kept before deletion: the followers replay a turn within the round it
        # starts (they wait in the same collectives), so a few suffice; more is cheap.
        self.keep = keep
        self.turns_sent = 0
        self.bytes_sent = 0
        self.largest_turn = 0
        self.send_seconds = 0.0

    def publish(self, turn: int, ops: list) -> None:
        t0 = time.perf_counter()
        payload = encode(ops)
        self.client.key_value_set_bytes(f"{PREFIX}/turn/{turn}", payload)
        if turn >= self.keep:
            self.client.key_value_delete(f"{PREFIX}/turn/{turn - self.keep}")
        self.turns_sent += 1
        self.bytes_sent += len(payload)
        self.largest_turn = max(self.largest_turn, len(payload))
        self.send_seconds += time.perf_counter() - t0

    def receive(self, turn: int, timeout_s: float) -> list | None:
        """Turn ``turn``'s operations, or None if it has not come within ``timeout_s``."""
        try:
            payload = self.client.blocking_key_value_get_bytes(
                f"{PREFIX}/turn/{turn}", max(1, int(timeout_s * 1000))
            )
        except Exception as e:  # the store answers a missing key with DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" in str(e) or "Deadline" in str(e):
                return None
            raise
        return json.loads(payload)

    def beat(self, process: int, value: int) -> None:
        self.client.key_value_set(f"{PREFIX}/alive/{process}", str(value), allow_overwrite=True)

    def last_beat(self, process: int) -> str | None:
        try:
            return self.client.key_value_try_get(f"{PREFIX}/alive/{process}")
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise


class Watchdog:
    """This process's heartbeat, and the others' watched (module docstring).
    ``on_silent(process, seconds, why)`` is called once, from the watchdog's thread."""

    def __init__(
        self,
        exchange: Exchange,
        timeout: float,
        on_silent: Callable[[int, float, str], None],
        interval: float = 0.5,
        processes: tuple[int, int] | None = None,
    ):
        """``processes``: (this process's index, their count); the runtime's by default."""
        self.exchange, self.timeout, self.on_silent = exchange, timeout, on_silent
        self.interval = min(interval, timeout / 4)
        if processes is None:
            processes = (distributed.process_index(), distributed.process_count())
        self.me, self.n = processes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching, and wait for a store call in flight to return:
        called before the processes leave the distributed runtime, where a call still in
        flight when process 0 shuts the coordination service down aborts process 0 (CI,
        jax 0.10.2: ``terminate called after throwing an instance of ''`` at exit)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)

    def _run(self) -> None:
        seen: dict[int, tuple[str | None, float]] = {}
        failing_since = None  # the first of an unbroken run of failed store calls
        for beat in itertools.count():
            if self._stop.is_set():
                return
            now = time.monotonic()
            try:
                self.exchange.beat(self.me, beat)
                for p in range(self.n):
                    if p == self.me:
                        continue
                    value = self.exchange.last_beat(p)
                    if p not in seen or seen[p][0] != value:
                        seen[p] = (value, now)
                    elif now - seen[p][1] > self.timeout:
                        self._silent(p, now - seen[p][1], "its heartbeat stopped")
                        return
                failing_since = None
            except Exception as e:  # the coordination service (process 0's) is gone
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > self.timeout:
                    self._silent(0, now - failing_since, f"the coordination service failed ({e})")
                    return
            self._stop.wait(self.interval)

    def _silent(self, process: int, seconds: float, why: str) -> None:
        if not self._stop.is_set():
            self.on_silent(process, seconds, why)


def admission(uid: int, request: CoreRequest) -> list:
    """The operation that admits ``request`` as number ``uid``: its prompt ids, sampling
    settings and random stream, all a follower needs to run it as the leader does."""
    keys = np.asarray(request.keys)
    return [
        "a", uid, [int(t) for t in request.prompt], int(request.max_new_tokens),
        float(request.temperature), int(request.top_k), float(request.top_p),
        keys.tolist(), str(keys.dtype), bool(request.coupled),
    ]  # fmt: skip


def encode(ops: list) -> bytes:
    """A turn as it travels (compact JSON)."""
    return json.dumps(ops, separators=(",", ":")).encode()


class LeaderCore(EngineCore):
    """The leader's engine core: the same core, with every operation that changes it
    logged and each turn published before it runs (module docstring)."""

    def __init__(self, *args, exchange: Exchange, **kwargs):
        super().__init__(*args, **kwargs)
        self.exchange = exchange
        self._ops: list = []
        self._turn = 0
        self._uid: dict[CoreRequest, int] = {}
        self._ids = itertools.count()

    def add(self, request: CoreRequest) -> None:
        super().add(request)  # checked first: a refused request is never sent
        uid = next(self._ids)
        self._uid[request] = uid
        self._ops.append(admission(uid, request))

    def end(self, request: CoreRequest) -> None:
        uid = self._uid.pop(request, None)
        if uid is not None:
            self._ops.append(["e", uid])
        super().end(request)

    def step(self):
        self._publish(["s"])
        events = super().step()
        for ev in events:
            if isinstance(ev, Emitted) and ev.finish != FINISH_NONE:
                self._uid.pop(ev.request, None)
        return events

    def close(self, exit_code: int = 0) -> None:
        """The last turn: the followers apply what is left and exit with ``exit_code``."""
        self._publish(["q", int(exit_code)])

    def _publish(self, last: list) -> None:
        ops, self._ops = self._ops + [last], []
        self.exchange.publish(self._turn, ops)
        self._turn += 1


def follow(core: EngineCore, exchange: Exchange, poll_s: float = 1.0) -> int:
    """Replay the leader's turns on ``core`` until its last; returns the exit code it
    sent. Waits for a turn as long as it takes (the watchdog bounds a dead leader)."""
    requests: dict[int, CoreRequest] = {}
    for turn in itertools.count():
        ops = None
        while ops is None:
            ops = exchange.receive(turn, poll_s)
        for op in ops:
            kind = op[0]
            if kind == "a":
                uid, prompt, max_new, temperature, top_k, top_p, keys, dtype, coupled = op[1:]
                r = CoreRequest(prompt, max_new, temperature, top_k, top_p,
                                np.asarray(keys, dtype), coupled, tag=uid)  # fmt: skip
                requests[uid] = r
                core.add(r)
            elif kind == "e":
                r = requests.pop(op[1], None)
                if r is not None:
                    core.end(r)
            elif kind == "s":
                for ev in core.step():
                    if isinstance(ev, Emitted) and ev.finish != FINISH_NONE:
                        requests.pop(ev.request.tag, None)
            elif kind == "q":
                return int(op[1])
            else:
                raise ValueError(f"unknown operation {kind!r} in turn {turn} from the leader")
    raise AssertionError("unreachable")
