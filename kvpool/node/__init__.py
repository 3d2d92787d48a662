"""The engine side of a node: what an engine process needs to use its node's shard without Ray (shared-memory page
table, local socket)."""
