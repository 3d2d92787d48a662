"""``kvpool warmup FILE``: preload and pin prefixes (system prompts, tool schemas) before traffic.

FILE holds one JSON object per line: ``{"tenant": "a", "tokens": [1, 2, ...]}``, with
``"shared": true`` for a prefix published to every tenant. The model computes each prefix's KV
once (transformers connector), the pool stores its whole chunks, and each shard's policy pins
what fits under its pinned cap (zoned policies, e.g. ``tiered``; others store without pinning).
"""

from __future__ import annotations

import json

from kvpool.auth import Authority
from kvpool.errors import BadRequest, Unavailable
from kvpool.progress import Progress


def load_entries(path: str) -> list[dict]:
    """The prefixes of FILE, checked line by line (the error names the line)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise BadRequest(f"cannot read warm-up file {path!r}: {e.strerror}") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadRequest(f"{path}:{no}: not JSON ({err.msg})") from None
        if not isinstance(e, dict) or not isinstance(e.get("tenant"), str):
            raise BadRequest(f'{path}:{no}: each line is {{"tenant": "...", "tokens": [...]}}')
        toks = e.get("tokens")
        if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and t >= 0 for t in toks):
            raise BadRequest(f"{path}:{no}: 'tokens' must be a non-empty list of token ids (non-negative ints)")
        out.append({"tenant": e["tenant"], "tokens": toks, "shared": bool(e.get("shared", False))})
    if not out:
        raise BadRequest(f"warm-up file {path!r} holds no prefixes")
    return out


def warmup(conn, entries: list[dict], *, pin: bool = True, progress: bool = True) -> dict:
    """Stores (and pins) each prefix's whole chunks; totals."""
    c = conn.spec.chunk_tokens
    stored = pinned = skipped = 0
    with Progress(len(entries), "warmup", enabled=progress) as bar:
        for e in entries:
            whole = len(e["tokens"]) // c
            if not whole:
                skipped += 1  # shorter than a chunk: nothing to keep
                bar.advance()
                continue
            # Only whole chunks are kept: the tail past them is not computed (but one token).
            toks = e["tokens"][: whole * c + 1] if len(e["tokens"]) > whole * c else e["tokens"]
            who = e.get("credential", e["tenant"])  # on a secured pool, an operator's credential for the tenant
            r = conn.prefill(toks, tenant=who, shared=e["shared"])
            stored += r.saved_chunks
            if pin:
                keys = conn.pool.keys(who, e["tokens"], shared=e["shared"])[:whole]
                pinned += conn.pool.pin(who, keys)
            bar.advance(note=e["tenant"])
    return {"prefixes": len(entries), "skipped": skipped, "stored_chunks": stored, "pinned_chunks": pinned}


def run(path: str, model: str = "demo", *, model_id: str | None = None, chunk_tokens: int = 64,
        pool: str = "default", shard: str | None = None, run_dir: str | None = None, ray_address: str | None = None,
        pin: bool = True, progress: bool = True) -> dict:
    """Warm-up of a running pool (``kvpool up``) from FILE, through a node's shard as an engine
    reaches it: this node's (found in ``run_dir``), or, with ``ray_address`` (a Job off the pool's
    nodes), a pool node's, where it runs as a Ray task (kvpool.cluster.ops.on_a_pool_node)."""
    entries = load_entries(path)
    if ray_address is None:
        return warm_here(entries, model, model_id, chunk_tokens, pool, shard, run_dir, pin, progress)
    from kvpool.cluster import ops

    return ops.on_a_pool_node(ray_address, warm_here, with_credentials(entries, required=False), model, model_id,
                              chunk_tokens, pool, pin=pin, progress=False)


def with_credentials(entries: list[dict], required: bool = True) -> list[dict]:
    """The entries with an operator credential of each one's tenant (warm-up acts in each tenant's
    account), issued from the pool secret; unchanged when there is none and it is not ``required``."""
    from kvpool.auth_cli import find_secret

    try:
        auth = Authority(find_secret()[0])
    except BadRequest:  # it names where the secret goes
        if required:
            raise
        return entries
    return [{**e, "credential": auth.issue(e["tenant"], "operator")} for e in entries]


def warm_here(entries: list[dict], model: str, model_id: str | None, chunk_tokens: int, pool: str = "default",
              shard: str | None = None, run_dir: str | None = None, pin: bool = True, progress: bool = True) -> dict:
    """:func:`warmup` through the shard of the node this process runs on."""
    import torch

    from kvpool.connectors.hf import HFConnector
    from kvpool.connectors.hf_model import model_spec
    from kvpool.connectors.pools import node_pool
    from kvpool.node.client import NodeClient
    from kvpool.node.probe import wait_until_up
    from kvpool.tenants import Tenant

    torch.set_flush_denormal(True)
    m = load_model(model)
    spec = model_spec(m, model_id=model_id or ("kvpool/demo-llama" if model == "demo" else model),
                      chunk_tokens=chunk_tokens)
    client = NodeClient(pool=pool, shard=shard, directory=run_dir, timeout_s=10.0)
    try:
        why = wait_until_up(client, 10.0)
        if why is not None:
            raise Unavailable(f"warm-up needs the pool's shard on this node: {why}")
        pool = node_pool(spec, client, [Tenant(t) for t in sorted({e["tenant"] for e in entries})])
        if pool.secured and not all("credential" in e for e in entries):
            entries = with_credentials(entries)
        return warmup(HFConnector(m, pool), entries, pin=pin, progress=progress)
    finally:
        client.close()


def load_model(name: str):
    """``demo`` (the demo's random-weight Llama) or a local transformers model directory."""
    if name == "demo":
        from kvpool.connectors.demo.run import demo_model

        return demo_model()
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name).eval()
    except OSError as e:
        raise BadRequest(f"cannot load model {name!r} ({e}): give a local model directory or 'demo'") from None
