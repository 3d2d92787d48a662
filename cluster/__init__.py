"""The Ray layer (shard and controller actors, hash ring, pool client).

Installed as ``kvpool.cluster``. Empty until the cluster issue.
"""
