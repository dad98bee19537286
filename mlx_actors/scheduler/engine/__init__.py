"""Running sequences: the ``BlockPoolBatchEngine`` (where each turn starts, prefill
jobs, the ``BatchGenerator``, finished caches cut into blocks), a turn alone (``Solo``),
pacing, streamed text and stops, constrained decoding, and the records that go in
and out. Imports :mod:`..kv` and :mod:`..caches`."""
