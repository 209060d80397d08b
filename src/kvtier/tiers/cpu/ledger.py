"""What each request holds in a tier: its pins, and its prefix chain.

- Pins: a load pins the chunks it reads; `complete_load` (or the request's end) unpins.
- Chain: the keys a request touched or offered for storing, in the order it did, which is
  head first: a request's prefix grows at its tail, so its calls arrive head first, chunk
  by chunk across KV-cache groups. Each key is remembered with the key before it in the chain
  and the key before it in its own KV-cache group (its parents): the tier links a chunk that
  becomes READY to the first of them that is READY (`kvtier.tiers.cpu.chains`), so that a chunk
  is never evicted before a deeper chunk of the same prefix — a tail is useless without its
  head — also when the prefix was stored over several calls (chunked prefill, decode, retries)
  and across groups.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from kvtier.keys import GROUP_INDEX_BYTES, OffloadKey

__all__ = ["Parents", "RequestLedger"]


# (the key before in the chain, before in its group)
Parents = tuple[OffloadKey | None, OffloadKey | None]
_NO_PARENTS: Parents = (None, None)


class _Chain:
    """One request's keys, head first, each with its parents."""

    __slots__ = ("last", "last_of_group", "parents_of")

    def __init__(self) -> None:
        # insertion-ordered: the chain
        self.parents_of: dict[OffloadKey, Parents] = {}
        self.last: OffloadKey | None = None
        # group index bytes -> its deepest key so far
        self.last_of_group: dict[bytes, OffloadKey] = {}


class RequestLedger:
    """Pins and prefix chains, per request id."""

    def __init__(self) -> None:
        self._pins: dict[str, Counter[OffloadKey]] = {}
        self._chains: dict[str, _Chain] = {}

    def pin_all(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """One pin of the request on each of `keys` (a load: O(keys), one look-up of the request)."""
        held = self._pins.get(req_id)
        if held is None:
            held = Counter()
            self._pins[req_id] = held
        for key in keys:
            # (not `+= 1`: a Counter's missing key is a Python-level call)
            held[key] = held.get(key, 0) + 1

    def unpin_all(self, req_id: str, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop one of the request's pins on each of `keys`; returns those it held one on (once per pin
        dropped)."""
        held = self._pins.get(req_id)
        if held is None:
            return []
        dropped = []
        for key in keys:
            count = held.get(key, 0)
            if count <= 0:
                continue
            dropped.append(key)
            if count == 1:
                del held[key]
            else:
                held[key] = count - 1
        if not held:
            del self._pins[req_id]
        return dropped

    def extend_chain(self, req_id: str, keys: Iterable[OffloadKey]) -> None:
        """Append keys the request touched or offered (already listed ones keep their place). O(keys)."""
        chain = self._chains.get(req_id)
        if chain is None:
            chain = _Chain()
            self._chains[req_id] = chain
        parents_of = chain.parents_of
        last_of_group = chain.last_of_group
        for key in keys:
            if key in parents_of:
                continue
            group = key[-GROUP_INDEX_BYTES:]
            parents_of[key] = (chain.last, last_of_group.get(group))
            chain.last = key
            last_of_group[group] = key

    def chain(self, req_id: str) -> list[OffloadKey]:
        """The request's keys, head first (O(chain): once per request)."""
        chain = self._chains.get(req_id)
        return [] if chain is None else list(chain.parents_of)

    def chain_keys(self, req_id: str) -> Mapping[OffloadKey, object]:
        """The request's keys, for membership tests (O(1) each; a live view, not a copy)."""
        chain = self._chains.get(req_id)
        return {} if chain is None else chain.parents_of

    def parents(self, req_id: str, keys: Sequence[OffloadKey]) -> list[Parents]:
        """For each of `keys`, the key before it in the request's chain and the one before it in its
        KV-cache group (None: none, or not in the chain)."""
        chain = self._chains.get(req_id)
        if chain is None:
            return [_NO_PARENTS] * len(keys)
        parents_of = chain.parents_of
        return [parents_of.get(key, _NO_PARENTS) for key in keys]

    def release(self, req_id: str) -> Counter[OffloadKey]:
        """Forget the request; returns the pins it still held (to be unpinned)."""
        self._chains.pop(req_id, None)
        return self._pins.pop(req_id, None) or Counter()

    def all_pins(self) -> Counter[OffloadKey]:
        """Pins held by every request together (O(pins); for `check()`)."""
        return sum(self._pins.values(), Counter())

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)
