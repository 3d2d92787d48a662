"""Benchmarks and fault drivers of the cluster (``kvpool bench datapath|node``, ``kvpool chaos``, the soak):
apart from the pool's own actors and node path, which never import them."""
