"""Running sequences: the ``BlockPoolBatchEngine`` (where each turn starts, prefill
jobs, the ``BatchGenerator``, finished caches cut into blocks), a turn alone (``Solo``),
pacing, streamed text and stops, constrained decoding, and the records that go in
and out. Imports :mod:`..kv` and :mod:`..caches`."""

from ._engine import BlockPoolBatchEngine as BlockPoolBatchEngine
from ._pacing import Pacing as Pacing
from ._pacing import chunk as chunk
from ._text import TextStream as TextStream
