"""The disk tier: `DiskTier` (`tier`) keeps one verified file per chunk (`format`), named and
written by `files`, indexed in memory (`index`, rebuilt at start), under a root whose owner and
modes are checked (`root`); `reports` holds each job's chunks in flight and what the tier reports
(results, events, counters)."""
