"""Tenant quotas: how many of a tier's slots one tenant's chunks may hold.

A tenant is a request's `cache_salt` (vLLM's per-tenant isolation: the salt changes every block
hash, so two tenants never share a chunk); requests without one are the tenant "". `quotas`
maps a tenant to the slots it may hold; "*" applies to each tenant not named (and to "" too).
A tenant at its quota that stores more evicts its own chunks first, in the tier's own eviction
order, never another tenant's: one tenant's burst cannot evict another's working set (what
LMCache's `IsolatedLRU` does for its CPU tier). A store larger than the whole quota keeps its
head. A tenant under its quota stores as before: when the tier is full it evicts by the policy.

Configured in bytes (`tenant_quotas: {"tenant-a": "2GiB", "*": "512MiB"}`); a tier turns them
into slots of its own size.

Thread-safety: not thread-safe; the owning tier serializes calls.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence

from kvtier.keys import OffloadKey

__all__ = ["ANY_TENANT", "TenantQuotas", "in_slots"]

ANY_TENANT = "*"


def in_slots(bytes_by_tenant: dict[str, int] | None, slot_bytes: int) -> dict[str, int]:
    """Quotas in bytes as whole slots of `slot_bytes` (at least one each)."""
    return {
        tenant: max(1, num_bytes // slot_bytes)
        for tenant, num_bytes in (bytes_by_tenant or {}).items()
    }


class TenantQuotas:
    """Args: slots_by_tenant: {tenant or "*": slots} (empty: no quota, nothing is tracked)."""

    def __init__(self, slots_by_tenant: dict[str, int] | None = None):
        self.slots_by_tenant = dict(slots_by_tenant or {})
        self.is_enabled = bool(self.slots_by_tenant)
        self._tenant_of: dict[OffloadKey, str] = {}
        self._held: Counter[str] = Counter()

    def limit(self, tenant: str) -> int | None:
        """The slots `tenant` may hold, or None (no quota)."""
        return self.slots_by_tenant.get(tenant, self.slots_by_tenant.get(ANY_TENANT))

    def excess(self, tenant: str, num_new: int) -> int:
        """How many of `tenant`'s chunks must go before it adds `num_new` (0: none)."""
        limit = self.limit(tenant)
        return 0 if limit is None else max(0, self._held[tenant] + num_new - limit)

    def charge(self, keys: Iterable[OffloadKey], tenant: str) -> None:
        if self.is_enabled:
            for key in keys:
                self._tenant_of[key] = tenant
                self._held[tenant] += 1

    def release(self, keys: Iterable[OffloadKey]) -> None:
        if self.is_enabled:
            for key in keys:
                tenant = self._tenant_of.pop(key, None)
                if tenant is not None:
                    self._held[tenant] -= 1

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    def all_but(self, tenant: str, protected: Container[OffloadKey]) -> Container[OffloadKey]:
        """Protects `protected` and every chunk of another tenant: an eviction that takes only `tenant`'s."""
        return _OthersOf(tenant, self._tenant_of, protected)

    def clear(self) -> None:
        self._tenant_of.clear()
        self._held.clear()

    def check(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether exactly `keys` are charged, each once (for the tier's `check()`)."""
        return not self.is_enabled or (
            set(self._tenant_of) == set(keys) and sum(self._held.values()) == len(keys)
        )


class _OthersOf:
    __slots__ = ("protected", "tenant", "tenant_of")

    def __init__(
        self, tenant: str, tenant_of: dict[OffloadKey, str], protected: Container[OffloadKey]
    ):
        self.tenant = tenant
        self.tenant_of = tenant_of
        self.protected = protected

    def __contains__(self, key: object) -> bool:
        return key in self.protected or self.tenant_of.get(key) != self.tenant  # type: ignore[call-overload]
