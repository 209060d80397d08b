"""The primary tier: `CPUTierManager` (`manager`) keeps the bookkeeping of chunks in the host
slab — slot allocation and the per-key `Chunk` (`slots`), what each request holds (`ledger`: pins
and prefix chains), which chunk continues which (`chains`) and the choice of victims when a store
needs room (`eviction`)."""
