"""The one host core of decoding: slots, KV pages, admission, prefill, rounds, finishes.

Both drivers run this core: the offline one (``engine.offline.Runner``: evaluation with
its per-round records, ``generate``) and the serving engine (``serve.engine.Engine``,
which the HTTP server and ``LLM`` drive from its own thread). What each of them does with
the tokens (records, detokenising, stop strings, streaming) stays in the driver; which
request owns which slot and pages, what runs on the device and in which order, is here.

``step()`` does one turn of the loop:

1. **Admit** waiting requests, first come first served, into free slots once the KV page
   pool can hold each one's prompt + ``max_new_tokens`` (``decode.pages.PagePool``; a
   request that does not fit yet waits, never dropped), and **prefill** them in groups of
   compiled row counts, each prompt padded to its length bucket (``engine.prefill``).
   With data replicas (``decode.replicas``) each replica has its own slots and page pool,
   and a request goes to the least-loaded replica (fewest occupied slots, then most free
   pages) that can hold it; it waits only when none can.
2. **Dispatch** one decode round for every occupied slot at the budget the round policy
   gives (``decode.policy.RoundPolicy``: the smallest bucket holding γ per occupied slot,
   dynamic top-K from round n − 2's survivals, two-phase Algorithm 1), or a plain round
   (the target alone) when the policy finds drafting would not pay.
3. **Read** finished outputs and turn them into ``Emitted`` events (tokens, the device's
   finish code, logprobs and the round's record: accepted, verified, survival, drafts),
   then a ``RoundDone`` per round. A slot the device finished is freed with its pages
   before its event is returned.

Pipelining (``pipelined=True``, the server): round n+1 is dispatched before round n is
read, so the driver's host work on round n overlaps the device's work on n+1; only round
n's output is read (the one place the core waits on the device). Each dispatched round
remembers which request owned each slot, and output for a request that ended since (a
stop string found while the next round ran, a cancellation) is dropped, so a request
never receives tokens after its end and a reused slot never receives its predecessor's.
``pipelined=False`` (offline) reads every output before the next turn; prefill outputs are
read at admission, so a request that ends at its first token frees its slot for the next
one at once.

A driver that ends a request itself (stop string, cancellation) calls ``end(request)``:
its slot is released on the device (it stops drafting and verifying from the next round)
and its pages go back to the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dspark_jax.decode.pages import ReplicaPages
from dspark_jax.decode.policy import RoundPolicy
from dspark_jax.decode.step import FINISH_NONE, SpeculativeDecoder
from dspark_jax.engine.prefill import PrefillBatcher, PrefillRow

__all__ = ["CoreRequest", "CoreTimes", "Emitted", "EngineCore", "RoundDone"]


@dataclasses.dataclass(eq=False)
class CoreRequest:
    """A request as the core sees it (``tag``: the driver's own object for it)."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    keys: np.ndarray  # its random stream, key data (decode.step.request_key_data)
    coupled: bool = False  # position-keyed verification (decode.verify.verify_coupled)
    tag: Any = None
    done: bool = False  # ended (on the device or by the driver): no more events
    slot: int | None = None


@dataclasses.dataclass
class Emitted:
    """Tokens for one request from a prefill (``round_index`` None) or a round."""

    request: CoreRequest
    tokens: list[int]
    finish: int  # decode.step FINISH_* code (FINISH_NONE: still running)
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray]  # own, top ids, top logprobs
    round_index: int | None = None
    accepted: int = 0  # draft tokens accepted this round
    verified: int = 0  # draft tokens sent to the target this round
    survival: np.ndarray | None = None  # [γ] this slot's survival a = cumprod(c)
    draft_tokens: np.ndarray | None = None  # [γ]


@dataclasses.dataclass
class RoundDone:
    """A round whose outputs were just read: its wall time (from its dispatch, or from the
    previous round's end when it was queued behind it), verify budget, tokens emitted per
    slot that emitted, and draft tokens verified over all slots."""

    index: int
    seconds: float
    budget: int
    taus: list[int]
    verified: int
    padding: int = 0  # rows run beyond the data replicas' own buckets (decode.policy)
    kind: str = "draft"  # decode.policy.ROUND_KINDS: draft, plain (target alone) or probe


@dataclasses.dataclass
class CoreTimes:
    """The core's own time by kind: dispatching (prefill and rounds, choosing budgets),
    waiting on the device, and turning outputs into events; page waits counts admission
    turns in which the queue's head had a slot but not its pages."""

    dispatch_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    host_seconds: float = 0.0
    page_waits: int = 0

    @property
    def host_share(self) -> float:
        """Share of the busy time spent on the host (not waiting on the device)."""
        busy = self.dispatch_seconds + self.device_wait_seconds + self.host_seconds
        return (self.dispatch_seconds + self.host_seconds) / busy if busy else 0.0


class EngineCore:
    """Slots, pages, admission and rounds over ``decoder``'s state (see the module
    docstring). ``buckets``: verify budgets (None: the policy's defaults);
    ``prefill_batch``: most prompts per prefill call; ``seed``: the state's initial keys;
    ``times``: where to add up the core's time (default its own ``CoreTimes``);
    ``plain_rounds``: the policy's draft-aware rounds (``RoundPolicy``; None: its default)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        buckets: Sequence[int] | None = None,
        *,
        prefill_batch: int = 1,
        pipelined: bool = False,
        seed: int = 0,
        times=None,
        plain_rounds: bool | None = None,
    ):
        self.decoder = decoder
        cfg = decoder.config
        self.num_slots = cfg.num_slots
        self.policy = RoundPolicy(decoder, buckets, plain_rounds=plain_rounds)
        self.prefill = PrefillBatcher(decoder, prefill_batch)
        # One pool per data replica (one without replicas), page numbers local to it.
        self.replicas, self.replica_slots = decoder.replicas, decoder.replica_slots
        self.pages = ReplicaPages(
            decoder.replicas, decoder.replica_pages, cfg.page_size, cfg.max_len,
            decoder.draft_positions,
        )  # fmt: skip
        self.pipelined = pipelined
        self.seed = seed
        # Where the core adds up its time: ``times`` (any object with CoreTimes' fields,
        # e.g. the server's EngineStats), else its own CoreTimes.
        self.times = CoreTimes() if times is None else times
        self.waiting: collections.deque[CoreRequest] = collections.deque()
        self.slots: list[CoreRequest | None] = [None] * cfg.num_slots
        self._slot_pages: list[np.ndarray | None] = [None] * cfg.num_slots
        self.inflight: collections.deque = collections.deque()
        self.waiting_for_pages = False  # the queue's head waits for pages, not a slot
        self._last_ready = 0.0
        self.state = None

    # -- state --------------------------------------------------------------------------
    def reset(self, state=None) -> None:
        """A fresh decode state (every slot free), or ``state`` (warmed up by the caller);
        forgets the policy's observed rounds. Only between runs: nothing in flight."""
        if self.inflight or self.active_slots:
            raise RuntimeError("reset with requests still running")
        self.state = self.decoder.init_state(self.seed) if state is None else state
        self.policy.reset()

    @property
    def active_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.inflight or self.active_slots)

    # -- requests -----------------------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse (``ValueError``) a request the cache or the page pool could never hold."""
        max_len = self.decoder.config.max_len
        if prompt_len == 0:
            raise ValueError("empty prompt")
        if prompt_len + 1 >= max_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens but the cache holds {max_len} positions "
                "(prompt + 1 generated token must fit)"
            )
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        self.pages.check_fits(prompt_len, max_new_tokens)

    def add(self, request: CoreRequest) -> None:
        """Queue a request (checked with ``check``)."""
        self.check(len(request.prompt), request.max_new_tokens)
        self.waiting.append(request)

    def end(self, request: CoreRequest) -> None:
        """The driver ends ``request`` (stop string, cancellation): out of the queue, or
        its slot released on the device and its pages freed. No event follows."""
        request.done = True
        if request.slot is None:
            if request in self.waiting:
                self.waiting.remove(request)
            return
        self.state = self.decoder.release(self.state, request.slot)
        self._vacate(request.slot)

    def _vacate(self, slot: int) -> None:
        """The slot is free and its pages go back to the pool. Rounds still in flight run
        before any later prefill, and the slot is inactive on the device by now, so nothing
        writes those pages for their old owner again (decode/pages.py)."""
        request = self.slots[slot]
        if request is not None:
            request.slot = None
        self.slots[slot] = None
        self.pages[slot // self.replica_slots].release(self._slot_pages[slot])
        self._slot_pages[slot] = None

    # -- one turn -----------------------------------------------------------------------
    def step(self) -> list[Emitted | RoundDone]:
        """Admit, prefill, dispatch a round, read what is due (module docstring)."""
        events: list[Emitted | RoundDone] = []
        self._admit(events)
        if self.active_slots:
            t0 = time.perf_counter()
            owners = list(self.slots)
            occupied = np.asarray([r is not None for r in owners])
            self.state, out, budget, index = self.policy.dispatch(self.state, occupied)
            meta = (budget, self.policy.last_padding, self.policy.last_kind)
            self.inflight.append(("round", out, owners, meta, t0, index))
            # Two-phase Algorithm 1 waits for its plan inside dispatch: device time.
            waited = self.policy.last_wait_seconds
            self.times.device_wait_seconds += waited
            self.times.dispatch_seconds += time.perf_counter() - t0 - waited
            keep = 1 if self.pipelined else 0  # the round just dispatched runs on
            while len(self.inflight) > keep:
                self._read_oldest(events)
        else:
            while self.inflight:
                self._read_oldest(events)
        return events

    def _admit(self, events: list) -> None:
        """Fill free slots from the queue, first come first served, while pages allow."""
        while True:
            free = [s for s, r in enumerate(self.slots) if r is None]
            admitted = []
            self.waiting_for_pages = False
            while free and self.waiting:
                request = self.waiting[0]
                placed = self._place(request, free)
                if placed is None:  # wait until a finished request frees pages
                    self.waiting_for_pages = True
                    self.times.page_waits += 1
                    break
                self.waiting.popleft()
                slot, pages = placed
                free.remove(slot)
                self.slots[slot], self._slot_pages[slot], request.slot = request, pages, slot
                admitted.append(request)
            if not admitted:
                return
            t0 = time.perf_counter()
            group = self.prefill.max_rows
            for start in range(0, len(admitted), group):
                chunk = admitted[start : start + group]
                rows = [
                    PrefillRow(r.slot, r.prompt, r.max_new_tokens, r.temperature, r.top_k,
                               r.top_p, r.keys, r.coupled, self._slot_pages[r.slot])
                    for r in chunk
                ]  # fmt: skip
                self.state, pre = self.prefill.run(self.state, rows)
                owners: list = [None] * self.num_slots  # slot -> (request, batch row)
                for i, r in enumerate(chunk):
                    owners[r.slot] = (r, i)
                self.inflight.append(("prefill", pre, owners, 0, 0.0, -1))
            self.times.dispatch_seconds += time.perf_counter() - t0
            if self.pipelined:
                return
            # Offline: read the first tokens now, so a request that ends with its first
            # token frees its slot for the next one in this same turn.
            while self.inflight:
                self._read_oldest(events)

    def _place(self, request: CoreRequest, free: list[int]):
        """``(slot, page row)`` for ``request``: a free slot of the least-loaded replica
        (fewest occupied slots, then most free pages, then the lowest index) whose pool
        holds it now; None when no replica with a free slot can."""
        rl = self.replica_slots
        candidates = sorted(
            {s // rl for s in free},
            key=lambda d: (
                sum(r is not None for r in self.slots[d * rl : (d + 1) * rl]),
                -self.pages[d].free,
                d,
            ),
        )
        for d in candidates:
            pages = self.pages[d].allocate(len(request.prompt), request.max_new_tokens)
            if pages is not None:
                return next(s for s in free if s // rl == d), pages
        return None

    def _read_oldest(self, events: list) -> None:
        # Popped only once read, so ``has_work`` never reads False while an output is
        # still being fetched.
        item = self.inflight[0]
        t_wait = time.perf_counter()
        out = jax.device_get(item[1])  # the only place the core waits on the device
        t_host = time.perf_counter()
        self.times.device_wait_seconds += t_host - t_wait
        try:
            self._to_events(item, out, events)
        finally:
            self.inflight.popleft()
            self.times.host_seconds += time.perf_counter() - t_host

    def _to_events(self, item, out, events: list) -> None:
        kind, _, owners, budget, t_dispatch, index = item
        budget, padding, round_kind = budget if kind == "round" else (budget, 0, "")
        if kind == "prefill":
            for entry in owners:
                if entry is None or entry[0].done:
                    continue
                r, i = entry
                lps = (out.logprob[i : i + 1], out.top_ids[i : i + 1], out.top_logprobs[i : i + 1])
                self._emit(events, Emitted(r, [int(out.first_token[i])], int(out.finish[i]), lps))
            return
        now = time.perf_counter()
        seconds = now - max(t_dispatch, self._last_ready)
        self._last_ready = now
        self.policy.observe(index, out.survival, [r is not None for r in owners])
        taus = []
        for s, r in enumerate(owners):
            if r is None or r.done:
                continue
            n, code = int(out.num_emitted[s]), int(out.finish[s])
            if n:
                taus.append(n)
            lps = (out.logprobs[s, :n], out.top_ids[s, :n], out.top_logprobs[s, :n])
            self._emit(events, Emitted(
                r, [int(x) for x in out.tokens[s, :n]], code, lps, index,
                int(out.accepted[s]), int(out.verified[s]), out.survival[s], out.draft_tokens[s],
            ))  # fmt: skip
        events.append(RoundDone(
            index, seconds, budget, taus, int(np.sum(out.verified)), padding, round_kind
        ))  # fmt: skip

    def _emit(self, events: list, event: Emitted) -> None:
        if event.finish != FINISH_NONE:  # the device deactivated the slot: free it now
            event.request.done = True
            self._vacate(event.request.slot)
        events.append(event)

    # -- warm-up ------------------------------------------------------------------------
    def warmup(self, prompt_buckets: Sequence[int] = ()) -> None:
        """Compile every verify bucket and the given prompt buckets (one prefill row)."""
        state = self.decoder.init_state(self.seed)
        for t in prompt_buckets:
            row = PrefillRow(0, [1] * min(t, self.prefill.max_prompt_tokens), 2, 0.0, 0, 1.0,
                             np.asarray(state.slot_keys[0]))  # fmt: skip
            state, _ = self.prefill.run(state, [row], bucket=t)
        state = self.policy.warmup(state)
        jax.block_until_ready(state.seq_len)
