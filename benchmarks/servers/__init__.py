"""Real servers on free loopback ports, started (and stopped) by the tests and the benchmarks alike.

- `redis.py`: `RedisServer`, one `redis-server` (killed, paused, restarted on the same port).
- `s3.py`: `SeaweedFS`, one `weed mini` serving S3.
- `tls.py`: a throwaway CA and a certificate for 127.0.0.1 that it signs.
- `throttle.py`: `ThrottledProxy`, a bandwidth-limited loopback TCP proxy to put in front of one
  of them (a shared tier slow on purpose: tests/test_vllm_e2e_remote.py, bench_costmodel.py).

Never a server assumed to be running; nothing here is part of kvtier. The tests reach this
package through their pytest plugins (tests/redis_servers.py, tests/s3_server.py), which put
benchmarks/ on sys.path.
"""
