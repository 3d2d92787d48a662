"""Benchmarks and checks of the engine connectors (``kvpool bench ttft|weights|sliding|quality|importance``,
the GPU checks): apart from the connectors themselves, which never import them."""
