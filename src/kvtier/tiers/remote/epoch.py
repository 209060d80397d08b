"""The epoch record of a namespace in a store that cannot list (`RemoteStore.lists` False): one
small value, `ValueCodec.epoch_name`, holding a random token under which every replica of the
namespace names its values; a reset replaces it. Why, and the rule replicas follow, is in
`kvtier.tiers.remote.reset`.

The record is made with the store's put-if-absent only (no overwrite, no counter): a token is
random, so a record lost to the store's eviction or TTL is made again with a new one, which makes
every older value unreachable (a lost record costs hits, never serves a value from before a
reset). Where values expire, each read renews the record's TTL, so that it lives as long as a
replica reads it.

Thread-safety: every method may be called from any thread (the store's calls are).
"""

from __future__ import annotations

import re
import secrets

from kvtier.errors import KVTierError
from kvtier.tiers.remote.store import RemoteStore

__all__ = ["EpochRecord"]

# a token: 16 hex digits (a name's part on every store)
_TOKEN = re.compile(rb"[0-9a-f]{16}")
# reads of a record that other replicas keep replacing before one succeeds
_TRIES = 5


class EpochRecord:
    """Args: store: where the record lives; name: its name (`ValueCodec.epoch_name`)."""

    def __init__(self, store: RemoteStore, name: str):
        self._store = store
        self._name = name

    def read(self) -> str:
        """The namespace's epoch: the record's token; a new one where there is none, or where the
        record holds no token (it is replaced).

        Raises:
            KVTierError: the record changed under every try (other replicas resetting).
            Exception: the store's failures.
        """
        for _ in range(_TRIES):
            (value,) = self._store.get([self._name])
            if value is not None and _TOKEN.fullmatch(bytes(value)):
                self._store.renew([self._name])
                return bytes(value).decode()
            if value is not None:
                self._store.delete([self._name])
            token = self._make()
            if token is not None:
                return token
        raise KVTierError(f"{self._store.medium} tier: the epoch record {self._name} kept changing")

    def replace(self) -> str:
        """A new epoch (a reset): the record deleted and made again, or the one another replica
        made after that delete (it is as new).

        Raises:
            Exception: the store's failures (see `read`).
        """
        self._store.delete([self._name])
        token = self._make()
        if token is not None:
            return token
        return self.read()

    def _make(self) -> str | None:
        """A new token, written unless the record exists (then None)."""
        token = secrets.token_hex(8)
        (is_written,) = self._store.put([(self._name, [token.encode()])])
        if not is_written:
            return None
        return token
