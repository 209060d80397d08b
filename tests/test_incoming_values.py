"""A value verified while it is received (`values.IncomingValue`, issue 22 item 5): the pieces a
store reports are hashed as they land, and `ValueCodec.check` trusts that digest only when it
covered the whole value; anything else (no reports, a value cut short) hashes the buffers.

No server: values are packed by the codec and "received" here piece by piece, or through
`redis_wire.read_replies` on a socket pair that plays the server.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from helpers import HANG_S
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.redis_wire import read_replies
from kvtier.tiers.remote.values import IncomingValue, ValueCodec

# received into two buffers of unequal size (as two ranks' rows)
PAYLOAD = 3 * 4096 + 17
KEY = bytes(range(32)) + bytes(4)


def codec(is_keyed: bool) -> ValueCodec:
    ns = Namespace("incoming", "float16", "blocks", 16, 4, "sha256_cbor", 1, PAYLOAD)
    return ValueCodec(ns, "kvtier", ":", b"a deployment secret" if is_keyed else None)


def packed(c: ValueCodec) -> bytes:
    """A valid value of KEY: header, payload (two ranks), tag when keyed."""
    payload = np.random.default_rng(7).integers(0, 256, PAYLOAD, np.uint8).tobytes()
    ranks = [memoryview(payload[:4096]), memoryview(payload[4096:])]
    return b"".join(bytes(part) for part in c.pack(KEY, ranks))


def slab_rows() -> list[memoryview]:
    return [memoryview(np.zeros(4096, np.uint8)), memoryview(np.zeros(PAYLOAD - 4096, np.uint8))]


def receive(
    incoming: IncomingValue,
    value: bytes,
    piece_bytes: int,
    *,
    report: bool = True,
    upto: int | None = None,
) -> None:
    """Write `value[:upto]` into the parts in pieces of at most `piece_bytes`, as a store does."""
    offset, end = 0, len(value) if upto is None else upto
    for part in incoming:
        part = part.cast("B") if part.format != "B" else part
        filled = 0
        while filled < part.nbytes and offset < end:
            n = min(piece_bytes, part.nbytes - filled, end - offset)
            part[filled : filled + n] = value[offset : offset + n]
            if report:
                incoming.received(part[filled : filled + n])
            filled, offset = filled + n, offset + n


@pytest.mark.parametrize("is_keyed", [False, True])
@pytest.mark.parametrize("piece_bytes", [1, 100, 4096, 1 << 20])
def test_a_value_hashed_as_it_arrives_passes_and_lands_in_the_rows(is_keyed, piece_bytes):
    c = codec(is_keyed)
    value, rows = packed(c), slab_rows()
    incoming = c.receiving_parts(rows)
    receive(incoming, value, piece_bytes)
    # every byte reported once → the digest is the whole value's, and it checks out
    assert incoming.num_received == len(value) == c.value_bytes
    assert c.check(KEY, len(value), incoming) is None
    assert b"".join(bytes(r) for r in rows) == value[128 : 128 + PAYLOAD]


@pytest.mark.parametrize("is_keyed", [False, True])
def test_a_value_whose_last_piece_is_altered_is_refused(is_keyed):
    c = codec(is_keyed)
    value = bytearray(packed(c))
    # the payload's last byte: in the last piece received
    value[128 + PAYLOAD - 1] ^= 0x01
    incoming = c.receiving_parts(slab_rows())
    receive(incoming, bytes(value), 4096)
    why = c.check(KEY, len(value), incoming)
    assert why is not None and ("tag mismatch" if is_keyed else "checksum mismatch") in why


@pytest.mark.parametrize("is_keyed", [False, True])
def test_bytes_changed_after_they_were_hashed_are_refused(is_keyed):
    c = codec(is_keyed)
    value = packed(c)
    incoming = c.receiving_parts(slab_rows())
    # the store reports one value's pieces but the rows end up holding another's: never passes
    receive(incoming, value[:128] + bytes(PAYLOAD) + value[128 + PAYLOAD :], 4096)
    receive(incoming, value, 4096, report=False)
    assert c.check(KEY, len(value), incoming) is not None


@pytest.mark.parametrize("is_keyed", [False, True])
def test_a_store_that_reports_nothing_is_checked_from_the_buffers(is_keyed):
    c = codec(is_keyed)
    value = packed(c)
    incoming = c.receiving_parts(slab_rows())
    receive(incoming, value, 4096, report=False)
    # no digest → the buffers are hashed: the value passes...
    assert incoming.num_received == 0 and c.check(KEY, len(value), incoming) is None
    # ...and a flipped payload byte in them is refused
    incoming[2].cast("B")[0] ^= 0xFF
    assert c.check(KEY, len(value), incoming) is not None


def test_a_value_cut_short_mid_receive_is_not_trusted_by_its_digest():
    c = codec(False)
    value = packed(c)
    incoming = c.receiving_parts(slab_rows())
    # half the payload reported; the rest of the rows hold zeros: the digest covers half a value,
    # so `check` hashes the rows (wrong bytes) and refuses
    receive(incoming, value, 1000, upto=128 + PAYLOAD // 2)
    assert incoming.num_received < c.value_bytes
    assert c.check(KEY, c.value_bytes, incoming) == "payload checksum mismatch"


def _serve(
    sock: socket.socket, reply: bytes, piece_bytes: int, close_after: int | None = None
) -> None:
    """A "server" sending `reply` in pieces (closing after `close_after` bytes when given)."""
    end = len(reply) if close_after is None else close_after
    for start in range(0, end, piece_bytes):
        sock.sendall(reply[start : min(start + piece_bytes, end)])
    if close_after is not None:
        sock.close()


class _FakeConnection:
    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.host, self.port = sock, "fake", 0


@pytest.mark.parametrize("is_keyed", [False, True])
def test_read_replies_hashes_each_piece_it_receives(is_keyed):
    c = codec(is_keyed)
    value = packed(c)
    ours, theirs = socket.socketpair()
    ours.settimeout(HANG_S)
    try:
        reply = b"$%d\r\n%s\r\n" % (len(value), value)
        sender = threading.Thread(target=_serve, args=(theirs, reply, 777))
        sender.start()
        incoming = c.receiving_parts(slab_rows())
        assert read_replies(_FakeConnection(ours), 1, [incoming]) == [len(value)]
        sender.join()
        assert incoming.num_received == len(value) and c.check(KEY, len(value), incoming) is None
    finally:
        ours.close()
        theirs.close()


def test_read_replies_of_a_value_cut_short_raises_and_its_digest_is_partial():
    c = codec(False)
    value = packed(c)
    ours, theirs = socket.socketpair()
    ours.settimeout(HANG_S)
    try:
        reply = b"$%d\r\n%s\r\n" % (len(value), value)
        sender = threading.Thread(target=_serve, args=(theirs, reply, 1000, 6 + len(value) // 2))
        sender.start()
        incoming = c.receiving_parts(slab_rows())
        # the server goes away mid-value: the call fails (the tier fails the whole job)...
        with pytest.raises(RedisConnectionError, match="closed"):
            read_replies(_FakeConnection(ours), 1, [incoming])
        sender.join()
        # ...and what was reported is not the whole value, so no digest of it would be trusted
        assert 0 < incoming.num_received < len(value)
    finally:
        ours.close()
