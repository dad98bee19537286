"""Random-weight models of real shapes for the benchmarks (written once to a temp dir)."""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_actors.testing import family_configs, tiny_config, write_random_model

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": tiny_config(
        num_hidden_layers=4,
        hidden_size=128,
        intermediate_size=256,
        head_dim=32,
        max_position_embeddings=131072,
    ),
    "smollm2-135m": tiny_config(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": tiny_config(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # The tests' tiny Gemma 3 (5 sliding-window layers of 64 tokens to 1 global).
    "tiny-gemma3": family_configs(64)["gemma3_text"],
    # A small Gemma 3 for CPU runs: 10 sliding-window layers (512 tokens) and 2 global
    # ones, heads of 128 (quantizable in groups of 64).
    "small-gemma3": tiny_config(
        "gemma3_text",
        hidden_size=256,
        num_hidden_layers=12,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=128,
        max_position_embeddings=32768,
    ),
    # Gemma-3-1B: 5 sliding-window layers (512 tokens) to 1 global, one KV head of 256.
    "gemma-3-1b": tiny_config(
        "gemma3_text",
        hidden_size=1152,
        num_hidden_layers=26,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
    ),
}
DTYPES = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}


def random_model(shape: str, dtype: str) -> Path:
    """A model directory of ``shape`` with random ``dtype`` weights."""
    path = Path(tempfile.mkdtemp(prefix=f"mlx-actors-{shape}-")) / "model"
    return write_random_model(path, SHAPES[shape], seed=0, dtype=DTYPES[dtype])


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu:  # type: ignore[comparison-overlap]
        info = mx.device_info() if hasattr(mx, "device_info") else {}
        return str(info.get("device_name", "gpu"))
    return "cpu"


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--shape``, ``--dtype`` and ``--model``: which model a benchmark runs."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--model", type=Path, help="a model directory instead of --shape")


def run_facts(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a benchmark's JSON starts with: the model and the machine it ran on."""
    return {
        "benchmark": name,
        "shape": args.shape if args.model is None else str(args.model),
        "dtype": args.dtype,
        "device": device_name(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
    }
