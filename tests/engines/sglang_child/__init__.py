"""The SGLang checks that run in a child pytest process (see ``tests/engines/test_sglang.py``).

Nothing here is collected by a plain ``pytest tests/engines``: no file name starts with ``test_``.
"""
