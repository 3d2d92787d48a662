"""Engine connectors (vLLM, SGLang, transformers): the only place that imports an engine.

Installed as ``kvpool.connectors``.
"""
