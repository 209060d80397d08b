"""The shared tiers: `RemoteTier` (`tier`) makes a shared store's decisions — what it knows of the
store's keys (`keys`, `probes`), checked and optionally keyed values (`values`), its jobs' I/O on
the pools, what it reports (`reports`), the circuit breaker (`breaker`), reset (`reset`, and
`epoch` on a store that cannot list); `store` is the byte contract a store client meets, `redis`
(with `redis_wire`) and `s3` the clients; `credentials` reads their secrets."""
