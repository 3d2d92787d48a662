"""vLLM's KV events, read into an instance's :class:`~kvpool.connectors.route.gpu.GpuView`.

Where they come from is asked of the instance itself: ``GET /kv_event_sources`` answers vLLM's
``--kv-events-config`` per data-parallel rank. An endpoint vLLM binds (``tcp://*:5557``,
``ipc://...``) is connected to, at the instance's host; one vLLM connects to (``tcp://HOST:PORT``)
is bound here, so several instances may publish to a router that listens. Frames are vLLM's:
``[topic, sequence number (8 bytes, big-endian), msgpack batch [ts, events, dp rank]]``.

When the instance has a replay endpoint (``replay_endpoint`` in its ``--kv-events-config``), a new
subscription first asks it for every batch it still holds (vLLM keeps the last ``buffer_steps``
steps' batches), so a router that starts or restarts after the instance knows the instance's cache
at once, not only what changes from then on. A gap in the sequence, or a sequence that starts over
(the instance restarted), clears the view: what follows rebuilds it.

A frame that does not decode, or holds an event that is not one of vLLM's
(:func:`~kvpool.connectors.route.gpu.malformed`: wrong types anywhere), is counted in
``bad_frames`` and dropped whole; nothing of it is applied and its sequence number is not taken,
so a forged frame changes nothing and a garbled real one reads as a gap. No frame ends the feed:
only :meth:`EventFeed.close` does. (The events port is not authenticated: anyone who reaches it
can mislead the router's locality, never an answer; and its frames carry each request's
``cache_salt``, so publish them only where the router alone listens: see docs/security.md.)
``figures()`` is the feed's health: alive, frames, bad frames, gaps, the last frame's age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import msgpack

from kvpool.connectors.route.gpu import GpuView, malformed
from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.route")

MAX_FRAME = 64 << 20  # bytes: a larger frame is refused by the socket itself
REPLAY_TIMEOUT_S = 5.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay


def subscribe_address(endpoint: str, instance_url: str) -> tuple[str, bool]:
    """(the address to subscribe at, whether to bind it) for one of vLLM's endpoints."""
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise BadRequest(f"KV events endpoint {endpoint!r}: not a ZMQ address (tcp://HOST:PORT, ipc://PATH)")
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint, False
    host = urlsplit(instance_url).hostname or "127.0.0.1"
    if "*" in endpoint or "[::]" in endpoint or "0.0.0.0" in endpoint:  # vLLM binds every interface
        for wild in ("*", "[::]", "0.0.0.0"):
            endpoint = endpoint.replace(wild, f"[{host}]" if ":" in host else host)
        return endpoint, False
    return endpoint, True  # vLLM connects to it: the router listens there


class EventFeed:
    """One instance's subscriptions (one per data-parallel rank), applied to ``view`` until closed."""

    def __init__(self, view: GpuView, name: str, addresses: list[tuple[str, bool]], topic: str = "",
                 replays: list[str | None] | None = None) -> None:
        import zmq
        import zmq.asyncio

        self.view, self.name = view, name
        self.gaps = self.bad = self.batches = self.replayed = self.frames = 0
        self.last_frame: float | None = None  # time.monotonic() of the last frame received
        self._replays = replays or [None] * len(addresses)
        self._ctx = zmq.asyncio.Context.instance()
        self._socks, self._tasks = [], []
        for address, bind in addresses:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            (s.bind if bind else s.connect)(address)
            self._socks.append(s)
        self.addresses = [a for a, _ in addresses]
        self._last: list[int | None] = [None] * len(addresses)  # per socket: its last sequence number taken
        self._replayed: list[tuple[int, int] | None] = [None] * len(addresses)  # per socket: what its replay gave

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._read(i, s, r))
                       for i, (s, r) in enumerate(zip(self._socks, self._replays))]

    def _decode(self, seq_bytes: bytes, payload: bytes) -> tuple[int, list] | None:
        """(sequence number, events) of a well-formed batch, else None, counted in ``bad``."""
        try:
            seq = int.from_bytes(seq_bytes, "big")
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) >= 2 else None
            ok = isinstance(events, list) and all(malformed(e) is None for e in events)
        except Exception:  # noqa: BLE001 - whatever a forged payload makes msgpack raise: a bad frame
            ok = False
        if not ok:
            self.bad += 1
            return None
        return seq, events

    def _apply(self, events: list) -> None:
        self.batches += 1
        for e in events:
            self.view.apply(e)

    async def _replay(self, address: str) -> tuple[int, int] | None:
        """Every batch the instance still holds, applied in order; the first and last one's sequence
        numbers (None: none, or no answer within ``REPLAY_TIMEOUT_S``, and nothing applied)."""
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, list]] = []
        try:
            sock.connect(address)
            await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                one = self._decode(frames[2], frames[3])
                if one is not None:
                    got.append(one)
        except (asyncio.TimeoutError, zmq.ZMQError) as e:
            log.warning("kvpool route: %s's KV events replay at %s did not answer (%s): its GPU cache view starts "
                        "from the next events", self.name, address, e or type(e).__name__)
            return None
        finally:
            sock.close(linger=0)
        for _, events in got:
            self._apply(events)
        self.replayed = len(got)
        return (got[0][0], got[-1][0]) if got else None

    async def _read(self, i: int, sock, replay: str | None) -> None:
        replayed = self._replayed[i] = await self._replay(replay) if replay else None
        self._last[i] = None if replayed is None else replayed[1]
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a closed socket ends the feed
                log.debug("kvpool route: events of %s ended (%s)", self.name, e)
                return
            try:
                self.on_frame(frames, i)
            except Exception as e:  # noqa: BLE001 - no frame ends the feed (a bug here is logged and counted)
                self.bad += 1
                log.warning("kvpool route: a KV events frame of %s was dropped (%s: %s)", self.name,
                            type(e).__name__, e)

    def on_frame(self, frames: list, i: int = 0) -> None:
        """One frame as received on socket ``i`` (``[topic, sequence number, payload]``), applied
        or counted bad."""
        self.frames += 1
        self.last_frame = time.monotonic()
        one = self._decode(frames[1], frames[2]) if len(frames) == 3 else None
        if one is None:
            if len(frames) != 3:
                self.bad += 1
            return
        seq, events = one
        replayed = self._replayed[i]
        if replayed is not None and replayed[0] <= seq <= replayed[1]:
            return  # published while the replay ran: applied from it already
        last = self._last[i]
        if last is not None and seq != last + 1:
            self.gaps += 1
            log.warning("kvpool route: %s's KV events jumped from %d to %d (lost, or the instance restarted): "
                        "its GPU cache view starts over", self.name, last, seq)
            self.view.clear()
        self._last[i] = seq
        self._apply(events)

    @property
    def alive(self) -> bool:
        """Subscribed, and every reader still reading."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self._socks:
            s.close(linger=0)
        self._tasks, self._socks = [], []

    def figures(self) -> dict:
        age = None if self.last_frame is None else time.monotonic() - self.last_frame
        return {"addresses": self.addresses, "alive": self.alive, "frames": self.frames, "batches": self.batches,
                "replayed": self.replayed, "gaps": self.gaps, "bad_frames": self.bad, "last_frame_age_s": age,
                "overflows": self.view.overflows}
