"""kvpool.bench.te: one-sided reads between two real processes over loopback TCP with Mooncake's transfer engine."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import IN_CI, wait_for

from kvpool.bench import te
from kvpool.errors import BadRequest, Unavailable

KiB, MiB = 1 << 10, 1 << 20
PEER_BYTES = 48 * MiB
SEED = 1234

# The peer: registers a buffer of known bytes, prints its session and address, and serves until stdin closes.
PEER = f"""
import sys
import numpy as np
from kvpool.bench.te import TransferEngine
buf = np.random.default_rng({SEED}).integers(0, 256, {PEER_BYTES}, dtype=np.uint8)
engine = TransferEngine()
print(engine.session, engine.register(buf), flush=True)
sys.stdin.read()
engine.close()
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_engine():
    if not te.available():
        if IN_CI:
            pytest.fail(f"Mooncake's transfer engine is missing; this machine kind has it after `make venv`: "
                        f"{te.load_error()}")
        pytest.skip(te.load_error())


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().split()
        assert len(line) == 2, f"the peer did not start (exit {self.proc.poll()})"
        self.session, self.addr = line[0], int(line[1])

    def kill(self, sig=signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def expected():
    return np.random.default_rng(SEED).integers(0, 256, PEER_BYTES, dtype=np.uint8)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def engine():
    e = te.TransferEngine()
    dst = np.zeros(40 * MiB, np.uint8)
    e.register(dst)
    e.dst = dst
    yield e
    e.close()


def test_256k_and_32m_reads_are_byte_exact(engine, peer, expected):
    for offset, n in [(0, 256 * KiB), (12345, 256 * KiB), (4 * MiB + 7, 32 * MiB)]:
        dst = engine.dst[MiB:MiB + n]
        dst[:] = 0
        engine.read(peer.session, peer.addr + offset, dst)
        assert np.array_equal(dst, expected[offset:offset + n])


def test_batched_read_of_several_chunks(engine, peer, expected):
    offsets = [3 * MiB, 0, 40 * MiB + 11, 17 * MiB]
    sizes = [256 * KiB, 1 * MiB, 64 * KiB + 3, 4 * MiB]
    dsts, at = [], 0
    for n in sizes:
        dsts.append(engine.dst[at:at + n])
        at += n + 4096
    for d in dsts:
        d[:] = 0
    engine.read_many(peer.session, [peer.addr + o for o in offsets], dsts)
    for o, n, d in zip(offsets, sizes, dsts):
        assert np.array_equal(d, expected[o:o + n])


def test_reads_from_several_threads(engine, peer, expected):
    import concurrent.futures as cf

    def one(k: int) -> bool:
        d = engine.dst[k * MiB:k * MiB + 256 * KiB]
        off = k * 3 * MiB + 5
        for _ in range(10):
            engine.read(peer.session, peer.addr + off, d)
            if not np.array_equal(d, expected[off:off + 256 * KiB]):
                return False
        return True

    with cf.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(one, range(8)))


def test_reading_outside_registered_memory_fails_cleanly(engine, peer, expected):
    # past the end of the peer's buffer: the peer refuses it, quickly
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as err:
        engine.read(peer.session, peer.addr + PEER_BYTES - 100, engine.dst[:4096])
    assert err.value.status == 503 and time.monotonic() - t0 < 2
    # into local memory that was never registered: refused before Mooncake is called
    with pytest.raises(BadRequest, match="not inside memory registered"):
        engine.read(peer.session, peer.addr, np.zeros(4096, np.uint8))
    with pytest.raises(BadRequest, match="not inside memory registered"):  # straddles the end of a region
        engine.read(peer.session, peer.addr, np.zeros(80 * MiB, np.uint8)[:4096])
    with pytest.raises(BadRequest):
        engine.read(peer.session, peer.addr, engine.dst[:4096].view(np.int32))
    # and the engine still works
    engine.read(peer.session, peer.addr, engine.dst[:4096])
    assert np.array_equal(engine.dst[:4096], expected[:4096])


def test_a_sigkilled_peer_fails_with_unavailable_quickly(engine, expected):
    p = Peer()
    try:
        engine.read(p.session, p.addr, engine.dst[:4096])
        assert np.array_equal(engine.dst[:4096], expected[:4096])
        p.kill()
        p.proc.wait(10)
        for call in (lambda: engine.read(p.session, p.addr, engine.dst[:256 * KiB]),
                     lambda: engine.read_many(p.session, [p.addr], [engine.dst[:4096]]),
                     lambda: engine.read(p.session, p.addr, engine.dst[:4096])):
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                call()
            assert time.monotonic() - t0 < 3.0
    finally:
        p.stop()


def test_a_hung_peer_fails_with_unavailable_within_the_bounds(engine, expected):
    p = Peer()
    try:
        # hung before first contact: the handshake probe gives up after connect_timeout_s (Mooncake would wait 60 s)
        p.kill(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="handshake"):
            engine.read(p.session, p.addr, engine.dst[:4096])
        assert time.monotonic() - t0 < engine.connect_timeout_s + 1
        # while that probe is stuck, other peers are still read at once
        other = Peer()
        try:
            t0 = time.monotonic()
            engine.read(other.session, other.addr, engine.dst[:4096])
            assert time.monotonic() - t0 < 1 and np.array_equal(engine.dst[:4096], expected[:4096])
            # hung after contact: Mooncake's own transfer timeout (MC_TRANSFER_TIMEOUT, set to 5 s) ends the read.
            # Or the read is served without the stopped process (seen once in CI: a stopped process's registered
            # memory stays readable); then the bytes must be right. Either way: bounded, never wrong bytes.
            other.kill(signal.SIGSTOP)
            dst = engine.dst[:256 * KiB]
            dst[:] = 0
            t0 = time.monotonic()
            try:
                engine.read(other.session, other.addr + 5, dst)
                assert np.array_equal(dst, expected[5:5 + 256 * KiB]), "a read from a stopped peer returned wrong bytes"
            except Unavailable:
                pass
            assert time.monotonic() - t0 < te.TRANSFER_TIMEOUT_S + 2
            # the peer comes back: reads work again
            other.kill(signal.SIGCONT)
            wait_for(lambda: _reads(engine, other, expected), 15, 0.5, "reads from the resumed peer",
                     ignore=(Unavailable,))
        finally:
            other.stop()
    finally:
        p.stop()


def _reads(engine, peer, expected) -> bool:
    engine.read(peer.session, peer.addr + 99, engine.dst[:256 * KiB])
    return np.array_equal(engine.dst[:256 * KiB], expected[99:99 + 256 * KiB])


def test_close_unregisters_and_refuses_later_calls(peer):
    e = te.TransferEngine()
    buf = np.zeros(MiB, np.uint8)
    assert e.register(buf) == buf.ctypes.data
    with pytest.raises(BadRequest, match="overlaps"):
        e.register(buf[4096:8192])
    e.close()
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.read(peer.session, peer.addr, buf[:10])
