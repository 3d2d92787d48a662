"""RedisIndex.reconcile: the index made to say what a shard's store holds.

What the index has is read from the chunk entries themselves (MGET in batches), never from the
shard's own key set: anything that writes Redis can delete an entry and leave the set as it was,
and a reconcile that trusted the set would never republish it. Then the shard's part of its
tenants' usage is set from the entries found, and every tenant's usage from the shards' parts
(redis_lua.SETTLE, one atomic script), before what is missing is republished: a forged or stale
counter heals, and the republished entries are charged against what is really indexed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvpool.errors import BadRequest
from kvpool.index import base as checks
from kvpool.index.base import IndexEntry, ReconcileResult

log = logging.getLogger("kvpool.index")
BATCH = 512  # keys per MGET: one round trip each, none long enough to hold up the server


def reconcile(idx, shard: str, held: Sequence[IndexEntry]) -> ReconcileResult:
    checks.check_name("shard id", shard)
    held = checks.check_entries(held)
    for e in held:
        if e.shard != shard:
            raise BadRequest(f"reconcile of shard {shard!r} got an entry of shard {e.shard!r}")
    keys, w = idx.keys, idx._w
    # NOTE: read before the scan: a publish charging a tenant on this shard meanwhile moves its
    # count, and SETTLE then never lowers that tenant's part on what the scan may have missed.
    seen = idx._write("reconcile", w.hgetall, keys.shard_charges(shard))
    have = idx.shard_keys(shard)
    stale = sorted(have - {e.key for e in held})
    removed = idx.remove(stale, shard=shard) if stale else 0
    missing: list[IndexEntry] = []
    bad: list[IndexEntry] = []
    relist = []
    found: dict[str, int] = {}
    held = list({e.key: e for e in held}.values())  # a key once: counted once
    for i in range(0, len(held), BATCH):
        batch = held[i : i + BATCH]
        values = idx._write("reconcile", w.mget, [keys.chunk(e.key) for e in batch])
        for e, v in zip(batch, values):
            if v is None:
                missing.append(e)
                continue
            try:
                entry = IndexEntry.decode(e.key, v)
            except BadRequest:
                bad.append(e)
                continue
            if entry.shard == shard:  # else another shard's entry (a replica's primary): its part
                found[entry.tenant] = found.get(entry.tenant, 0) + entry.nbytes
                if e.key not in have:
                    relist.append(bytes(e.key))
    if bad:  # a value that is no entry: removed (whatever it charged is unknown), then republished
        removed += idx.remove([e.key for e in bad], shard=shard)
        missing += bad
    if relist:  # this shard's entries its key set lost: put back, for purge and the next reconcile
        idx._write("reconcile", w.sadd, keys.shard_set(shard), *relist)
    argv: list[object] = [idx._prefix, shard, len(found)]
    for tenant, nbytes in found.items():
        argv += [tenant, nbytes]
    for tenant, count in seen.items():
        argv += [tenant, count]
    parts, usages = idx._write("reconcile", idx._settle, args=argv)
    if parts or usages:  # NOTE: info: a removal racing the scan moves a part too (up; the next one heals it)
        log.info("index at %s: shard %s: usage settled from what is indexed (%d of its tenants' parts and %d "
                 "tenants' totals were off)", idx.url, shard, parts, usages)
    published, refused = idx._republish(missing)
    return ReconcileResult(published, removed, tuple(refused))
