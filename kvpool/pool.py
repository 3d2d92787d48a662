"""LocalPool: the chunk store seen through a KV spec, in tokens and KV tensors.

This is what an engine adapter talks to on one node: it turns a prompt's tokens into chunk keys
in the tenant's namespace, checks KV tensors against the spec before storing them, and answers
"how much of this prompt is cached" as a leading run of whole chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvpool.auth import Authority, Principal, namespace_salt, scope_tag, scoped
from kvpool.codec import ChunkCodec, Formats, page_bytes, torch_dtype
from kvpool.errors import BadRequest, Forbidden
from kvpool.index.base import PrefixHit
from kvpool.keys import ChunkKey, Namespace, as_keys, is_shared
from kvpool.seal import SEAL_OVERHEAD, Sealer, needs_seal, sealer_for
from kvpool.spec import KVSpec
from kvpool.store import ActiveRequest, ChunkStore, ChunkView, Lease, StoreConfig
from kvpool.tenants import TenantRegistry

__all__ = ["KVView", "LocalPool", "torch_dtype"]


class KVView:
    """One verified chunk seen in place: ``kv`` is the chunk as a ``[layers, 2, chunk_tokens,
    kv_heads, head_dim]`` tensor over the pool's own page (no copy), ``data`` the same bytes as a
    read-only uint8 array. Leased (never evicted or moved) until ``release``; a context manager.
    Read it and release it: never write through ``kv``, never use it after the release."""

    __slots__ = ("_view", "kv")

    def __init__(self, view: ChunkView, kv: torch.Tensor) -> None:
        self._view = view
        self.kv = kv

    @property
    def data(self):
        return self._view.data

    def release(self) -> None:
        self._view.release()

    def __enter__(self) -> "KVView":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LocalPool:
    """A single-node pool for one KV spec (one model layout).

    With an ``authority`` that holds a pool secret, every ``tenant`` argument is a credential
    (kvpool.auth); without one (the default) it is a tenant id and the process is trusted. Either
    way a tenant's keys address its own scope of the store and shared keys the shared one, which
    only an operator writes. ``keyed_as``: the spec keys are made of when the chunks are slices of
    its chunks (kvpool.slices: engines open their pools through kvpool.slices.SlicedPool)."""

    def __init__(self, spec: KVSpec, store: ChunkStore, authority: Authority | None = None, *,
                 keyed_as: KVSpec | None = None) -> None:
        self._formats = Formats(spec, self._salt, keyed_as)
        self.codec = self._formats.codec()
        for fmt in ("", *(t.storage_format for t in store.tenants)):  # a tenant may store its own format
            self._formats.codec(fmt).check_page(store.page_bytes, "create the store with page_bytes >= " + (
                "kvpool.codec.stored_nbytes(spec) (LocalPool.create sizes them)" if self._formats.codec(fmt).lossy
                else "spec.chunk_nbytes"))
        self.spec = spec
        self.store = store
        self.auth = authority if authority is not None else Authority(None)
        self._sealers: dict[str, Sealer] = {}

    @classmethod
    def create(cls, spec: KVSpec, tenants: TenantRegistry, dram_chunks: int, *,
               authority: Authority | None = None, keyed_as: KVSpec | None = None, **config) -> "LocalPool":
        """A pool whose pages are exactly one stored chunk of ``spec`` (quantized, for a lossy
        storage format, whose watermarks it takes too; the largest, when a tenant stores its own
        format), and the seal's bytes when a tenant encrypts its payloads."""
        page = page_bytes(spec, [t.storage_format for t in tenants])
        page += SEAL_OVERHEAD if any(t.encrypt for t in tenants) else 0
        config.setdefault("storage_format", spec.storage_format)
        return cls(spec, ChunkStore(StoreConfig(page, dram_chunks, **config), tenants), authority, keyed_as=keyed_as)

    @property
    def tenants(self) -> TenantRegistry:
        return self.store.tenants

    # ------------------------------------------------------------------ who and where
    def _who(self, tenant: str) -> Principal:
        """The verified caller (401 for a bare name or a forged credential on a secured pool; 404
        for a tenant the pool does not serve)."""
        p = self.auth.verify(tenant)
        self.tenants.index(p.tenant)
        return p

    def _salt(self, tenant: str) -> bytes:
        p = self._who(tenant)
        salt = self.tenants.get(p.tenant).salt
        return namespace_salt(tenant) + b"/" + salt if self.auth.secured else salt

    def _codec(self, p: Principal, keys: Sequence[ChunkKey]) -> ChunkCodec:
        """The codec of the caller's chunks: its tenant's own storage format, or the spec's (shared
        keys are always in the spec's)."""
        return self._formats.codec("" if is_shared(keys) else self.tenants.get(p.tenant).storage_format)

    def namespace(self, tenant: str, *, shared: bool = False, adapter_id: str = "",
                  extra_keys: Sequence[str | bytes] = ()) -> Namespace:
        """The tenant's (or the shared) namespace, in the tenant's storage format (see ``_codec``)."""
        fmt = "" if shared is True else self.tenants.get(self._who(tenant).tenant).storage_format
        return self._formats.maker(fmt).namespace(tenant, shared=shared, adapter_id=adapter_id, extra_keys=extra_keys)

    def keys(self, tenant: str, tokens: object, *, shared: bool = False, adapter_id: str = "",
             extra_keys: Sequence[str | bytes] = ()) -> list[ChunkKey]:
        """The chunk keys of a prompt's whole chunks in the tenant's (or the shared) namespace."""
        fmt = "" if shared is True else self.tenants.get(self._who(tenant).tenant).storage_format
        return self._formats.maker(fmt).keys(tenant, tokens, shared=shared, adapter_id=adapter_id,
                                             extra_keys=extra_keys)

    def _where(self, p: Principal, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """The store's addresses of ``keys``: the caller's own scope, or the shared one for shared keys."""
        return scoped(keys, scope_tag(None if is_shared(keys) else p.tenant))

    def _sealer(self, p: Principal, credential: str, keys: Sequence[ChunkKey]) -> Sealer | None:
        """The caller's sealer when its payloads are sealed at rest (kvpool.seal), else None."""
        if not needs_seal(self.tenants.get(p.tenant), is_shared(keys)):
            return None
        if self.store.page_bytes < self._codec(p, keys).nbytes + SEAL_OVERHEAD:
            raise BadRequest(f"tenant {p.tenant!r} seals its payloads: pages need {SEAL_OVERHEAD} B more than a "
                             "chunk (create the pool with LocalPool.create, which sizes them)")
        return sealer_for(credential, self.auth.secured, self._sealers)

    def addresses(self, tenant: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Where the store keeps a tenant's chunks of ``keys`` (for tools and tests that look
        inside ``self.store``)."""
        return self._where(self._who(tenant), as_keys(keys))

    def lookup(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Tokens covered by the leading run of resident chunks."""
        p = self._who(tenant)
        n = 0
        for present in self.store.contains_many(self._where(p, as_keys(keys)), p.tenant):
            if not present:
                break
            n += 1
        return n * self.spec.chunk_tokens

    def locate(self, tenant: str, keys: Sequence[ChunkKey]) -> PrefixHit:
        """The leading run of resident chunks and where each is: this process (``"local"``)."""
        n = self.lookup(tenant, keys) // self.spec.chunk_tokens
        return PrefixHit(n, ("local",) * n)

    def check_chunk(self, kv: torch.Tensor) -> None:
        """Raises LayoutMismatch unless ``kv`` is one whole raw chunk of this spec."""
        self.codec.check(kv)

    def begin(self, tenant: str, keys: Sequence[ChunkKey], priority: str | None = None) -> ActiveRequest:
        """A request starts: the leading run of its cached chunks is leased until ``end``."""
        p = self._who(tenant)
        return self.store.begin(p.tenant, self._where(p, as_keys(keys)), priority)

    def end(self, request: ActiveRequest) -> None:
        self.store.end(request)

    def save(self, tenant: str, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor], *,
             start: int = 0, shared: bool = False, request: ActiveRequest | None = None,
             attention: Sequence[float] | None = None) -> int:
        """Stores the chunks of ``keys[start:]`` (``[layers, 2, chunk_tokens, kv_heads, head_dim]``
        each); the policy hears once of all the request's chunks. Returns how many were stored.
        Everything is validated before anything is written. The new chunks stay leased with
        ``request`` until the caller ends it. Shared keys (``keys(..., shared=True)``) are written
        with ``shared=True`` and an operator's credential only (403 otherwise). ``attention``: each
        chunk's attention mass in [0, 1] from ``keys[0]`` on, when the engine computes it (the
        ``importance`` policy weighs it)."""
        p = self._who(tenant)
        keys = as_keys(keys)
        check_shared_write(p, keys, shared)
        payloads = self._codec(p, keys).encode_run(keys, chunks, start)
        where = self._where(p, keys)
        sealer = self._sealer(p, tenant, keys)
        if sealer is not None:
            payloads = [sealer.seal(k, pl) for k, pl in zip(where[start:], payloads)]
        n = len(keys)
        access = self.store.new_access(n, n, start)
        access.attention = None if attention is None else [min(1.0, max(0.0, float(a))) for a in attention]
        parent = where[start - 1] if start else None
        stored = self.store.put_many(where[start : start + len(chunks)], payloads, p.tenant, shared=shared,
                                     parent=parent, first_position=start, access=access, request=request)
        self.store.access(where[: start + len(chunks)], p.tenant, access)
        return sum(stored)

    def load(self, tenant: str, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading run of chunks that are resident and verify (and, in a lossy format, decode);
        each shaped like the spec. The policy hears of them when the request ends (``save``)."""
        p = self._who(tenant)  # bad input fails before any chunk is read or counted
        keys = as_keys(keys)
        sealer = self._sealer(p, tenant, keys)
        codec = self._codec(p, keys)
        keys = self._where(p, keys)
        tenant = p.tenant
        out: list[torch.Tensor] = []
        m = self.store.metrics
        lossy = codec.lossy
        for key in keys:
            kv = codec.empty() if not lossy else None
            buf = codec.payload_buffer() if lossy else kv.view(-1).view(torch.uint8).numpy()
            if sealer is None:
                got = self.store.get_many([key], tenant, [buf], touch=False)[0]
                if got is None or got.shape[0] != codec.nbytes:  # another size: not a chunk of this spec
                    break
            else:
                got = self.store.get_many([key], tenant, touch=False)[0]
                if got is None or sealer.open(key, got, out=buf) is None:
                    break  # not this tenant's seal of this key (or another size): a miss
            if lossy and (kv := codec.decode(buf)) is None:
                break  # a payload that does not decode: a miss
            out.append(kv)
        hit_tokens = len(out) * self.spec.chunk_tokens
        if hit_tokens:
            m.hits_tokens.inc(hit_tokens, tenant)
        if len(keys) > len(out):
            m.misses_tokens.inc((len(keys) - len(out)) * self.spec.chunk_tokens, tenant)
        return out

    def load_views(self, tenant: str, keys: Sequence[ChunkKey]) -> Iterator[KVView]:
        """:meth:`load` without the copy: the same leading run of resident chunks that verify, each
        as a :class:`KVView` over the pool's own page, for a caller that copies the bytes into
        memory of its own anyway (an engine's paged cache).

        The iterator reads lazily: a chunk is leased and verified in place (its xxh3-64 checksum,
        as every read) when the iterator reaches it. Every view it yields is the caller's to
        release, right after use (and on errors: ``with view: ...``); closing the iterator early
        reads no further chunk. A miss, a chunk of another size or one that fails verification
        ends the run (a corrupt chunk is dropped and counted, as ``load`` does). Hit tokens are
        counted per chunk given, miss tokens for the keys from the first miss on; like ``load``,
        the policy hears of the chunks when the request saves, not here.

        NOTE: a view is verified once, then read in place: the lease keeps it from being moved,
        evicted or rewritten by the pool, so the bytes the caller copies are the bytes verified;
        ``load`` verifies its private copy instead, which costs one more pass over the bytes
        (measured on vLLM's load path: see connectors/vllm_worker.py). In a lossy storage format
        there is nothing to read in place: each chunk is dequantized out of its leased page into
        memory of its own (an :class:`OwnedChunk`), and the lease ends right after."""
        p = self._who(tenant)  # bad input fails here, before anything is read
        keys = as_keys(keys)
        if self._sealer(p, tenant, keys) is not None:  # sealed bytes are opened into memory of their own
            return iter([OwnedChunk(kv) for kv in self.load(tenant, keys)])
        return self._views(p.tenant, self._where(p, keys), self._codec(p, keys))

    def _views(self, tenant: str, keys: list[ChunkKey], codec: ChunkCodec) -> Iterator[KVView]:
        m = self.store.metrics
        ct = self.spec.chunk_tokens
        for i, key in enumerate(keys):
            view = self._read_in_place(key, tenant, codec)
            if view is None:
                m.misses_tokens.inc((len(keys) - i) * ct, tenant)
                return
            m.hits_tokens.inc(ct, tenant)
            yield view  # the caller owns its lease from here

    def _read_in_place(self, key: ChunkKey, tenant: str, codec: ChunkCodec) -> KVView | OwnedChunk | None:
        """One chunk leased and verified in place (the store's zero-copy read, which does not tell
        the eviction policy: the request's save reports the whole prefix once), or None on a miss,
        a chunk of another size or a corrupt one."""
        view = self.store.read(key, tenant, touch=False)
        if view is None:
            return None
        data = view.data
        if data.shape[0] != codec.nbytes:  # another size: not a chunk of this spec
            view.release()
            return None
        if codec.lossy:  # dequantized out of the page: the copy owns its bytes
            try:
                kv = codec.decode(data)
            finally:
                view.release()
            return None if kv is None else OwnedChunk(kv)
        dtype = torch_dtype(self.spec)
        if data.ctypes.data % dtype.itemsize:  # a page size that is no multiple of the element's
            kv = torch.from_numpy(data.copy())  # verified bytes, copied under the lease: aligned
        else:
            # NOTE: torch warns on read-only arrays; the tensor is built over a writable alias of
            # the page, and KVView says read-only (``data`` is).
            page = data.view()
            page.flags.writeable = True
            kv = torch.from_numpy(page)
        return KVView(view, kv.view(dtype).view(self.spec.chunk_shape))

    def warmup(self, tenant: str, prompts: Sequence[tuple[object, Sequence[torch.Tensor]]], *,
               shared: bool = False, pin: bool = True) -> tuple[int, int]:
        """Preloads prefixes before traffic (system prompts, tool schemas): each item is the
        prompt's tokens and the KV chunks of its whole chunks. Pins them when ``pin`` (the policy
        decides how many fit under its pinned cap; the rest stay as ordinary chunks). Returns
        (chunks stored, chunks pinned)."""
        stored = pinned = 0
        for tokens, chunks in prompts:
            keys = self.keys(tenant, tokens, shared=shared)
            stored += self.save(tenant, keys, chunks, shared=shared)
            if pin:
                pinned += self.pin(tenant, keys[: len(chunks)])
        return stored, pinned

    def stats(self) -> dict:
        """The store's stats (the cluster pool sums its shards' into the same shape)."""
        return self.store.stats()

    def pin(self, tenant: str, keys: Sequence[ChunkKey]) -> int:
        """Pins resident chunks (warm-up, an operator's), up to the policy's pinned cap; how many."""
        p = self._who(tenant)
        self.auth.require(tenant, "pinning (warm-up)")
        return self.store.pin(self._where(p, as_keys(keys)), p.tenant)

    def lease(self, tenant: str, keys: Sequence[ChunkKey]) -> Lease:
        """Pins a request's chunks while it is in flight."""
        p = self._who(tenant)
        return self.store.lease(self._where(p, as_keys(keys)), p.tenant)


class OwnedChunk:
    """A loaded chunk with :class:`KVView`'s surface (``kv``, ``release``, ``with``) that owns its
    bytes (they came over the network, or were opened from a seal): releasing it frees nothing."""

    __slots__ = ("kv",)

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def release(self) -> None:
        """Nothing to give back: the chunk owns its bytes."""

    def __enter__(self) -> "OwnedChunk":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_shared_write(p: Principal, keys: Sequence[ChunkKey], shared: object) -> None:
    """A write's ``shared`` flag agrees with its keys, and only an operator writes shared keys."""
    if not isinstance(shared, bool):
        raise BadRequest(f"shared must be True or False, got {shared!r}")
    if is_shared(keys) != shared:
        raise BadRequest("shared=True goes with keys derived with keys(..., shared=True), and only with them"
                         if shared else "these are shared keys: write them with shared=True (an operator credential)")
    if shared and not p.operator:
        raise Forbidden(f"only an operator writes the shared namespace (warm-up); {p.tenant!r} presented a "
                        f"{p.role} credential")
