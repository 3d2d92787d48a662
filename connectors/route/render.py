"""Rendering and tokenizing prompts off the router's event loop, each within a deadline.

A chat template is a program (Jinja), and a request's messages and ``chat_template_kwargs`` are
its input: no thread can bound what it costs (a Python thread cannot be stopped, and a sandboxed
template still loops as long as its ranges allow). So prompts are rendered and tokenized by
``workers`` worker processes, each holding the tokenizer (:class:`~.prompts.Prompts`): a render
that runs past ``timeout_s`` gets its request a 400 (:class:`RenderTimeout`) and its worker is
killed and replaced, so its CPU is bounded by the deadline and nothing else waits on it.

Free workers are handed out in turn across tenants (the next tenant that waits, not the next
request), so one tenant's heavy renders cannot hold up another's. A request that finds no worker
free within ``timeout_s`` (all busy, or being replaced), or whose worker dies, is routed on load
alone (``skipped``): it is served, without its prefix's locality. Prompts given as token ids need
no worker. Without a tokenizer there are no workers, and only token-id prompts are scored. The
router's ``/health`` waits for :attr:`Renderers.ready`: its workers load the tokenizer at start
(seconds), and a request sent before would be routed on load alone.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

from kvpool.connectors.route.prompts import Prompts, needs_tokenizer, refused, token_ids
from kvpool.errors import BadRequest

log = logging.getLogger("kvpool.route")

READY_TIMEOUT_S = 300.0  # a worker loading its tokenizer
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


class RenderTimeout(BadRequest):
    """A prompt whose rendering and tokenizing passed the router's deadline."""


def _serve(conn, tokenizer: str) -> None:
    """A worker: loads the tokenizer, says whether it has one, then answers (path, body) pairs."""
    os.nice(5)  # NOTE: below the router's own event loop, which must keep answering
    prompts = Prompts(tokenizer)
    conn.send(("ready", prompts.load()))
    while True:
        try:
            path, raw = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return  # the router closed the pipe (or died)
        conn.send(prompts.tokens_of(path, raw))


class _Worker:
    def __init__(self, tokenizer: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # NOTE: no fork of a process with an event loop and threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, tokenizer), daemon=True, name="kvpool-route-render")
        self.proc.start()
        child.close()

    def ready(self) -> bool | None:
        """Whether it has a tokenizer, once loaded; None: it died or took too long."""
        try:
            if self.conn.poll(READY_TIMEOUT_S):
                return bool(self.conn.recv()[1])
        except (EOFError, OSError):
            pass
        return None

    def call(self, path: str, raw: bytes, timeout_s: float) -> tuple[str, object]:
        self.conn.send((path, raw))
        if not self.conn.poll(timeout_s):
            raise TimeoutError
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class Renderers:
    def __init__(self, tokenizer: str | None, workers: int = 2, timeout_s: float = 5.0) -> None:
        if workers < 1 or not timeout_s > 0:
            raise BadRequest(f"--render-workers {workers}, --render-timeout {timeout_s}: at least one worker and a "
                             "positive number of seconds")
        self.path, self.workers, self.timeout_s = tokenizer, workers, timeout_s
        self.has_tokenizer = tokenizer is not None  # until a worker says it found none
        self.timeouts = self.skipped = 0
        self._idle: list[_Worker] = []
        self._waiting: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # tenant -> its requests waiting
        self._threads = ThreadPoolExecutor(2 * workers, thread_name_prefix="kvpool-route-render")
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._starting = 0  # workers loading their tokenizer
        self._ever_ready = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.path is not None and os.path.isdir(self.path) and \
                not any(os.path.exists(os.path.join(self.path, f)) for f in TOKENIZER_FILES):
            self.has_tokenizer = False  # NOTE: no process is started to find that out
            log.warning("kvpool route: no tokenizer in %s: text prompts and chat messages are routed on load alone; "
                        "pass --tokenizer with the served model's", self.path)
        if self.path is not None and self.has_tokenizer:
            for _ in range(self.workers):
                self._spawn()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all)
        for w in workers:
            w.kill()
        self._threads.shutdown(wait=False)

    @property
    def ready(self) -> bool:
        """Whether prompts are rendered yet: a worker has held the tokenizer, or none is still
        loading it (none there, or none started)."""
        return self._ever_ready or not self._starting

    def _spawn(self) -> None:
        """A new worker, handed out once its tokenizer is loaded (waited for in a thread)."""
        def bring_up() -> None:
            try:
                w = _Worker(self.path)
                with self._lock:
                    self._all.add(w)
                ok = w.ready()
                if ok is None or self._closed:
                    self._retire(w)
                    if not self._closed:
                        log.warning("kvpool route: a render worker did not start; text prompts are routed on load")
                    return
                if not ok:
                    self.has_tokenizer = False
                self._ever_ready = True
                self._loop.call_soon_threadsafe(self._give, w)
            finally:
                with self._lock:
                    self._starting -= 1

        with self._lock:
            self._starting += 1
        self._threads.submit(bring_up)

    def _retire(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
        w.kill()

    def _give(self, w: _Worker) -> None:
        self._idle.append(w)
        self._dispatch()

    def _dispatch(self) -> None:
        """Free workers to the tenants waiting, one request of each in turn."""
        while self._idle and self._waiting:
            tenant, queue = next(iter(self._waiting.items()))
            while queue and queue[0].done():  # gave up waiting
                queue.popleft()
            if queue:
                queue.popleft().set_result(self._idle.pop())
            if queue:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]

    async def _take(self, tenant: str) -> _Worker | None:
        """A free worker, in this tenant's turn; None when none came within the deadline."""
        fut = self._loop.create_future()
        self._waiting.setdefault(tenant, deque()).append(fut)
        self._dispatch()
        if fut.done():
            return fut.result()
        timer = self._loop.call_later(self.timeout_s, lambda: fut.done() or fut.set_result(None))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is not None:
                self._give(fut.result())  # handed a worker as the request went away
            raise
        finally:
            timer.cancel()

    def _after(self, w: _Worker, f) -> None:
        """A call ended: the worker goes back (also when the call never started), or is replaced
        when it timed out or died."""
        if self._closed:
            return
        if f.cancelled() or f.exception() is None:
            self._loop.call_soon_threadsafe(self._give, w)
        else:
            self._threads.submit(self._replace, w)

    def _replace(self, w: _Worker) -> None:
        self._retire(w)
        if not self._closed:
            self._spawn()

    async def tokens(self, tenant: str, path: str, raw: bytes, body: dict) -> list[int] | None:
        """The prompt's tokens (None: routed on load); BadRequest for a request vLLM refuses, or
        :class:`RenderTimeout` for one whose rendering passed the deadline."""
        why = refused(path, body)
        if why:
            raise BadRequest(why)
        ids = token_ids(path, body)
        if ids is not None or not needs_tokenizer(path, body) or not self.has_tokenizer or self.path is None:
            return ids
        w = await self._take(tenant)
        if w is None:
            self.skipped += 1
            return None
        cf = self._threads.submit(w.call, path, raw, self.timeout_s)
        cf.add_done_callback(lambda f: self._after(w, f))
        try:
            kind, value = await asyncio.wrap_future(cf)
        except TimeoutError:
            self.timeouts += 1
            raise RenderTimeout(f"rendering and tokenizing this request's prompt took more than {self.timeout_s:g} s "
                                "(the router's --render-timeout): shorten its messages, tools or chat_template_kwargs"
                                ) from None
        except (EOFError, OSError) as e:
            log.warning("kvpool route: a render worker failed (%s): replaced; this request is routed on load", e)
            self.skipped += 1
            return None
        if kind == "bad":
            raise BadRequest(str(value))
        return value  # type: ignore[return-value]

    def figures(self) -> dict:
        return {"ready": self.ready, "workers": len(self._all), "idle": len(self._idle),
                "waiting": sum(map(len, self._waiting.values())),
                "timeouts": self.timeouts, "skipped": self.skipped, "has_tokenizer": self.has_tokenizer}
