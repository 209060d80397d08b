"""What each request holds in a tier: its pins, and its prefix chain.

- Pins: a load pins the chunks it reads; `complete_load` (or the request's end) unpins.
- Chain: the keys a request touched or offered for storing, in the order it did, which is
  head first: a request's prefix grows at its tail, so its calls arrive head first, chunk
  by chunk across KV-cache groups. The tier re-ranks the chain after each store the
  request completes, so a chunk is never evicted before a deeper chunk of the same
  prefix — a tail is useless without its head — also when the prefix was stored over
  several calls (chunked prefill, decode, retries) and across groups.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

from kvtier.keys import OffloadKey

__all__ = ["RequestLedger"]


class RequestLedger:
    """Pins and prefix chains, per request id."""

    def __init__(self) -> None:
        self._pins: dict[str, Counter[OffloadKey]] = {}
        self._chains: dict[str, dict[OffloadKey, None]] = {}  # an insertion-ordered set per request

    def pin(self, req_id: str, key: OffloadKey) -> None:
        self._pins.setdefault(req_id, Counter())[key] += 1

    def unpin(self, req_id: str, key: OffloadKey) -> bool:
        """Drop one of the request's pins on `key`; False if it held none."""
        held = self._pins.get(req_id)
        if held is None or held[key] <= 0:
            return False
        held[key] -= 1
        if held[key] == 0:
            del held[key]
            if not held:
                del self._pins[req_id]
        return True

    def extend_chain(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """Append keys the request touched or offered (already listed ones keep their place)."""
        self._chains.setdefault(req_id, {}).update(dict.fromkeys(keys))

    def chain(self, req_id: str) -> list[OffloadKey]:
        """The request's keys, head first."""
        return list(self._chains.get(req_id, ()))

    def release(self, req_id: str) -> Counter[OffloadKey]:
        """Forget the request; returns the pins it still held (to be unpinned)."""
        self._chains.pop(req_id, None)
        return self._pins.pop(req_id, None) or Counter()

    def all_pins(self) -> Counter[OffloadKey]:
        """Pins held by every request together (O(pins); for `check()`)."""
        return sum(self._pins.values(), Counter())

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)
