"""KV blocks and what holds them: the model's cache spec, the block pool, the prefix
index, and cutting caches into blocks and assembling them back. Imports only
:mod:`..caches`."""
