"""ModelCacheSpec read off real models."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

from mlx_actors.errors import UnsupportedModelError
from mlx_actors.scheduler import LayerKind, ModelCacheSpec
from mlx_actors.testing import write_random_model

from ..conftest import Loaded


def test_spec_of_the_tiny_llama(tiny: Loaded) -> None:
    spec = tiny.spec
    assert spec.num_layers == 3
    assert {layer.kind for layer in spec.layers} == {LayerKind.GLOBAL}
    layer = spec.layers[0]
    assert (layer.kv_heads, layer.key_dim, layer.value_dim, layer.dtype) == (2, 16, 16, mx.float32)
    assert spec.block_bytes == 2 * (16 + 16) * 4 * 256
    assert spec.context_length == 4096
    assert spec.blocks_held(1) == 3 and spec.blocks_held(257) == 6


#: A tiny Mamba: every layer keeps a recurrent state (ArraysCache), not a KV cache.
MAMBA = {
    "model_type": "mamba",
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "state_size": 8,
    "num_hidden_layers": 2,
    "conv_kernel": 4,
    "use_bias": False,
    "use_conv_bias": True,
    "time_step_rank": 4,
}


def test_a_recurrent_model_is_refused(tmp_path) -> None:
    model, _ = mlx_lm.load(str(write_random_model(tmp_path / "mamba", MAMBA)))
    with pytest.raises(UnsupportedModelError, match="ArraysCache"):
        ModelCacheSpec.from_model(model)
