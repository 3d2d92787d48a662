"""Mooncake's Transfer Engine behind a small Ray-free wrapper: one-sided reads of another process's registered memory.

A process makes one ``TransferEngine``, ``register()``s the numpy buffers that peers may read (a view of an mmap'd
/dev/shm slab, say) and the buffers it reads into, and publishes ``session`` and the addresses ``register()``
returned. A peer then ``read()``s bytes straight out of that memory: no call into the owner's Python code.

Set-up: ``pip install -e '.[peers]'`` brings the wheel (``mooncake-transfer-engine-non-cuda``); its ``engine.so``
links libibverbs and libnl even for TCP, which a machine without RDMA packages lacks and a user without root cannot
apt-get install. ``make venv`` extracts those .debs into ``<venv>/mooncake-sysroot`` (or
``$KVPOOL_MOONCAKE_SYSROOT``); ``preload()`` loads them RTLD_GLOBAL in dependency order before the import, so no
LD_LIBRARY_PATH is needed. Transport: TCP, peers found by Mooncake's P2P handshake (no metadata server).

Measured behaviour of mooncake-transfer-engine-non-cuda 0.3.13.post1 (two processes over loopback):

- Threads: Mooncake's Python engine releases the GIL during transfers and keeps its per-peer handles under its own
  mutex; 8 threads x 50 reads of 256 KiB on one engine all came back byte-exact. So ``read`` takes no lock of ours
  (our lock guards only our own tables), and reads from several threads overlap. Each synchronous call busy-polls
  one core while it waits.
- A SIGKILLed peer: its reads fail at once (0.1-0.4 ms, "End of file"); a batched read up to ~1 s (Mooncake retries
  the connection once). A peer that hangs (SIGSTOP) once contacted: the read fails after ``MC_TRANSFER_TIMEOUT``
  seconds (+1 ns per byte); Mooncake's default is 30 s and its floor 5 s, and this module sets 5 unless the variable
  is set. A peer that hangs at *first contact*: Mooncake's handshake waits 60 s (not configurable), holding the
  mutex every transfer of that engine needs. So the first read from a peer (and the first after a failure) is
  preceded by a 1-byte probe through a separate engine, in a thread joined with ``connect_timeout_s``: a hung peer
  costs that long and the probe's scratch byte, never the caller's buffer or the main engine's lock; until the stuck
  probe returns (<= 60 s), reads from that peer fail at once.
  Measured through this wrapper: SIGKILLed peer 0.4-8 ms; SIGSTOPped before first contact 3.0 s, then at once;
  SIGSTOPped after contact 5.0 s, then 3.0 s (the probe), then at once; a resumed peer is read again.
- Bounds: a peer address outside the peer's registered memory is refused by the peer (fails at once); a local
  buffer outside registered memory is not checked by Mooncake's TCP transport, so ``read`` checks it.

A failed transfer is ``Unavailable`` (503) with Mooncake's return code; Mooncake returns -1 for every failure (dead,
hung, or an address the peer refused), so the message names all three.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from kvpool.errors import BadRequest, Unavailable

SYSROOT_ENV = "KVPOOL_MOONCAKE_SYSROOT"
# In dependency order: libibverbs needs both libnl, librdmacm needs libibverbs.
_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1", "librdmacm.so.1")
_FIX = ("run `make venv` (installs the `peers` extra and extracts libibverbs/libnl into .venv/mooncake-sysroot), "
        "or `pip install -e '.[peers]'` and `apt-get install libibverbs1 librdmacm1`")
TRANSFER_TIMEOUT_S = 5  # MC_TRANSFER_TIMEOUT unless set; Mooncake's floor (its default is 30)

_load_lock = threading.Lock()
_module = None
_error: str | None = None
_abandoned: list = []  # probe engines whose handshake was still stuck at close(): never destroyed under a call


def sysroot() -> str:
    """Where ``make venv`` extracted the shared libraries Mooncake links (``$KVPOOL_MOONCAKE_SYSROOT`` wins)."""
    return os.environ.get(SYSROOT_ENV) or os.path.join(sys.prefix, "mooncake-sysroot")


def _find_lib(root: str, name: str) -> str | None:
    for sub in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib"):
        path = os.path.join(root, sub, name)
        if os.path.exists(path):
            return path
    for dirpath, _, files in os.walk(root):
        if name in files:
            return os.path.join(dirpath, name)
    return None


def _system_has_verbs() -> bool:
    try:
        ctypes.CDLL("libibverbs.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    return True


def preload():
    """Loads the sysroot's libraries (when the system lacks libibverbs) and imports ``mooncake.engine``; returns the
    module. An ImportError names the fix; the outcome is cached."""
    global _module, _error
    with _load_lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise ImportError(_error)
        root = sysroot()
        try:
            if not _system_has_verbs():
                if not os.path.isdir(root):
                    raise ImportError(f"libibverbs.so.1 is not installed and there is no {root}")
                for name in _LIBS:
                    path = _find_lib(root, name)
                    if path is None:
                        raise ImportError(f"{name} is missing from {root}")
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            import mooncake.engine as engine
        except (ImportError, OSError) as e:
            if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("mooncake"):
                what = "the mooncake-transfer-engine-non-cuda wheel is not installed"
            else:
                what = f"Mooncake's transfer engine does not load ({e})"
            _error = f"{what}: {_FIX}"
            raise ImportError(_error) from e
        _module = engine
        return engine


def available() -> bool:
    """Whether Mooncake's transfer engine imports here (``load_error()`` says why not)."""
    try:
        preload()
    except ImportError:
        return False
    return True


def load_error() -> str:
    """Why ``available()`` is False, with the fix; "" when it is True."""
    return "" if available() else (_error or "")


def _new_engine(host: str):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # keeps Mooncake's TCP listeners on this address
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(TRANSFER_TIMEOUT_S))  # read when an engine is made
    te = preload().TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise Unavailable(f"Mooncake's transfer engine did not start on {host} (initialize returned {rc})")
    return te


def _flat_u8(buf: np.ndarray, what: str) -> int:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise BadRequest(f"{what} must be a contiguous 1-D uint8 numpy array (a view of the buffer: buf.view(np.uint8))")
    return buf.ctypes.data


class TransferEngine:
    """One process's end of Mooncake's engine: registered memory, its ``session`` name, and one-sided reads."""

    def __init__(self, host: str = "127.0.0.1", connect_timeout_s: float = 3.0) -> None:
        self.host = host
        self.connect_timeout_s = connect_timeout_s
        self._te = _new_engine(host)
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted bases of registered regions
        self._regions: dict[int, np.ndarray] = {}  # base -> the array (kept alive while registered)
        self._contacted: set[str] = set()  # peers whose handshake with self._te succeeded
        self._probe: tuple[object, np.ndarray] | None = None  # (engine, its 1-byte scratch buffer)
        self._hung: dict[str, tuple[threading.Thread, tuple]] = {}  # peer -> a probe stuck in its handshake
        self._retired: list[tuple] = []  # probe engines whose stuck call ended, destroyed at close() (takes ~1 s)

    # -- memory ---------------------------------------------------------------------------------------------------

    def register(self, buf: np.ndarray) -> int:
        """Registers ``buf`` (contiguous uint8) for peers to read and for reads into it; its base address."""
        self._check_open()
        base = _flat_u8(buf, "a registered buffer")
        end = base + buf.nbytes
        if buf.nbytes == 0:
            raise BadRequest("cannot register an empty buffer")
        with self._lock:
            i = bisect.bisect_right(self._starts, base)
            prev = self._regions[self._starts[i - 1]] if i else None
            if (prev is not None and prev.ctypes.data + prev.nbytes > base) or (
                    i < len(self._starts) and self._starts[i] < end):
                raise BadRequest("buffer overlaps memory already registered with this engine")
            rc = self._te.register_memory(base, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake refused to register {buf.nbytes} B at {base:#x} (returned {rc})")
            self._starts.insert(i, base)
            self._regions[base] = buf
        return base

    def unregister(self, buf: np.ndarray) -> None:
        """Unregisters a buffer ``register()`` took; no read into or out of it may be in flight."""
        self._check_open()
        base = _flat_u8(buf, "a registered buffer")
        with self._lock:
            if base not in self._regions:
                raise BadRequest(f"no buffer registered at {base:#x}")
            del self._regions[base]
            self._starts.remove(base)
            self._te.unregister_memory(base)

    def _check_dst(self, dst: np.ndarray) -> int:
        self._check_open()
        addr = _flat_u8(dst, "dst")
        if not dst.flags.writeable:
            raise BadRequest("dst is read-only")
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            region = self._regions[self._starts[i - 1]] if i else None
        if region is None or addr + dst.nbytes > region.ctypes.data + region.nbytes:
            raise BadRequest(f"dst ({dst.nbytes} B at {addr:#x}) is not inside memory registered with this engine: "
                             "register() the buffer it views first")
        return addr

    # -- reads ------------------------------------------------------------------------------------------------------

    def read(self, peer_session: str, peer_addr: int, dst: np.ndarray) -> None:
        """Reads ``len(dst)`` bytes at ``peer_addr`` of the peer's registered memory into ``dst`` (inside memory
        registered here). Bounded: ``connect_timeout_s`` on first contact, then MC_TRANSFER_TIMEOUT (5 s) plus 1 ns
        per byte; a failure is ``Unavailable``."""
        addr = self._check_dst(dst)
        if dst.nbytes == 0:
            return
        self._contact(peer_session, peer_addr)
        rc = self._te.transfer_sync_read(peer_session, addr, int(peer_addr), dst.nbytes)
        if rc != 0:
            self._failed(peer_session, rc, f"{dst.nbytes} B at {int(peer_addr):#x}")

    def read_many(self, peer_session: str, peer_addrs: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
        """``read`` of several chunks of one peer in one batched call (all or nothing: a failure is Unavailable and
        any ``dst`` may hold partial bytes)."""
        if len(peer_addrs) != len(dsts):
            raise BadRequest(f"{len(peer_addrs)} peer addresses for {len(dsts)} destinations")
        addrs = [self._check_dst(d) for d in dsts]
        keep = [i for i, d in enumerate(dsts) if d.nbytes]
        if not keep:
            return
        peers = [int(peer_addrs[i]) for i in keep]
        self._contact(peer_session, peers[0])
        rc = self._te.batch_transfer_sync_read(peer_session, [addrs[i] for i in keep], peers,
                                               [dsts[i].nbytes for i in keep])
        if rc != 0:
            self._failed(peer_session, rc, f"{len(keep)} chunks, {sum(dsts[i].nbytes for i in keep)} B")

    def _failed(self, peer_session: str, rc: int, what: str) -> None:
        with self._lock:
            self._contacted.discard(peer_session)  # the next read probes again before touching self._te
        raise Unavailable(f"read of {what} from {peer_session} failed (Mooncake returned {rc}): the peer is dead, hung, "
                          "or the address is outside its registered memory")

    def _contact(self, peer_session: str, peer_addr: int) -> None:
        """Before the first read from a peer: a 1-byte read through a separate engine, bounded by a thread join, so a
        peer that hangs in Mooncake's 60 s handshake never blocks this engine."""
        with self._lock:
            if peer_session in self._contacted:
                return
            stuck = self._hung.get(peer_session)
            if stuck is not None and stuck[0].is_alive():
                raise Unavailable(f"{peer_session} did not answer a handshake within {self.connect_timeout_s:g} s "
                                  "(Mooncake is still waiting on it)")
            if self._probe is None:
                scratch = np.zeros(1, np.uint8)
                te = _new_engine(self.host)
                te.register_memory(scratch.ctypes.data, 1)
                self._probe = (te, scratch)
            probe = self._probe
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(
            probe[0].transfer_sync_read(peer_session, probe[1].ctypes.data, int(peer_addr), 1)),
            name=f"kvpool-te-probe-{peer_session}", daemon=True)
        thread.start()
        thread.join(self.connect_timeout_s)
        with self._lock:
            if thread.is_alive():
                # The stuck thread keeps that engine alive until Mooncake gives up; later probes use a new one.
                if self._probe is probe:
                    self._probe = None
                self._hung[peer_session] = (thread, probe)
                raise Unavailable(f"{peer_session} did not answer a handshake within {self.connect_timeout_s:g} s")
            done = self._hung.pop(peer_session, None)
            if done is not None:
                self._retired.append(done[1])
            if result[0] != 0:
                raise Unavailable(f"cannot reach {peer_session} (Mooncake returned {result[0]}): the peer is dead, or "
                                  f"{int(peer_addr):#x} is outside its registered memory")
            self._contacted.add(peer_session)

    # -- life -------------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._te is None:
            raise RuntimeError("this TransferEngine is closed")

    def close(self) -> None:
        """Unregisters everything and stops the engine and its probe engine; idempotent. No read may be in flight.
        Takes about 1 s per engine, holding the GIL (Mooncake's destructor), so a long-lived process closes once."""
        with self._lock:
            te, probe, self._te, self._probe = self._te, self._probe, None, None
            bases = list(self._starts)
            self._starts.clear()
            self._regions.clear()
            self._contacted.clear()
            retired = self._retired + [p for t, p in self._hung.values() if not t.is_alive()]
            _abandoned.extend((t, p) for t, p in self._hung.values() if t.is_alive())
            self._retired, self._hung = [], {}
        if te is not None:
            for base in bases:
                te.unregister_memory(base)
        if probe is not None:
            retired.append(probe)
        del te, probe, retired

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
