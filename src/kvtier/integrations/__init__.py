"""Engine adapters. Each imports its engine; the kvtier core never does."""
