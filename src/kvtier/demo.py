"""`make demo`: the offloading manager on a built-in synthetic multi-turn chat.

Conversations share a system prompt; each turn re-sends the whole history plus a new
user message. The demo hashes every prompt into chunk keys with kvtier's vLLM-compatible
hasher and drives `CPUTierManager` the way the scheduler does (look up the prefix, load
the hits, store the rest), once per policy and capacity, printing token hit rates. It
is a real run of the manager, not a model of it; no engine is involved yet.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from kvtier.base import ReqContext
from kvtier.keys import BlockHasher, make_offload_key
from kvtier.tiers.cpu import CPUTierManager

BLOCK_SIZE = 16  # tokens per block (and per chunk here)


@dataclass(slots=True)
class Result:
    policy: str
    num_slots: int
    hit_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


def chat_workload(num_convs: int, num_turns: int, system_tokens: int, seed: int) -> list[list[int]]:
    """Prompts (token ids) of interleaved multi-turn conversations on one system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(system_tokens)]
    histories = [list(system) for _ in range(num_convs)]
    prompts = []
    for _ in range(num_turns):
        for history in histories:
            history.extend(rng.randrange(32000) for _ in range(rng.randint(40, 200)))  # user message
            prompts.append(list(history))
            history.extend(rng.randrange(32000) for _ in range(rng.randint(20, 120)))  # the reply
    return prompts


def replay(prompts: list[list[int]], policy: str, num_slots: int) -> Result:
    hasher = BlockHasher(BLOCK_SIZE)
    manager = CPUTierManager(num_slots, policy=policy)
    result = Result(policy, num_slots)
    start = time.perf_counter()
    for i, tokens in enumerate(prompts):
        ctx = ReqContext(req_id=f"req-{i}")
        keys = [make_offload_key(h, 0) for h in hasher.hash_blocks(tokens)]
        num_hits, _ = manager.lookup_prefix(keys, ctx)
        if num_hits:
            manager.prepare_load(keys[:num_hits], ctx)
            manager.complete_load(keys[:num_hits], ctx)
        manager.touch(keys, ctx)
        out = manager.prepare_store(keys[num_hits:], ctx)
        if out is not None:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        result.hit_tokens += num_hits * BLOCK_SIZE
        result.prompt_tokens += len(tokens)
    result.seconds = time.perf_counter() - start
    result.evictions = manager.stats().evictions
    manager.check()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = chat_workload(args.conversations, args.turns, args.system_tokens, args.seed)
    working_set = len({k for p in prompts for k in BlockHasher(BLOCK_SIZE).hash_blocks(p)})
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {working_set} distinct chunks")
    print(f"{'policy':<6} {'slots':>6} {'of working set':>14} {'token hit rate':>15} {'evictions':>10} {'keys/s':>10}")
    for fraction in (1.0, 0.5, 0.25):
        for policy in ("lru", "arc"):
            r = replay(prompts, policy, max(1, int(working_set * fraction)))
            keys_per_s = r.prompt_tokens / BLOCK_SIZE / r.seconds
            print(
                f"{policy:<6} {r.num_slots:>6} {fraction:>14.0%} {r.hit_rate:>15.1%} "
                f"{r.evictions:>10} {keys_per_s:>10.0f}"
            )


if __name__ == "__main__":
    main()
