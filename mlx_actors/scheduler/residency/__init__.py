"""Caches out of the pool: a cache as host memory (an image) and back into blocks,
the copies between device and host, and the host tier of evicted caches. Imports
:mod:`..kv`."""
