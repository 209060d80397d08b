"""How a trace request becomes a fake-engine request, at a reduced scale.

A trace names prompt blocks of `trace_block_tokens` tokens (512 in Mooncake's traces);
the simulator's engine runs blocks of `engine_block_tokens` tokens (a few), one engine
block per trace block, so a 12,000-request trace replays in seconds while every prefix
relation of the trace is kept:

- trace block j (a whole one) -> engine block j, whose tokens are derived from its hash id;
  the engine's chained block hashes then match exactly where the trace's ids do;
- a partial last trace block -> one engine token (never a whole block: never cached), so
  the engine computes at least one token, as it would;
- a prompt made of whole blocks only recomputes its last block (an engine must compute one
  token to sample): that block is not a possible hit, as in vLLM;
- output tokens scale the same way (at least one), so a request's decode stays short.

Hit rates are reported in trace tokens: a hit block counts `trace_block_tokens` tokens,
over the trace's prompt tokens (`input_length`).

Thread-safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.sim.trace import TraceRequest

__all__ = ["engine_output_tokens", "engine_prompt", "hittable_blocks", "num_unique_blocks"]


def engine_prompt(
    req: TraceRequest, trace_block_tokens: int, engine_block_tokens: int
) -> list[int]:
    """The engine's prompt: `engine_block_tokens` tokens per whole trace block, one for a partial one."""
    num_full = req.num_full_blocks(trace_block_tokens)
    tokens = [
        h * engine_block_tokens + i
        for h in req.hash_ids[:num_full]
        for i in range(engine_block_tokens)
    ]
    if num_full < len(req.hash_ids):
        tokens.append(req.hash_ids[num_full] * engine_block_tokens)
    return tokens


def engine_output_tokens(
    req: TraceRequest, trace_block_tokens: int, engine_block_tokens: int
) -> int:
    """Tokens the engine generates: the trace's output at the same scale, at least one."""
    return max(1, round(req.output_length * engine_block_tokens / trace_block_tokens))


def hittable_blocks(req: TraceRequest, trace_block_tokens: int) -> Sequence[int]:
    """Hash ids of the prompt blocks a cache could serve: the whole blocks, but the last one
    when the prompt has no partial block (that one is recomputed to sample the first token)."""
    num_full = req.num_full_blocks(trace_block_tokens)
    return req.hash_ids[: num_full if num_full < len(req.hash_ids) else num_full - 1]


def num_unique_blocks(requests: Sequence[TraceRequest]) -> int:
    """Distinct hash ids in the trace (the base of capacities given as a fraction)."""
    return len({h for req in requests for h in req.hash_ids})
