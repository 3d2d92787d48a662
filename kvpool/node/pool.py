"""NodePool: LocalPool's surface (keys, lookup, begin, load, save, end) over this node's shard
(a NodeClient, kvpool.node.client), so the same engine-side code runs on one process or on a
pool of many nodes, with no Ray in the engine."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from kvpool.auth import claimed_tenant, is_credential, namespace_salt
from kvpool.codec import Formats, page_bytes
from kvpool.errors import BadRequest, Unauthorized, UnknownTenant
from kvpool.index.base import PrefixHit
from kvpool.keys import ChunkKey, Namespace, as_keys, is_shared
from kvpool.node.client import NodeClient
from kvpool.pool import OwnedChunk
from kvpool.seal import SEAL_OVERHEAD, Sealer, needs_seal, sealer_for
from kvpool.spec import KVSpec
from kvpool.tenants import Tenant

log = logging.getLogger(__name__)


class NodePool:
    """Every ``tenant`` argument is the tenant's credential on a secured pool (kvpool.auth; the
    shards verify it on every call), its id on an open one."""

    def __init__(self, spec: KVSpec, client: NodeClient, tenants: Sequence[Tenant], *,
                 keyed_as: KVSpec | None = None) -> None:
        self._formats = Formats(spec, self._salt, keyed_as)
        self.codec = self._formats.codec()
        pages = [info.get("page_bytes", 0) for info in client.shards.values()]
        if pages:
            need = page_bytes(spec, [t.storage_format for t in tenants])  # a tenant may store its own format
            for fmt in ("", *(t.storage_format for t in tenants)):
                self._formats.codec(fmt).check_page(min(pages), (
                    f"start the pool for the dtype this engine serves, {spec.dtype} (`kvpool up --model MODEL "
                    f"--dtype {spec.dtype}`: --model alone sizes pages to the checkpoint's own dtype), or with pages "
                    f"of at least {need} B (`kvpool up --page-size {need}`), or use smaller chunks"))
            if min(pages) >= 2 * need:  # a page holds one chunk: the rest of it is idle
                log.warning("the pool's pages hold %d B and a payload of %s (%s %s; a chunk is stored as a slice per "
                            "KV head) takes %d B: pages sized to it (`kvpool up --model MODEL --dtype %s`, or "
                            "--page-size %d) would hold %dx more chunks in the same memory", min(pages),
                            spec.model_id, spec.dtype, spec.storage_format, need, spec.dtype, need,
                            min(pages) // need)
        self.spec = spec
        self.client = client
        self._salts = {t.id: t.salt for t in tenants}
        self._tenants = {t.id: t for t in tenants}
        self._sealers: dict[str, Sealer] = {}
        if pages and any(t.encrypt for t in tenants) and min(pages) < need + SEAL_OVERHEAD:
            raise BadRequest(f"a tenant seals its payloads: start the pool with a page size >= "
                             f"{need + SEAL_OVERHEAD} (the chunk and {SEAL_OVERHEAD} B of seal)")
        self._local = threading.local()  # load_views' reused buffers, per thread

    @property
    def secured(self) -> bool:
        """Asked of the client each time: an engine may start before its node's shard."""
        return self.client.secured

    def _salt(self, credential: str) -> bytes:
        salt = self._check_tenant(credential).salt
        return namespace_salt(credential) + b"/" + salt if is_credential(credential) else salt

    def _check_tenant(self, credential: str) -> Tenant:
        """The tenant the caller names; bad input fails before anything is read or written, as in
        LocalPool (the shards verify the credential itself: this process has no secret)."""
        if not isinstance(credential, str):
            raise BadRequest(f"a tenant is named by its credential (a string), got {type(credential).__name__}")
        if self.secured and not is_credential(credential):
            raise Unauthorized(f"this pool is secured: pass the tenant's credential, not {credential[:64]!r} "
                               "(the operator issues it: kvpool auth issue TENANT)")
        name = claimed_tenant(credential)
        if name not in self._tenants:
            raise UnknownTenant(name)
        return self._tenants[name]

    @staticmethod
    def _format(tenant: Tenant, shared: object) -> str:
        """The storage format of the caller's chunks: its tenant's own, or the spec's (``""``; shared
        keys are always in the spec's)."""
        return "" if shared is True else tenant.storage_format

    def namespace(self, tenant: str, *, shared: bool = False, adapter_id: str = "",
                  extra_keys: Sequence[str | bytes] = ()) -> Namespace:
        return self._formats.maker(self._format(self._check_tenant(tenant), shared)).namespace(
            tenant, shared=shared, adapter_id=adapter_id, extra_keys=extra_keys)

    def keys(self, tenant: str, tokens: object, *, shared: bool = False, adapter_id: str = "",
             extra_keys: Sequence[str | bytes] = ()) -> list[ChunkKey]:
        """The chunk keys of a prompt's whole chunks in the tenant's (or the shared) namespace and format."""
        return self._formats.maker(self._format(self._check_tenant(tenant), shared)).keys(
            tenant, tokens, shared=shared, adapter_id=adapter_id, extra_keys=extra_keys)

    def lookup(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Tokens covered by the leading run of chunks the index lists (one round trip)."""
        self._check_tenant(tenant)
        return self.client.lookup(tenant, as_keys(keys)).count * self.spec.chunk_tokens

    def locate(self, tenant: str, keys: Sequence[ChunkKey]) -> PrefixHit:
        """The leading run of chunks the index lists and the shard holding each (one round trip; a
        router's question); ``error`` is set when the index could not answer."""
        self._check_tenant(tenant)
        return self.client.lookup(tenant, as_keys(keys))

    def begin(self, tenant: str, keys: Sequence[ChunkKey], priority: str | None = None):
        """A request starts: the leading run of its cached chunks is leased on their shards."""
        self._check_tenant(tenant)
        return self.client.begin(tenant, as_keys(keys), priority)

    def end(self, request) -> None:
        self.client.end(request)

    def report(self, name: str, figures: dict, credential: str | None = None) -> None:
        """Publishes a connector's measured figures to the controller (fire and forget), where
        `kvpool stats` shows them, through the node's shard; with ``credential`` (any of the
        engine's; by default the latest the shard accepted from it)."""
        self.client.report(name, figures, credential)

    def pin(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Pins the leading run of cached chunks (warm-up, an operator's), within each shard's pinned cap."""
        self._check_tenant(tenant)
        return self.client.pin(tenant, as_keys(keys))

    def load(self, tenant: str, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading run of chunks that are stored and verify; a payload of another size than
        this spec's chunk ends the run (a miss, as in LocalPool)."""
        t = self._check_tenant(tenant)
        keys = as_keys(keys)
        sealer = self._sealer(tenant, t, keys)
        codec = self._formats.codec(self._format(t, is_shared(keys)))
        where = self.client.addresses(tenant, keys) if sealer is not None else None
        out = []
        for i, data in enumerate(self.client.get(tenant, keys)):
            if sealer is not None:
                data = sealer.open(where[i], data)
            kv = None if data is None else codec.decode(data)
            if kv is None:
                break
            out.append(kv)
        return out

    def _sealer(self, credential: str, tenant: Tenant, keys) -> Sealer | None:
        """The caller's sealer when its payloads are sealed at rest (kvpool.seal), else None."""
        if not needs_seal(tenant, is_shared(keys)):
            return None
        return sealer_for(credential, is_credential(credential), self._sealers)

    def load_views(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator["OwnedChunk"]:
        """:meth:`load` as views, the surface LocalPool gives. Over a node's shard (NodeClient) the
        chunks of this node are read one at a time, as the caller asks for them, each verified into
        one of two buffers this thread reuses (so a load touches no fresh pages, and the caller's
        copy of chunk j overlaps nothing): a view is valid until the caller asks for the view after
        next, and the caller releases each one before that (``with view: ...``). Chunks of other
        nodes come in one call, as ``load`` reads them."""
        t = self._check_tenant(tenant)
        keys = as_keys(keys)
        if self._sealer(tenant, t, keys) is None:
            return self._node_views(tenant, keys, self._formats.codec(self._format(t, is_shared(keys))))
        return (OwnedChunk(kv) for kv in self.load(tenant, keys))  # a generator: callers close() it

    def _node_views(self, tenant: str, keys: list[ChunkKey], codec) -> Iterator["OwnedChunk"]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].shape[0] != codec.nbytes:
            bufs = self._local.bufs = [codec.payload_buffer() for _ in range(2)]
        for i in range(len(keys)):
            got = self.client.get(tenant, keys[i : i + 1], outs=[bufs[i % 2]], local_only=True)
            kv = codec.decode(got[0]) if got else None
            if kv is None:
                break
            yield OwnedChunk(kv)
        else:
            return
        for kv in self.load(tenant, keys[i:]):  # the rest from other nodes (or nowhere): one call
            yield OwnedChunk(kv)

    def load_views_in_place(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator:
        """:meth:`load_views` for a caller that copies each chunk out and can take a chunk back
        after (the vLLM worker): over a node's shard, this node's chunks are views of its slab
        itself, no copy, verified when released (kvpool.node.inplace): a release that raises
        ChunkChanged means what the caller copied from that view is not the chunk (a failed load).
        Chunks of other nodes and sealed chunks: :meth:`load_views`."""
        t = self._check_tenant(tenant)
        keys = as_keys(keys)
        if self._sealer(tenant, t, keys) is None:
            return self._in_place_views(tenant, keys, self._formats.codec(self._format(t, is_shared(keys))))
        return self.load_views(tenant, keys)

    def _in_place_views(self, tenant: str, keys: list[ChunkKey], codec) -> Iterator:
        from kvpool.node.inplace import local_views

        n = 0
        for view in local_views(self.client, tenant, keys, codec.decode):
            yield view  # the caller releases (verifies) it before asking for the next
            n += 1
        if n < len(keys):
            for kv in self.load(tenant, keys[n:]):  # the rest from other nodes (or nowhere): one call
                yield OwnedChunk(kv)

    def save(self, tenant: str, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor], *, start: int = 0,
             shared: bool = False, request=None) -> int:
        """Stores the chunks of ``keys[start:]``; with ``request`` they stay leased until it ends.
        Every chunk is checked before anything is written."""
        t = self._check_tenant(tenant)
        keys = as_keys(keys)
        if not isinstance(shared, bool) or is_shared(keys) != shared:
            raise BadRequest("shared=True goes with keys derived with keys(..., shared=True), and only with them")
        payloads = self._formats.codec(self._format(t, shared)).encode_run(keys, chunks, start)
        sealer = self._sealer(tenant, t, keys)
        if sealer is not None:
            where = self.client.addresses(tenant, keys)
            payloads = [sealer.seal(k, pl) for k, pl in zip(where[start:], payloads)]
        return self.client.put(tenant, keys[start : start + len(chunks)], payloads, shared=shared,
                               first_position=start, request=request)

    def stats(self) -> dict:
        """This node's shard's stats in a store-shaped dict (asked on its socket, no Ray;
        ``"scope": "node"``), and an empty sum (``"error"`` says why) when it does not answer."""
        from kvpool.errors import KvPoolError

        total = {"tiers": {}, "tenants": {}, "chunks": 0, "policy": None, "policy_stats": {},
                 "metrics": {"evictions": {}, "checksum_failures": {}}, "shards": 0, "scope": "node"}
        try:
            per_shard = [self.client.shard_stats()]
        except KvPoolError as e:
            total["error"] = str(e)
            per_shard = []
        total["shards"] = len(per_shard)
        for st in per_shard:
            total["chunks"] += st["chunks"]
            total["policy"] = st["policy"]
            for tier, t in st["tiers"].items():
                acc = total["tiers"].setdefault(tier, {k: 0 for k in t})
                for k, v in t.items():
                    acc[k] += v
            for ten, t in st["tenants"].items():
                total["tenants"].setdefault(ten, {"bytes": 0})["bytes"] += t["bytes"]
            for m in ("evictions", "checksum_failures"):
                for label, v in st["metrics"][m].items():
                    total["metrics"][m][label] = total["metrics"][m].get(label, 0) + v
        return total
