"""The cache kinds mlx-lm's models run on beyond its own: quantized caches (and
their kernels), dequantized attention, the sliding-window margin, and the gather that
rebuilds a cache from pieces of blocks. Imports nothing else of the scheduler."""

from ._margin import MarginBatchRotatingKVCache as MarginBatchRotatingKVCache
from ._margin import MarginRotatingKVCache as MarginRotatingKVCache
from ._quantized import BatchQuantizedKVCache as BatchQuantizedKVCache
from ._quantized import BlockQuantizedKVCache as BlockQuantizedKVCache
from ._quantized import KVQuantization as KVQuantization
