"""The simulator's cost model: what a replay's hits would save in time to first token, and the
figures `kvtier.costmodel.choose_load` decides with in a replay (`CostModel.snapshot`).

Deliberately simple, and stated here so a reader can redo the arithmetic:

- A prompt token the engine computes costs `1 / prefill_tokens_per_s` seconds.
- A chunk's bytes are its tokens times `kv_bytes_per_token` (the modelled model's KV size:
  layers x KV heads x head size x 2 (K and V) x bytes per element).
- Reading B bytes from a tier costs `latency + B / throughput` (`<tier>_latency_ms`,
  `<tier>_gb_per_s`); "cpu" is the host link, host RAM into the accelerator.
- A request that loads a head of its prefix waits for it (the decision's own arithmetic,
  `kvtier.costmodel.decision`): if any of the head's chunks is on a secondary tier (disk, Redis,
  S3), the longest of one engine step and each tier's read of its share of the head (the tiers
  read in parallel); then the whole head's copy over the host link. The tokens it does not load
  are computed.
- The estimate sums, over the trace, the prefill work without kvtier (every token the engine's
  own prefix cache did not serve is computed) and with it (the tokens kvtier did not serve are
  computed, plus each load's expected seconds as its decision computed them). The engine's own
  prefix hits are the same in both cases (every computed or loaded block enters the engine's
  cache either way). A load that got fewer chunks than its decision chose (a RAM tier too small
  to hold a promoted head at once) is still charged what the decision expected. Queueing,
  batching and decode are not modelled.

A replay has a RAM tier and at most a disk tier; the Redis and S3 figures serve `snapshot`'s
other callers (`benchmarks/plot_payoff.py`: when does each tier pay off).

The model has figures of its own for the built-in tiers (`cpu`, `disk`, `redis`, `s3`): they
model one machine (the figures below, flags of `kvtier simulate`), not what a tier does until
measured, so they are not the tiers' read priors. Every other registered tier
(`kvtier.tiers.registry`, an out-of-tree one) is read at its descriptor's read prior, so a
snapshot covers every registered tier; a tier that is not registered is a `ConfigError`.

The defaults model Llama-3-8B in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes = 128 KiB
per token) prefilling at 10,000 tokens/s on one accelerator, host memory at 20 GB/s (PCIe
Gen4 x16 in practice), a local NVMe disk at 2 GB/s, Redis over 10 GbE at 1.2 GB/s and S3 at
0.3 GB/s. Change them to your model and machine (`kvtier bench` measures the bandwidths of
this one).

Thread-safety: immutable values and pure functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.costmodel import CostSnapshot, ReadEstimate
from kvtier.errors import ConfigError
from kvtier.tiers.registry import tier_descriptor, tier_descriptors

__all__ = ["CostModel", "TTFTEstimate"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill speed, the model's KV size and each tier's reads (see the module docstring).

    Args:
        prefill_tokens_per_s: prompt tokens the engine computes per second.
        kv_bytes_per_token: bytes of KV one token takes, over every layer.
        cpu_gb_per_s: the host link's throughput (host RAM into the accelerator), in GB/s.
        disk_gb_per_s: the local disk tier's read throughput, in GB/s.
        redis_gb_per_s: the Redis tier's read throughput, in GB/s (10 GbE carries 1.25).
        s3_gb_per_s: the S3 tier's read throughput, in GB/s.
        cpu_latency_ms: what a copy over the host link takes beyond its bytes, in milliseconds.
        disk_latency_ms: what a read from the disk tier takes beyond its bytes, in milliseconds.
        redis_latency_ms: what a read from Redis takes beyond its bytes (a round trip), in milliseconds.
        s3_latency_ms: what a read from S3 takes beyond its bytes (the first byte), in milliseconds.
    """

    prefill_tokens_per_s: float = 10_000.0
    kv_bytes_per_token: int = 131_072
    cpu_gb_per_s: float = 20.0
    disk_gb_per_s: float = 2.0
    redis_gb_per_s: float = 1.2
    s3_gb_per_s: float = 0.3
    cpu_latency_ms: float = 0.01
    disk_latency_ms: float = 0.1
    redis_latency_ms: float = 0.5
    s3_latency_ms: float = 30.0

    def __post_init__(self) -> None:
        if min(self.prefill_tokens_per_s, self.kv_bytes_per_token, *self._throughputs()) <= 0:
            raise ConfigError(
                f"prefill_tokens_per_s, kv_bytes_per_token and every *_gb_per_s must be positive: {self}"
            )
        if min(latency_ms for _, latency_ms in self._figures().values()) < 0:
            raise ConfigError(f"a *_latency_ms cannot be negative: {self}")

    def read(self, medium: str) -> ReadEstimate:
        """Reading from tier `medium` ("cpu": the host link): the model's figures for a built-in
        tier, the descriptor's read prior for another registered one.

        Raises:
            ConfigError: no tier of that name is registered.
        """
        figures = self._figures()
        if medium not in figures:
            return tier_descriptor(medium).read_prior
        gb_per_s, latency_ms = figures[medium]
        return ReadEstimate(gb_per_s * 1e9, latency_ms / 1e3)

    def snapshot(self, step_s: float = 0.0, token_scale: float = 1.0) -> CostSnapshot:
        """The figures `kvtier.costmodel.choose_load` decides with, fixed.

        Args:
            step_s: one engine step: a request whose chunks come up from a secondary tier waits
                at least this long (it is asked again at the next step at the earliest).
            token_scale: modelled tokens that one token of the deciding engine stands for (a
                replay runs one small engine block per trace block); the prefill speed is
                divided by it, so a chunk's recompute time is the modelled one.
        """
        if not token_scale > 0 or step_s < 0:
            raise ConfigError(
                f"token_scale must be positive and step_s >= 0, got {token_scale}, {step_s}"
            )
        return CostSnapshot(
            {d.name: self.read(d.name) for d in tier_descriptors()},
            self.prefill_tokens_per_s / token_scale,
            step_s,
        )

    def estimate(
        self,
        num_requests: int,
        prompt_tokens: int,
        engine_hit_tokens: int,
        kvtier_hit_tokens: int,
        *,
        load_s: float,
    ) -> TTFTEstimate:
        """Prefill seconds without and with kvtier's hits, over `num_requests` requests.

        Args:
            prompt_tokens: every request's prompt tokens together.
            engine_hit_tokens: of those, tokens the engine's own prefix cache served.
            kvtier_hit_tokens: tokens kvtier loaded (from RAM, or from a secondary tier through RAM).
            load_s: the loads' expected seconds together, each as its decision computed it
                (`LoadChoice.load_s`; the scheduler sums them as `expected_load_us`).
        """
        compute = prompt_tokens - engine_hit_tokens
        baseline = compute / self.prefill_tokens_per_s
        with_kvtier = (compute - kvtier_hit_tokens) / self.prefill_tokens_per_s + load_s
        return TTFTEstimate(num_requests, baseline, with_kvtier)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _figures(self) -> dict[str, tuple[float, float]]:
        """The built-in tiers' figures: tier name -> (GB/s, latency in ms)."""
        return {
            "cpu": (self.cpu_gb_per_s, self.cpu_latency_ms),
            "disk": (self.disk_gb_per_s, self.disk_latency_ms),
            "redis": (self.redis_gb_per_s, self.redis_latency_ms),
            "s3": (self.s3_gb_per_s, self.s3_latency_ms),
        }

    def _throughputs(self) -> list[float]:
        return [gb_per_s for gb_per_s, _ in self._figures().values()]


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
        return {
            "baseline_s": self.baseline_s,
            "with_kvtier_s": self.with_kvtier_s,
            "saving_s": self.saving_s,
            "saving_fraction": self.saving_fraction,
            "mean_saving_ms_per_request": self.mean_saving_ms,
        }
