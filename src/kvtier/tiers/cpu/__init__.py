"""The primary tier: `CPUTierManager` (`manager`) keeps the bookkeeping of chunks in the host
slab — slot allocation (`slots`) and what each request holds (`ledger`: pins and prefix chains)."""
