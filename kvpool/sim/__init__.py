"""The trace simulator behind ``kvpool sim``: replays requests through the pool's own cache and
policy code, with the infinite-cache and offline-optimal (Belady) hit rates beside them."""
