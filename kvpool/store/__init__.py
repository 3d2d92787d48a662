"""The chunk store of one node: put / get / read / contains / remove / lease over tiers of pages.

Memory roles: a key names a chunk; the TieredCache (kvpool.cache) maps it to a node and the node
to a page of a tier, and its policies decide what leaves; the page holds the payload, verified by
an xxh3-64 checksum on every read. This module owns the bytes and the tenants' accounting.

Rules this module keeps:
- bytes before index: a chunk is findable only once its bytes are in place and checksummed;
- a chunk is visible only to its tenant, or to everyone when it was stored as shared;
- bytes are verified at every read and every promotion; a mismatch is a miss, and the entry is
  dropped, refunded and counted;
- a leased chunk (being read, or belonging to a request in flight) is never evicted or moved;
- eviction demotes (DRAM -> disk) before it drops, and a hit on disk promotes back to DRAM;
- a write that would pass the tenant's quota is refused whole (429) and changes nothing.

Metadata changes happen under one lock; payload copies of reads and writes happen outside it,
under a lease, so readers do not serialize on each other's copies.

The parts live in their own modules: ``config`` (StoreConfig, watermarks), ``leases`` (Lease,
ChunkView, removal), ``holds`` (reserve/commit for other processes, Placement), ``requests``
(ActiveRequest, begin/end, cancellation), ``evictor`` (the background evictor), ``writes`` and
``reads``, ``hooks`` (the cache's hooks), ``inspection``, over ``base`` (the state and the lock).
"""

from kvpool.store.chunk_store import ChunkStore
from kvpool.store.config import StoreConfig
from kvpool.store.holds import Placement
from kvpool.store.leases import ChunkView, Lease
from kvpool.store.requests import ActiveRequest

__all__ = ["ActiveRequest", "ChunkStore", "ChunkView", "Lease", "Placement", "StoreConfig"]
