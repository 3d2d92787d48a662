"""kvpool route's own logic, piece by piece: the GPU cache view built from vLLM's KV events (in
the form vLLM 0.32's publisher sends them), a request's tokens by tier on each instance, the
planner over a real pool (tenants apart), the measured cost model, and the instance options."""

from __future__ import annotations

import json
import uuid

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.connectors.pools import close_local_pools, open_pool
from kvpool.connectors.route.costs import OnlineCost
from kvpool.connectors.route.events import subscribe_address
from kvpool.connectors.route.fleet import InstanceSpec
from kvpool.connectors.route.gpu import GpuView, block_chain
from kvpool.connectors.route.plan import Plan, Planner
from kvpool.connectors.tenancy import Tenancy
from kvpool.errors import BadRequest
from kvpool.routing import CostModel
from kvpool.spec import KVSpec

ACME = "acme-route-secret-0123456789"
CFG = {"backend": "local", "pool": "route-units", "dram_mib": 4, "chunk_tokens": 8,
       "tenants": ["default", {"id": "acme", "request_secret": ACME}]}
BS = 4  # vLLM's block size in these events


@pytest.fixture(autouse=True)
def _clean():
    yield
    close_local_pools()


def tenant_of(tenancy: Tenancy):
    return lambda salt: (r.tenant if (r := tenancy.of_secret(salt)) is not None else None)


def stored(hashes, tokens, parent=None, salt=None, **kw) -> dict:
    """A BlockStored event as vLLM publishes it (msgpack-decoded)."""
    extra = [[salt] if (salt and k == 0) else None for k in range(len(hashes))]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": extra,
            "group_idx": 0, "kv_cache_spec_kind": "full_attention", **kw}


def test_the_gpu_view_follows_each_tenants_blocks_and_never_anothers():
    view = GpuView(tenant_of(Tenancy(CFG, engine="test")))
    prompt = list(range(100, 116))  # four blocks
    view.apply(stored([11, 12], prompt[:8]))  # the default tenant's (no salt), two blocks
    view.apply(stored([13], prompt[8:12], parent=12))  # its third, in a later event
    view.apply(stored([21, 22, 23, 24], prompt, salt=ACME))  # acme's: the same tokens, other hashes
    view.apply(stored([31, 32], prompt[:8], salt="nobodys-secret-123456"))  # no tenant's: never counted
    view.apply(stored([41], prompt[12:16], parent=99))  # a parent never seen: left out
    view.apply(stored([51], prompt[:4], lora_name="ad", lora_id=1))  # an adapter's block: left out
    assert view.block_size == BS and view.skipped == 4
    assert view.leading(block_chain("default", prompt, BS)) == 3
    assert view.leading(block_chain("acme", prompt, BS)) == 4
    assert view.leading(block_chain("globex", prompt, BS)) == 0
    assert view.leading(block_chain("default", list(range(200, 216)), BS)) == 0
    view.apply({"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0})
    assert view.leading(block_chain("default", prompt, BS)) == 1  # the chain breaks at the removed block
    assert view.leading(block_chain("acme", prompt, BS)) == 4  # acme's own blocks stay
    view.apply({"type": "BlockRemoved", "block_hashes": [24, 777], "medium": "GPU", "group_idx": 1})
    assert view.leading(block_chain("acme", prompt, BS)) == 4  # another KV cache group's removal
    view.apply({"type": "AllBlocksCleared"})
    assert len(view) == 0 and view.leading(block_chain("acme", prompt, BS)) == 0


def test_tokens_by_tier_take_the_gpu_cache_first_then_the_pools_chunks():
    view = GpuView(lambda salt: "default")
    tokens = list(range(30))  # three whole chunks of 8 and 6 tokens
    view.apply(stored([1, 2, 3], tokens[:12]))  # 12 tokens in the GPU cache: a chunk and a half
    p = Plan(tenant="default", tokens=tokens, chunk_tokens=8, where=[frozenset({"s1"}), frozenset({"s1"}),
                                                                     frozenset({"s1", "s2"})])
    assert p.tiers_on("s1", view) == {"gpu": 12, "node": 4, "remote": 8, "miss": 6}
    assert p.tiers_on("s2", view) == {"gpu": 12, "node": 0, "remote": 12, "miss": 6}
    assert p.tiers_on("s1", None) == {"gpu": 0, "node": 16, "remote": 8, "miss": 6}
    assert Plan(tenant=None, tokens=tokens, chunk_tokens=8).tiers_on("s1", view) == \
        {"gpu": 0, "node": 0, "remote": 0, "miss": 30}


def chunk(spec: KVSpec, seed: int) -> torch.Tensor:
    return torch.randn(spec.chunk_shape, generator=torch.Generator().manual_seed(seed))


def test_the_planner_finds_a_tenants_own_chunks_and_no_one_elses():
    spec = KVSpec("test/route", 2, 2, 4, dtype="float32", block_size=8, chunk_tokens=8)
    pool = open_pool(spec, CFG)
    tenancy = Tenancy(CFG, engine="test")
    planner = Planner(tenancy, pool, chunk_tokens=8)
    tokens = list(range(1, 30))
    keys = pool.keys("acme", tokens[:24])
    assert pool.save("acme", keys[:2], [chunk(spec, 0), chunk(spec, 1)]) == 2

    def plan(body: dict, tokens: list[int] | None = tokens):
        return planner.plan(planner.route(body), tokens)

    mine = plan({"prompt": tokens, "cache_salt": ACME})
    assert (mine.tenant, mine.where, mine.error) == ("acme", [frozenset({"local"})] * 2, None)
    theirs = plan({"prompt": tokens})  # the default tenant: the same tokens
    assert theirs.tenant == "default" and theirs.where == []
    stranger = plan({"prompt": tokens, "cache_salt": "a-guess-at-acmes-secret"})
    assert stranger.tenant is None and stranger.where == []  # not cached: routed on load alone
    assert tenancy.stats()["rejected_credential"] == 1
    chat = plan({"messages": [{"role": "user", "content": "hi"}]}, None)
    assert chat.tokens is None and chat.tenant is None  # no tokens (no tokenizer): routed on load


class _Broken:
    def keys(self, tenant, tokens, **kw):
        raise ConnectionError("the shard went away")


def test_an_index_that_cannot_answer_leaves_the_plan_on_load():
    planner = Planner(Tenancy(CFG, engine="test"), _Broken(), chunk_tokens=8)
    p = planner.plan(planner.route({"prompt": list(range(20))}), list(range(20)))
    assert p.error == "the shard went away" and p.where == [] and p.tenant == "default"


def test_the_cost_model_measures_each_tier_and_keeps_their_order():
    truth = dict(overhead=0.02, node=1e-5, remote=6e-5, miss=4e-4)
    cost = OnlineCost(CostModel(prefill_s=1e-3, node_s=1e-3, remote_s=1e-3))  # a prior far from the truth
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = {k: int(rng.integers(0, 2048)) for k in ("node", "remote", "miss")}
        y = truth["overhead"] + sum(truth[k] * t[k] for k in t) * (1 + 0.02 * rng.standard_normal())
        cost.observe(t, y)
    m = cost.model()
    assert m.node_s == pytest.approx(1e-5, rel=0.5) and m.remote_s == pytest.approx(6e-5, rel=0.2)
    assert m.prefill_s == pytest.approx(4e-4, rel=0.05) and cost.overhead_s == pytest.approx(0.02, abs=0.01)
    inverted = OnlineCost(CostModel(prefill_s=1e-4, node_s=1e-6, remote_s=1e-5))
    for _ in range(50):  # remote loads measured cheaper than node ones: averaged, never reordered
        inverted.observe({"node": 1000, "remote": 0, "miss": 100}, 0.01 + 1000 * 5e-5 + 100 * 1e-4)
        inverted.observe({"node": 0, "remote": 1000, "miss": 100}, 0.01 + 1000 * 1e-5 + 100 * 1e-4)
    m = inverted.model()
    assert m.node_s <= m.remote_s <= m.prefill_s


def test_instance_options_and_event_addresses():
    assert InstanceSpec.parse("http://10.0.0.5:8000/") == InstanceSpec("http://10.0.0.5:8000")
    assert InstanceSpec.parse("http://h:8000,shard=s-1,events=tcp://h:5557") == \
        InstanceSpec("http://h:8000", "s-1", "tcp://h:5557")
    for bad in ("10.0.0.5:8000", "http://h:8000,node=x", "http://h:8000,shard="):
        with pytest.raises(BadRequest):
            InstanceSpec.parse(bad)
    assert subscribe_address("tcp://*:5557", "http://10.0.0.5:8000") == ("tcp://10.0.0.5:5557", False)
    assert subscribe_address("ipc:///tmp/ev", "http://h:1") == ("ipc:///tmp/ev", False)
    assert subscribe_address("tcp://10.0.0.9:5557", "http://h:1") == ("tcp://10.0.0.9:5557", True)  # vLLM dials
    with pytest.raises(BadRequest):
        subscribe_address("5557", "http://h:1")


def test_an_event_feed_reads_vllms_frames_and_starts_over_at_a_gap():
    import asyncio

    import msgpack
    import zmq

    from kvpool.connectors.route.events import EventFeed

    async def main():
        view = GpuView(lambda salt: "default")
        pub = zmq.Context.instance().socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        feed = EventFeed(view, "test", [(f"tcp://127.0.0.1:{port}", False)])
        feed.start()
        prompt = list(range(8))

        def send(seq: int, payload: bytes) -> None:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

        async def until(cond):
            for _ in range(200):
                if cond():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("timed out")

        try:
            seq = 0
            for seq in range(100):  # a subscriber joins a moment after it connects (ZMQ's slow joiner)
                send(seq, msgpack.packb([1.0, [stored([1], prompt[:4])], 0]))
                await asyncio.sleep(0.02)
                if len(view):
                    break
            send(seq + 1, msgpack.packb([1.0, [stored([2], prompt[4:], parent=1)], 0]))
            await until(lambda: view.leading(block_chain("default", prompt, BS)) == 2)
            send(seq + 2, b"\xc1 not msgpack")
            send(seq + 9, msgpack.packb([1.0, [stored([7], list(range(50, 54)))], 0]))  # 6 batches lost
            await until(lambda: feed.gaps == 1)
            assert feed.bad == 1 and view.leading(block_chain("default", prompt, BS)) == 0 and len(view) == 1
        finally:
            feed.close()
            pub.close(linger=0)

    asyncio.run(main())


def test_a_config_file_holding_credentials_is_read_only_while_private(tmp_path):
    from kvpool.connectors.route.main import read_config

    cfg = {"kv_connector": "KVPoolConnector", "kv_connector_extra_config": {
        "backend": "node", "tenants": [{"id": "acme", "credential": "kvp1.acme.x"}]}}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cfg))
    path.chmod(0o644)
    with pytest.raises(BadRequest, match="chmod 600"):
        read_config(f"@{path}")
    path.chmod(0o600)
    assert read_config(f"@{path}") == cfg["kv_connector_extra_config"]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"backend": "node", "tenants": ["a"], "credentials_file": "/x"}))
    plain.chmod(0o644)  # names the credentials' file, holds none itself: readable is fine
    assert read_config(f"@{plain}")["tenants"] == ["a"]
    with pytest.raises(BadRequest, match="not JSON"):
        read_config("{nope")


def test_a_new_subscription_replays_what_the_instance_still_holds():
    """A router that starts after the instance asks its replay endpoint (vLLM's ROUTER socket) for
    every batch it holds, then follows the live ones, skipping those the replay already gave."""
    import asyncio

    import msgpack
    import zmq
    import zmq.asyncio

    from kvpool.connectors.route.events import END_SEQ, EventFeed

    prompt = list(range(12))
    held = [(0, [stored([1], prompt[:4])]), (1, [stored([2], prompt[4:8], parent=1)])]

    async def main():
        ctx = zmq.asyncio.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        pub = ctx.socket(zmq.PUB)
        pport = pub.bind_to_random_port("tcp://127.0.0.1")

        async def serve_replay():  # as vLLM's publisher answers a replay request
            client, _, start = await router.recv_multipart()
            assert int.from_bytes(start, "big") == 0
            for seq, events in held:
                await router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), msgpack.packb([0.0, events, 0])])
            await router.send_multipart([client, b"", b"", END_SEQ, b""])

        view = GpuView(lambda salt: "default")
        replayer = asyncio.ensure_future(serve_replay())
        feed = EventFeed(view, "test", [(f"tcp://127.0.0.1:{pport}", False)], replays=[f"tcp://127.0.0.1:{rport}"])
        feed.start()
        try:
            await asyncio.wait_for(replayer, 5)
            for _ in range(200):
                if feed.replayed == 2:
                    break
                await asyncio.sleep(0.02)
            assert view.leading(block_chain("default", prompt, BS)) == 2  # known before any live event
            for _ in range(100):  # live: seq 1 again (published during the replay), then seq 2
                await pub.send_multipart([b"", (1).to_bytes(8, "big"), msgpack.packb([0.0, held[1][1], 0])])
                await pub.send_multipart([b"", (2).to_bytes(8, "big"),
                                          msgpack.packb([0.0, [stored([3], prompt[8:], parent=2)], 0])])
                await asyncio.sleep(0.05)
                if view.leading(block_chain("default", prompt, BS)) == 3:
                    break
            assert view.leading(block_chain("default", prompt, BS)) == 3 and feed.gaps == 0
        finally:
            feed.close()
            router.close(linger=0)
            pub.close(linger=0)

    asyncio.run(main())


def test_a_lookup_the_node_cannot_answer_says_so(tmp_path):
    """No shard answers (it died, or never started): the lookup is a miss that says why, so that a
    router routes that request by load instead of reading "nothing cached anywhere"."""
    from kvpool.keys import ChunkKey
    from kvpool.node.client import NodeClient

    c = NodeClient(pool="default", directory=str(tmp_path), timeout_s=0.5)
    try:
        hit = c.lookup("a", [ChunkKey(b"k" * 16)])
    finally:
        c.close()
    assert hit.count == 0 and hit.error and "503" in hit.error


# ---------------------------------------------------------------- malformed KV event frames
GARBAGE = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() |
                       st.text(max_size=6) | st.binary(max_size=6),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                       max_leaves=10)
HASHES = st.lists(st.integers(0, 40) | st.binary(min_size=1, max_size=3), max_size=3)


def _maybe(valid):
    return st.one_of(valid, GARBAGE)


EVENT = st.one_of(GARBAGE, st.fixed_dictionaries({
    "type": _maybe(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])),
    "block_hashes": _maybe(HASHES),
    "parent_block_hash": _maybe(st.none() | st.integers(0, 40)),
    "token_ids": _maybe(st.lists(st.integers(0, 50), min_size=0, max_size=12)),
    "block_size": _maybe(st.just(BS)),
    "extra_keys": _maybe(st.none() | st.lists(st.none() | st.just([ACME]), max_size=3)),
    "group_idx": _maybe(st.just(0)),
    "medium": _maybe(st.just("GPU")),
}))
PAYLOAD = st.one_of(st.binary(max_size=40), GARBAGE.map(msgpack.packb),
                    st.lists(EVENT, max_size=4).map(lambda events: msgpack.packb([1.0, events, 0])))
FRAME = st.one_of(st.tuples(st.binary(max_size=2), st.binary(max_size=9), PAYLOAD).map(list),
                  st.lists(st.binary(max_size=8), max_size=5))
ROBUST = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _state(view: GpuView):
    return dict(view._ids), dict(view._held), view.block_size


def _consistent(view: GpuView) -> bool:
    """Every block of vLLM's maps to a chain id held as often as blocks map to it."""
    counts: dict[int, int] = {}
    for cid in view._ids.values():
        counts[cid] = counts.get(cid, 0) + 1
    return counts == view._held


@ROBUST
@given(st.lists(EVENT, max_size=12))
def test_any_event_either_applies_or_changes_nothing_and_never_raises(events):
    view = GpuView(tenant_of(Tenancy(CFG, engine="test")))
    view.apply(stored([1, 2], list(range(8))))  # something to lose
    for e in events:
        before = _state(view)
        if not view.apply(e):
            assert _state(view) == before  # a malformed event is refused whole
        assert _consistent(view)


@ROBUST
@given(st.lists(FRAME, max_size=6))
def test_a_malformed_frame_is_counted_and_dropped_and_changes_nothing(frames):
    from kvpool.connectors.route.events import EventFeed

    view = GpuView(lambda salt: "default")
    feed = EventFeed(view, "test", [(f"inproc://frames-{uuid.uuid4().hex}", True)])  # NOTE: a name never reused
    try:
        feed.on_frame([b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [stored([1], [1, 2, 3, 4])], 0])])
        for f in frames:
            before, bad, batches = _state(view), feed.bad, feed.batches
            feed.on_frame(f)  # never raises
            assert (feed.bad - bad, feed.batches - batches) in ((1, 0), (0, 1))  # counted once, as one or the other
            if feed.bad > bad:
                assert _state(view) == before
            assert _consistent(view)
        assert feed.frames == len(frames) + 1
    finally:
        feed.close()


def test_a_forged_frame_neither_ends_the_feed_nor_reaches_the_view():
    """A frame whose block_hashes is an integer (and other wrong types) is counted in bad_frames and
    dropped; the feed reads on, and the frames after it are applied."""
    import asyncio

    import zmq

    from kvpool.connectors.route.events import EventFeed

    async def main():
        view = GpuView(lambda salt: "default")
        pub = zmq.Context.instance().socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        feed = EventFeed(view, "test", [(f"tcp://127.0.0.1:{port}", False)])
        feed.start()
        prompt = list(range(12))

        def send(seq: int, events: list) -> None:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, events, 0])])

        try:
            seq = 0
            for seq in range(100):  # a subscriber joins a moment after it connects (ZMQ's slow joiner)
                send(seq, [stored([1], prompt[:4])])
                await asyncio.sleep(0.02)
                if len(view):
                    break
            forged = [{**stored([2], prompt[4:8], parent=1), "block_hashes": 7},
                      {**stored([2], prompt[4:8], parent=1), "token_ids": [[1], {"x": 2}, None, "4"]},
                      {"type": "BlockRemoved", "block_hashes": [[1]]}, [1, {"type": "BlockStored"}]]
            for k, e in enumerate(forged):
                send(seq + 1, [e])  # each with the next sequence number: taken by none of them
                await until_async(lambda k=k: feed.bad == k + 1)
            send(seq + 1, [stored([2], prompt[4:8], parent=1)])
            send(seq + 2, [stored([3], prompt[8:], parent=2)])
            await until_async(lambda: view.leading(block_chain("default", prompt, BS)) == 3)
            assert feed.bad == len(forged) and feed.gaps == 0
            assert all(not t.done() for t in feed._tasks)  # still reading
        finally:
            feed.close()
            pub.close(linger=0)

    asyncio.run(main())


async def until_async(cond, timeout_s: float = 5.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


def test_a_view_flooded_past_its_cap_starts_over():
    view = GpuView(lambda salt: "default", max_blocks=8)
    view.apply(stored(list(range(1, 7)), list(range(24))))
    assert len(view) == 6 and view.overflows == 0
    view.apply(stored([7, 8, 9], list(range(100, 112))))  # 9 blocks: past the cap
    assert len(view) == 0 and view.overflows == 1


def test_free_render_workers_go_to_the_tenants_waiting_in_turn():
    """One tenant's many renders queued first do not hold up another's: the next free worker goes
    to the next tenant waiting, not to the next request."""
    import asyncio

    from kvpool.connectors.route.render import Renderers

    async def main():
        r = Renderers(None, workers=1, timeout_s=5.0)
        r.start()  # no tokenizer: no process; the worker below is a stand-in
        worker, order = object(), []

        async def render(tenant: str, k: int) -> None:
            w = await r._take(tenant)
            assert w is worker
            order.append(f"{tenant}{k}")
            await asyncio.sleep(0)
            r._give(w)

        r._give(worker)
        first = asyncio.ensure_future(render("a", 0))  # takes the one worker
        waiting = [asyncio.ensure_future(render(t, k)) for t, k in (("a", 1), ("a", 2), ("a", 3), ("b", 0))]
        await asyncio.gather(first, *waiting)
        assert order == ["a0", "a1", "b0", "a2", "a3"]
        r.close()

    asyncio.run(main())
