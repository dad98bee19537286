"""The scheduler: cache spec, pool, blocks, engine, caches, sharing, history reuse and
constraints, against mlx-lm."""
