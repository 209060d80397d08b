"""The simulator's cost model: what a replay's hits would save in time to first token.

Deliberately simple, and stated here so a reader can redo the arithmetic:

- A prompt token the engine computes costs `1 / prefill_tokens_per_s` seconds.
- A chunk kvtier loads costs its bytes over the host-to-device bandwidth (`cpu_gb_per_s`);
  one that first has to come up from disk costs its bytes over `disk_gb_per_s` more.
- A chunk's bytes are its tokens times `kv_bytes_per_token` (the modelled model's KV size:
  layers x KV heads x head size x 2 (K and V) x bytes per element).
- Without kvtier, the tokens kvtier served are computed instead; the engine's own prefix
  hits are the same in both cases (every computed or loaded block enters the engine's cache
  either way). Queueing, batching and decode are not modelled: the estimate is the prefill
  work a request is spared, summed over the trace.

The defaults model Llama-3-8B in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes = 128 KiB
per token) prefilling at 10,000 tokens/s on one accelerator, host memory at 20 GB/s (PCIe
Gen4 x16 in practice) and a local NVMe disk at 2 GB/s. Change them to your model and machine
(`kvtier bench` measures the bandwidths of this one).

Thread-safety: immutable values and pure functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.errors import ConfigError

__all__ = ["CostModel", "TTFTEstimate"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill speed and per-tier bandwidths (see the module docstring)."""

    prefill_tokens_per_s: float = 10_000.0
    kv_bytes_per_token: int = 131_072
    cpu_gb_per_s: float = 20.0
    disk_gb_per_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.prefill_tokens_per_s, self.cpu_gb_per_s, self.disk_gb_per_s) <= 0 or self.kv_bytes_per_token <= 0:
            raise ConfigError(f"every cost-model figure must be positive: {self}")

    def estimate(self, num_requests: int, prompt_tokens: int, engine_hit_tokens: int, kvtier_hit_tokens: int,
                 disk_hit_tokens: int = 0) -> TTFTEstimate:
        """Prefill seconds without and with kvtier's hits, over `num_requests` requests.

        Args:
            prompt_tokens: every request's prompt tokens together.
            engine_hit_tokens: of those, tokens the engine's own prefix cache served.
            kvtier_hit_tokens: tokens kvtier loaded (from RAM, or from disk through RAM).
            disk_hit_tokens: of those, tokens first read up from disk.
        """
        compute = prompt_tokens - engine_hit_tokens
        baseline = compute / self.prefill_tokens_per_s
        loads = kvtier_hit_tokens * self.kv_bytes_per_token / (self.cpu_gb_per_s * 1e9)
        loads += disk_hit_tokens * self.kv_bytes_per_token / (self.disk_gb_per_s * 1e9)
        with_kvtier = (compute - kvtier_hit_tokens) / self.prefill_tokens_per_s + loads
        return TTFTEstimate(num_requests, baseline, with_kvtier)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """Prefill seconds summed over a trace's requests, without and with kvtier."""

    num_requests: int
    baseline_s: float
    with_kvtier_s: float

    @property
    def saving_s(self) -> float:
        return self.baseline_s - self.with_kvtier_s

    @property
    def saving_fraction(self) -> float:
        return self.saving_s / self.baseline_s if self.baseline_s > 0 else 0.0

    @property
    def mean_saving_ms(self) -> float:
        return 1000.0 * self.saving_s / self.num_requests if self.num_requests else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"baseline_s": self.baseline_s, "with_kvtier_s": self.with_kvtier_s, "saving_s": self.saving_s,
                "saving_fraction": self.saving_fraction, "mean_saving_ms_per_request": self.mean_saving_ms}
