"""The primary tier: `CPUTierManager` (`manager`) keeps the bookkeeping of chunks in the host
slab — how a chunk enters (`stores`), slot allocation and the per-key `Chunk` (`slots`) and what
each request holds (`ledger`: pins and prefix chains)."""
