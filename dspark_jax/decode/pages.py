"""Host-side allocation of the paged KV cache (``ops.paged_attention``).

A request is given, when it is admitted, every page it can ever write: its prompt plus
``max_new_tokens`` positions (the decode step never writes past ``prompt + max_new - 2``:
verify lengths are capped by the tokens still allowed), plus ``extra_positions`` for a
DSpark/DFlash drafter, whose draft writes its block's γ K/V past the context into the
same pages (``ops.paged_attention.block_attention``). Reserving at admission keeps the
page table a constant of the request: it is written once by the prefill and never
updated by the host between rounds, so rounds stay asynchronous (the host never waits to
grow a sequence) and a running request can never run out of pages. Memory is what the
admitted requests can hold, so a pool smaller than ``slots × max_len`` serves many short
requests; when the pool cannot hold the next request, it waits in the queue until a
finished request frees pages (never dropped).

Pages are freed when the host learns a request has ended. The device may still run rounds
dispatched before that; they run before anything dispatched later (one stream), and a
slot that has finished or been released writes nothing, so a page handed to a new request
is never written by its previous owner after the new prefill.
"""

from __future__ import annotations

import numpy as np

from dspark_jax.ops.paged_attention import NULL_PAGE, pages_per_sequence

__all__ = ["PagePool", "ReplicaPages", "full_pool_pages"]


def full_pool_pages(num_slots: int, max_len: int, page_size: int) -> int:
    """Pages for every slot at ``max_len`` plus the null page (never waits)."""
    return num_slots * pages_per_sequence(max_len, page_size) + 1


class PagePool:
    """Free list of pages ``1 .. num_pages - 1`` (page 0 is the null page)."""

    def __init__(self, num_pages: int, page_size: int, max_len: int, extra_positions: int = 0):
        if num_pages < 2:
            raise ValueError(f"a page pool needs >= 2 pages (page 0 is null), got {num_pages}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_len = int(max_len)
        self.extra_positions = int(extra_positions)
        self.pages_per_seq = pages_per_sequence(self.max_len + self.extra_positions, page_size)
        # Lowest pages first: a fresh pool hands out 1, 2, 3, … (easy to read in tests).
        self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))
        self._allocated: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def pages_for(self, prompt_len: int, max_new_tokens: int) -> int:
        """Pages a request of this prompt and output budget reserves."""
        positions = min(int(prompt_len) + int(max_new_tokens), self.max_len)
        return pages_per_sequence(positions + self.extra_positions, self.page_size)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise if the request could never be admitted, even into an empty pool."""
        need = self.pages_for(prompt_len, max_new_tokens)
        if need > self.capacity:
            block = f" + {self.extra_positions} draft-block positions" * bool(self.extra_positions)
            raise ValueError(
                f"the request needs {need} KV pages of {self.page_size} tokens "
                f"({prompt_len} prompt + {max_new_tokens} new tokens{block}) but the page "
                f"pool has {self.capacity}; raise the pool size or lower max_tokens"
            )

    def allocate(self, prompt_len: int, max_new_tokens: int) -> np.ndarray | None:
        """A page-table row ``[pages_per_seq]`` for a new request (unowned entries are the
        null page), or None if the pool has too few free pages now."""
        need = self.pages_for(prompt_len, max_new_tokens)
        if need > len(self._free):
            return None
        row = np.full((self.pages_per_seq,), NULL_PAGE, np.int32)
        for i in range(need):
            row[i] = self._free.pop()
        self._allocated.update(int(p) for p in row[:need])
        return row

    def release(self, row: np.ndarray | None) -> None:
        """Return a request's pages (its page-table row) to the pool."""
        if row is None:
            return
        owned = [int(p) for p in row if p != NULL_PAGE]
        if len(set(owned)) != len(owned) or not self._allocated.issuperset(owned):
            raise ValueError(f"pages not allocated from this pool (double free?): {row!r}")
        self._allocated.difference_update(owned)
        self._free.extend(reversed(owned))


class ReplicaPages:
    """One ``PagePool`` per data replica (``decode.replicas``): replica d's slots take
    pages only from pool d, whose page numbers are local to it. The figures (``used``,
    ``free``, ``capacity``) add up the pools; a request must fit one pool."""

    def __init__(self, replicas: int, num_pages: int, page_size: int, max_len: int,
                 extra_positions: int = 0):  # fmt: skip
        self.pools = [
            PagePool(num_pages, page_size, max_len, extra_positions) for _ in range(replicas)
        ]
        self.page_size = int(page_size)

    def __len__(self) -> int:
        return len(self.pools)

    def __getitem__(self, replica: int) -> PagePool:
        return self.pools[replica]

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.pools)

    @property
    def free(self) -> int:
        return sum(p.free for p in self.pools)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise if the request could never be admitted, even into an empty replica pool."""
        self.pools[0].check_fits(prompt_len, max_new_tokens)
