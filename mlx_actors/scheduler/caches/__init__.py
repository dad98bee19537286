"""The cache kinds mlx-lm's models run on beyond its own: quantized caches (and
their kernels), dequantized attention, the sliding-window margin, and the gather that
rebuilds a cache from pieces of blocks. Imports nothing else of the scheduler."""
