"""What one tenant may hold on a node besides its chunks: staging files (kvpool.node.staging) in the
node's run dir, and engines whose reports the shard passes on to `kvpool stats`.

- **Staging files.** One per connection, of a fixed size, made only for a verified credential and
  charged to its tenant until the connection closes. A tenant's files on this node hold at most
  ``$KVPOOL_STAGE_MIB_PER_TENANT`` MiB (default 64, and always room for two), past that a 429; a
  run dir without room for another is a 507 saying how much room it has, what each file takes and
  how many the shard holds (the engine then writes and reads without one, kvpool.node.connection).
- **Engines reporting.** At most ``MAX_ENGINES_PER_TENANT`` names per tenant on this shard (a name
  is forgotten at its goodbye, or when it has not reported for three of its intervals), past that a
  429: reports cannot grow the shard's or the controller's memory without bound.
- **Requests in flight, their leases, reservations.** What a tenant opens and may never close
  (``begin`` without ``end``, ``reserve`` without ``commit``) is counted per tenant on this shard
  (``OpenCap``): at most ``$KVPOOL_REQUESTS_PER_TENANT`` requests (default 4096), leasing at most
  ``$KVPOOL_LEASES_PER_TENANT`` chunks (default 262144), and ``$KVPOOL_RESERVATIONS_PER_TENANT``
  reservations not yet committed (default 1024); past a cap a 429 naming it. A vLLM server has
  at most its ``--max-num-seqs`` requests in flight, each saving through one reservation at a time.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvpool.errors import BadRequest, LimitExceeded, StagingFull
from kvpool.node.staging import STAGE_BYTES, Stage

log = logging.getLogger("kvpool.shard")
STAGE_TENANT_ENV = "KVPOOL_STAGE_MIB_PER_TENANT"
STAGE_TENANT_MIB = 64
MAX_ENGINES_PER_TENANT = 64
REPORT_TTL_S = 600.0  # a name that reports no interval is forgotten after this long
REQUESTS_ENV, REQUESTS_PER_TENANT = "KVPOOL_REQUESTS_PER_TENANT", 4096
LEASES_ENV, LEASES_PER_TENANT = "KVPOOL_LEASES_PER_TENANT", 262144
RESERVATIONS_ENV, RESERVATIONS_PER_TENANT = "KVPOOL_RESERVATIONS_PER_TENANT", 1024


def stage_bytes(page_bytes: int) -> int:
    """The size of a connection's staging file on a node of ``page_bytes`` pages: two chunks at least."""
    return min(max(STAGE_BYTES, 2 * page_bytes + 4096), 1 << 30)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


class StageRoom:
    """The staging files of a shard's connections, per tenant (``open``, ``close``, ``stats``)."""

    def __init__(self, pool: str, env: dict | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get(STAGE_TENANT_ENV, "")
        try:
            self.per_tenant_mib = float(raw) if raw.strip() else float(STAGE_TENANT_MIB)
        except ValueError:
            raise BadRequest(f"${STAGE_TENANT_ENV}={raw!r}: MiB of staging files a tenant may hold on a node "
                             f"(default {STAGE_TENANT_MIB})") from None
        self.pool = pool
        self.held: dict[str, int] = {}  # tenant -> bytes of its connections' staging files here
        self.files = 0
        self.refused_full = 0  # the run dir had no room
        self.refused_cap = 0  # the tenant's cap was reached
        self.last_refused = ""  # what the latest refusal said (its fix), for `kvpool stats`
        self._lock = threading.Lock()

    def cap(self, nbytes: int) -> int:
        return max(int(self.per_tenant_mib * 2**20), 2 * nbytes)

    def open(self, conn: dict, tenant: str, directory: str, page_bytes: int) -> dict:
        """The connection's staging file, made on its first ask and charged to ``tenant``."""
        if conn.get("stage") is None:
            nbytes = stage_bytes(page_bytes)
            with self._lock:
                if self.held.get(tenant, 0) + nbytes > self.cap(nbytes):
                    self.refused_cap += 1
                    raise self._refused(LimitExceeded(
                        f"tenant {tenant!r} holds {_mib(self.held[tenant])} of staging files on this node (one per "
                        f"connection, {_mib(nbytes)} each), its cap: close idle connections, or raise "
                        f"${STAGE_TENANT_ENV} on the shards (now {self.per_tenant_mib:g})"))
                self.held[tenant] = self.held.get(tenant, 0) + nbytes  # charged first: two asks cannot both pass
                self.files += 1
            try:
                stage = self._create(directory, nbytes)
            except BaseException:
                self._release(tenant, nbytes)
                raise
            conn["stage"], conn["stage_tenant"] = stage, tenant
        return {"path": conn["stage"].path, "nbytes": conn["stage"].nbytes}

    def _create(self, directory: str, nbytes: int) -> Stage:
        free = _free(directory)
        try:
            if free is not None and free < nbytes:
                raise OSError(28, "No space left on device")
            return Stage.create(directory, self.pool, nbytes)
        except OSError as e:
            if e.errno not in (28, 122, 12):  # ENOSPC, EDQUOT, ENOMEM: no room; anything else is the shard's
                raise
            with self._lock:
                self.refused_full += 1
                files = self.files - 1
            free = _free(directory)
            room = "no" if free is None else _mib(free)
            log.warning("shard: no room in the run dir %s for another staging file (%s free, %s each, %d held)",
                        directory, room, _mib(nbytes), files)
            raise self._refused(StagingFull(
                f"the run dir {directory} has {room} free; each engine connection's staging file takes {_mib(nbytes)} "
                f"and this shard holds {files} of them: give the run dir more room ($KVPOOL_RUN_DIR on a larger "
                "tmpfs, the chart's node.runDir, or a larger /dev/shm) or run fewer engines on this node")) from None

    def _refused(self, e: Exception) -> Exception:
        self.last_refused = str(e)
        return e

    def close(self, conn: dict) -> None:
        """The connection is gone: its file removed, its tenant's charge given back."""
        stage = conn.pop("stage", None)
        if stage is None:
            return
        stage.close()
        self._release(conn.pop("stage_tenant", ""), stage.nbytes)

    def _release(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self.held.get(tenant, 0) - nbytes
            if left > 0:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)
            self.files -= 1

    def stats(self) -> dict:
        with self._lock:
            return {"files": self.files, "bytes": sum(self.held.values()), "by_tenant": dict(self.held),
                    "refused_full": self.refused_full, "refused_cap": self.refused_cap,
                    "per_tenant_mib": self.per_tenant_mib, "last_refused": self.last_refused}


def staging_refused(stats: dict | None) -> str:
    """What `kvpool stats` says of a shard that refused staging files (``StageRoom.stats``), or ""."""
    st = stats or {}
    if not (st.get("refused_full") or st.get("refused_cap")):
        return ""
    return (f"STAGING REFUSED {st['refused_full']}x (run dir full), {st['refused_cap']}x (a tenant's cap); "
            f"{st['files']} files held now; engines write and read without one. Latest: {st['last_refused']}")


def _free(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class EngineNames:
    """The engines a shard passes reports on for, per tenant (``admit``)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._seen: dict[str, dict[str, tuple[float, float]]] = {}  # tenant -> name -> (last seen, ttl)
        self.refused = 0
        self._lock = threading.Lock()

    def admit(self, tenant: str, name: str, figures: dict) -> None:
        """Counts ``name`` as one of ``tenant``'s engines, or 429 past its cap."""
        now = self._clock()
        every = figures.get("every_s")
        ttl = 3 * float(every) if isinstance(every, (int, float)) and not isinstance(every, bool) and every > 0 \
            else REPORT_TTL_S
        with self._lock:
            names = self._seen.setdefault(tenant, {})
            if figures.get("goodbye") is True:
                names.pop(name, None)
                return
            if name not in names and len(names) >= MAX_ENGINES_PER_TENANT:
                for n, (seen, t) in list(names.items()):
                    if now - seen > t:
                        del names[n]
                if len(names) >= MAX_ENGINES_PER_TENANT:
                    self.refused += 1
                    raise LimitExceeded(
                        f"tenant {tenant!r} already reports {len(names)} engines through this shard, its cap: "
                        "a name is forgotten at its goodbye or when it stops reporting; reuse an engine's name "
                        "across its restarts")
            names[name] = (now, min(ttl, REPORT_TTL_S))


class OpenCap:
    """How many of one kind of thing a tenant keeps open on this shard (requests in flight, the
    chunks they lease, reservations), capped per tenant: ``take`` refuses past the cap with a 429
    naming it and changes nothing; ``give`` when one closes, whichever way (end, expiry, drain)."""

    def __init__(self, what: str, env_name: str, default: int, closes: str, env: dict | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get(env_name, "")
        try:
            self.cap = int(raw) if raw.strip() else default
            if self.cap <= 0:
                raise ValueError
        except ValueError:
            raise BadRequest(f"${env_name}={raw!r}: the {what} a tenant may keep open on a shard, a whole number "
                             f"> 0 (default {default})") from None
        self.what, self.env_name, self.closes = what, env_name, closes
        self.held: dict[str, int] = {}
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, tenant: str, n: int = 1) -> None:
        with self._lock:
            now = self.held.get(tenant, 0)
            if now + n > self.cap:
                self.refused += 1
                raise LimitExceeded(
                    f"tenant {tenant!r} holds {now} {self.what} on this shard and asks for {n} more; its cap is "
                    f"{self.cap}: {self.closes}, or raise ${self.env_name} in the shards' environment (`kvpool up`'s "
                    "for a single-node pool, each Ray node's on a cluster)")
            if now + n:
                self.held[tenant] = now + n

    def give(self, tenant: str, n: int = 1) -> None:
        with self._lock:
            left = self.held.get(tenant, 0) - n
            assert left >= 0, (self.what, tenant, left)
            if left:
                self.held[tenant] = left
            else:
                self.held.pop(tenant, None)

    def stats(self) -> dict:
        with self._lock:
            return {"by_tenant": dict(self.held), "cap": self.cap, "refused": self.refused}
