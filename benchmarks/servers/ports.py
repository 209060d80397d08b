"""Where the test servers' fixed ports come from: below the kernel's ephemeral range.

A server restarted on the port it had (a stopped Redis brought back, `weed mini` checking its
ports one by one) must find that port free. A port inside the ephemeral range (what bind(0) and
every outgoing connection's source port are drawn from) can meanwhile be taken as the source
port of some connection, a reconnecting client's or the server's own, and the start then fails.
Stdlib only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["MIN_PORT", "ephemeral_low"]

# clear of the well-known ports, and of those some servers put at HTTP + 10000
MIN_PORT = 12000


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768
