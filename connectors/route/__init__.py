"""``kvpool route``: an OpenAI-compatible router in front of several vLLM servers that sends each
request where its prefix is cheapest, against load (:mod:`kvpool.routing` decides; this package
feeds it).

- :mod:`.plan`: a request's tenant (from its ``cache_salt``), tokens (:mod:`.prompts`) and where
  the pool holds its leading chunks (keys of the engines' spec: :mod:`.spec`);
- :mod:`.fleet`: the instances' health and load, and their own GPU caches from vLLM's KV events
  (:mod:`.events`, :mod:`.gpu`);
- :mod:`.costs`: seconds per token by tier, measured on the requests routed;
- :mod:`.proxy`: the HTTP service (aiohttp); :mod:`.figures`: its Prometheus metrics;
  :mod:`.main`: ``kvpool route``.

It needs no vLLM and no Ray: the pool is asked through the router's node's shard.
"""
