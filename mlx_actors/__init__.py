"""mlx-actors: multi-agent programs on local MLX language models.

Agents are long-lived actors that keep their conversation and KV cache (as blocks of a
shared pool); one scheduler batches every agent's turns through mlx-lm. The public API
is what this module re-exports; the subpackages ``scheduler``, ``actors`` and
``runtime`` are its three layers.
"""

from . import errors as errors

__version__ = "0.1.0"
