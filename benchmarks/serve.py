"""Agent sessions over HTTP: ``mlx-actors serve`` against ``python -m mlx_lm server`` on the
same model and machine, driven by the same client code (the ``openai`` client, streaming).
Prints JSON.

    python benchmarks/serve.py --shape tiny --sessions 16 32 64            # CPU
    python benchmarks/serve.py --shape llama-3.2-1b --dtype bf16 --scale 1 # GPU

``--servers vllm-mlx --vllm-mlx PATH`` adds vllm-mlx's server (its continuous batching)
as a third column: it pins mlx-lm below 0.32, so it is installed in an environment of its
own (``python -m venv V && V/bin/pip install vllm-mlx mlx-cpu``) and ``PATH`` is its
``V/bin/vllm-mlx``. It reports no cached tokens, so its ``prefilled`` is ``null``.

Workloads (``--workloads``):

- ``bfcl``: multi-turn tool-calling sessions replayed from BFCL v4 (``multi_turn_base`` and
  ``multi_turn_long_context`` of the ``bfcl-eval`` wheel, read out of it): each session's
  functions as tools, its user turns, and for each turn the ground-truth calls as the
  assistant's message with results of realistic size, then the model's answer. Sessions
  arrive at random (Poisson, ``--rate`` per second). A random-weight model's replies mean
  nothing, so they are dropped: both servers see the same conversations.
- ``subagents``: a main agent with a long context (28K tokens at ``--scale 1``) and three
  sub-agents (6-7K) taking turns, the main agent after each (vllm-mlx #541's shape).
- ``prefix``: eight sessions on one warm 8K-token prefix asked at once (oMLX #3348's
  shape), twice: the spread of the second burst's first tokens, and its decoding speed
  against mlx-lm's bare ``BatchGenerator`` decoding the same eight (on a CUDA GPU in a
  process of its own, once with MLX's cuDNN attention and once without, as ``mlx-actors
  serve`` runs it). The first burst's spread and slowest first token are reported beside
  them: its requests open the client's connections (one is already open from the warm-up
  request, so that one may arrive first), and its shapes run for the first time in the
  server's process. ``--prefix-rounds K`` times K bursts after the first, with the bare
  decode measured in its own process after each: K paired ratios and their median, the
  figure to read on a machine whose speed drifts between runs (a shared CPU).

Figures: session completion time (mean, p95), time to first token (p50, p95), tokens
prefilled against the least a server that keeps every session's cache would prefill,
the server process's peak memory (RSS; on a GPU, also nvidia-smi's), and for mlx-actors
where its engine's time went (``engine``, read from its trace). On a CUDA GPU each kind
of server first serves a few other sessions untimed (``--warmup``): MLX compiles its
kernels at their first use on a machine and keeps them on disk, so without it the first
server timed would pay for every server after it. The model has
random weights of ``--shape`` with SmolLM2's tokenizer (BPE) and a ChatML template that
renders tools, so that both servers read the same prompts.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
from _models import DTYPES, SHAPES, run_facts

from mlx_actors.runtime import default_model_dir
from mlx_actors.testing import CHATML_TOOLS_TEMPLATE, write_random_model

BFCL = "bfcl-eval==2026.3.23"
#: ``python -m mlx_lm server`` with its defaults, and variants: a prompt cache of 64
#: caches (10 by default); prompts prefilled 512 tokens at a time, as mlx-actors does
#: (2048 by default: on an H100 its prompt batch ran out of memory on these sessions).
MLX_LM = {
    "mlx-lm": [],
    "mlx-lm-64": ["--prompt-cache-size", "64"],
    "mlx-lm-p512": ["--prefill-step-size", "512"],
    "mlx-lm-p512-64": ["--prefill-step-size", "512", "--prompt-cache-size", "64"],
    "mlx-lm-p512-nocudnn": ["--prefill-step-size", "512"],
}
#: Variants' environment: MLX's cuDNN attention off, as ``mlx-actors serve`` has it.
MLX_LM_ENV = {"mlx-lm-p512-nocudnn": {"MLX_CUDA_USE_CUDNN_SDPA": "0"}}

#: vllm-mlx's ``vllm-mlx`` executable (``--vllm-mlx``): it pins mlx-lm below 0.32, so it
#: lives in an environment of its own.
VLLM_MLX: str | None = None

#: Tokens each request generates (``--new-tokens``).
NEW_TOKENS = 32


# -- the model ------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> Path:
    """Random weights of ``--shape``, SmolLM2's tokenizer, a ChatML template with tools."""
    tokenizer_dir = args.tokenizer or default_model_dir()
    config = dict(SHAPES[args.shape])
    config["vocab_size"] = max(config["vocab_size"], 49152)
    config["eos_token_id"], config["bos_token_id"] = 2, 1
    path = Path(tempfile.mkdtemp(prefix="mlx-actors-serve-")) / args.shape
    write_random_model(path, config, seed=0, dtype=DTYPES[args.dtype])
    shutil.copy(Path(tokenizer_dir) / "tokenizer.json", path / "tokenizer.json")
    settings = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    settings["chat_template"] = CHATML_TOOLS_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def load_tokenizer(path: Path) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(path)


# -- the servers ----------------------------------------------------------------------------


class Server:
    """A server process, its readiness, and the peak memory it reached."""

    def __init__(
        self,
        kind: str,
        model: Path,
        port: int,
        extra: list[str],
        logs: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.kind, self.port = kind, port
        self.log = logs / f"{kind}-{port}.log"
        if kind == "mlx-actors":
            command = [sys.executable, "-m", "mlx_actors", "serve", str(model)]
            command += ["--port", str(port), "--model-name", str(model)]
            command += ["--max-tokens", str(NEW_TOKENS)]
            command += ["--trace", str(logs / f"{kind}-{port}.jsonl")]
        elif kind == "vllm-mlx":
            assert VLLM_MLX is not None  # main() checks it
            command = [VLLM_MLX, "serve", str(model), "--port", str(port)]
            command += ["--continuous-batching", "--offline"]
        else:
            command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
            command += ["--port", str(port), "--log-level", "WARNING", "--temp", "0"]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [*command, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **(env or {})},
            )
        self.trace = logs / f"{kind}-{port}.jsonl" if kind == "mlx-actors" else None
        self.url = f"http://127.0.0.1:{port}"
        self._gpu_peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_gpu, daemon=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind} exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5):
                    self._sampler.start()
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"{self.kind} did not start")

    def _sample_gpu(self) -> None:
        while not self._stop.wait(0.25):
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in out.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip() == str(self.process.pid):
                    self._gpu_peak = max(self._gpu_peak, int(used) << 20)

    def memory(self) -> dict[str, Any]:
        """Peak memory so far (read while the process lives)."""
        peak = 0
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) << 10
        except OSError:
            pass
        out = {"peak_rss_gb": round(peak / 1e9, 3)}
        if self._gpu_peak:
            out["peak_gpu_gb"] = round(self._gpu_peak / 1e9, 3)
        return out

    def stop(self) -> dict[str, Any]:
        """Stop the server; its peak memory."""
        memory = self.memory()
        self._stop.set()
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return memory


# -- the client -----------------------------------------------------------------------------


async def ask(
    client: openai.AsyncOpenAI,
    model: str,
    session: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    new_tokens: int | None = None,
) -> dict[str, Any]:
    """One streamed request: its timings and usage."""
    started = time.perf_counter()
    first = None
    usage = None
    options: dict[str, Any] = {"tools": tools} if tools else {}
    chunks = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=new_tokens or NEW_TOKENS,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        prompt_cache_key=session,
        **options,
    )
    last = None  # the last chunk carrying generated text (or calls)
    async for chunk in chunks:
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content or delta.tool_calls:
                last = time.perf_counter()
            if first is None and (last is not None or chunk.choices[0].finish_reason):
                first = last or time.perf_counter()
        usage = chunk.usage or usage
    ended = time.perf_counter()
    assert usage is not None
    details = usage.prompt_tokens_details  # None: the server does not say (vllm-mlx)
    cached = (details.cached_tokens or 0) if details is not None else None
    return {
        "session": session,
        "started": started,
        "ttft": (first or ended) - started,
        "seconds": ended - started,
        "prompt": usage.prompt_tokens,
        "prefilled": None if cached is None else usage.prompt_tokens - cached,
        "generated": usage.completion_tokens,
        "first_at": first or ended,
        "last_at": last or first or ended,
        "ended": ended,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def least_prefill(tokenizer: Any, requests: list[tuple[list[dict[str, Any]], Any]]) -> int:
    """What a server that keeps the session's cache must prefill: each request's tokens
    beyond what it shares with the one before it."""
    total, previous = 0, []
    for messages, tools in requests:
        tokens = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
        shared = 0
        for a, b in zip(previous, tokens):
            if a != b:
                break
            shared += 1
        total += len(tokens) - shared
        previous = list(tokens)
    return total


def engine_time(trace: Path) -> dict[str, Any]:
    """Where mlx-actors' engine spent the run, from its trace's ``batch.step`` events:
    seconds in steps (of the span from the first step to the last), in prefill jobs
    (and how many chunks they ran) and in the batch's model work, and the longest
    steps (a step holds up every sequence in flight)."""
    steps = []
    for line in trace.read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "batch.step":
            steps.append(event)
    if not steps:
        return {}
    span = _seconds(steps[-1]["timestamp"]) - _seconds(steps[0]["timestamp"])
    return {
        "steps": len(steps),
        "span_s": round(span + steps[0]["ms"] / 1e3, 2),
        "in_steps_s": round(sum(e["ms"] for e in steps) / 1e3, 2),
        "jobs_s": round(sum(e.get("jobs_ms", 0) for e in steps) / 1e3, 2),
        "job_chunks": sum(e.get("jobs", 0) for e in steps),
        "batch_s": round(sum(e.get("batch_ms", 0) for e in steps) / 1e3, 2),
        "longest_steps_ms": sorted((round(e["ms"]) for e in steps), reverse=True)[:5],
    }


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


# -- BFCL sessions --------------------------------------------------------------------------


def bfcl_data(args: argparse.Namespace) -> Path:
    """The BFCL wheel's data folder (downloaded with pip once)."""
    folder = Path(args.bfcl) if args.bfcl else Path(tempfile.gettempdir()) / "mlx-actors-bfcl"
    if (folder / "bfcl_eval" / "data").exists():
        return folder / "bfcl_eval" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", BFCL, "-d", str(folder)],
        check=True,
    )
    (wheel,) = folder.glob("bfcl_eval-*.whl")
    with zipfile.ZipFile(wheel) as zipped:
        for name in zipped.namelist():
            if "multi_turn" in name and name.endswith(".json"):
                zipped.extract(name, folder)
    return folder / "bfcl_eval" / "data"


def _tool(doc: dict[str, Any]) -> dict[str, Any]:
    types = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: fix(v) for k, v in node.items()}
            if isinstance(out.get("type"), str):
                out["type"] = types.get(out["type"], out["type"])
            return out
        return [fix(v) for v in node] if isinstance(node, list) else node

    return {
        "type": "function",
        "function": {
            "name": doc["name"],
            "description": doc["description"],
            "parameters": fix(doc["parameters"]),
        },
    }


def _call(text: str, tools: dict[str, dict[str, Any]], call_id: str) -> dict[str, Any]:
    node = ast.parse(text, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    name = node.func.id
    names = list(tools[name]["function"]["parameters"].get("properties", {}))
    arguments = {names[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    arguments.update({k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg})
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def bfcl_sessions(data: Path, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` sessions: each its tools and, per user turn, its messages and the calls."""
    docs: dict[str, list[dict[str, Any]]] = {}
    classes = {
        "GorillaFileSystem": "gorilla_file_system",
        "MathAPI": "math_api",
        "MessageAPI": "message_api",
        "TwitterAPI": "posting_api",
        "TicketAPI": "ticket_api",
        "TradingBot": "trading_bot",
        "TravelAPI": "travel_booking",
        "VehicleControlAPI": "vehicle_control",
    }
    for cls, file in classes.items():
        lines = (data / "multi_turn_func_doc" / f"{file}.json").read_text().splitlines()
        docs[cls] = [json.loads(line) for line in lines if line.strip()]
    entries = []
    for category in ("multi_turn_base", "multi_turn_long_context"):
        questions = (data / f"BFCL_v4_{category}.json").read_text().splitlines()
        answers = (data / "possible_answer" / f"BFCL_v4_{category}.json").read_text().splitlines()
        for q, a in zip(questions, answers):
            entries.append((category, json.loads(q), json.loads(a)["ground_truth"]))
    rng = random.Random(seed)
    rng.shuffle(entries)
    sessions = []
    for i, (category, entry, truth) in enumerate(entries[:n]):
        excluded = set(entry.get("excluded_function", []))
        tools = [
            _tool(d)
            for cls in entry["involved_classes"]
            for d in docs.get(cls, [])
            if d["name"] not in excluded
        ]
        by_name = {t["function"]["name"]: t for t in tools}
        long = category.endswith("long_context")
        turns = []
        for t, (asked, calls) in enumerate(zip(entry["question"], truth)):
            made = [_call(c, by_name, f"call{i}x{t}x{j}") for j, c in enumerate(calls)]
            results = [
                # results of realistic size: most short, some long (long context: longer)
                json.dumps(
                    {"result": _words(rng, int(rng.lognormvariate(5.5 if long else 4.5, 1)))}
                )
                for _ in made
            ]
            turns.append({"user": list(asked), "calls": made, "results": results})
        sessions.append({"id": f"bfcl{i}", "tools": tools, "turns": turns})
    return sessions


def _words(rng: random.Random, n: int) -> str:
    vocabulary = ["file", "report", "budget", "data", "value", "error", "line", "folder"]
    return " ".join(rng.choice(vocabulary) for _ in range(max(1, min(n, 2000))))


async def run_bfcl(
    client: openai.AsyncOpenAI, model: str, sessions: list[dict[str, Any]], rate: float, seed: int
) -> tuple[list[dict[str, Any]], list[float], list[list[tuple[list[dict[str, Any]], Any]]]]:
    """Every session, arriving at random: its requests, completion times and prompts."""
    rng = random.Random(seed)
    arrivals, at = [], 0.0
    for _ in sessions:
        arrivals.append(at)
        at += rng.expovariate(rate)
    records: list[dict[str, Any]] = []
    durations: list[float] = []
    prompts: list[list[tuple[list[dict[str, Any]], Any]]] = [[] for _ in sessions]
    begin = time.perf_counter()

    async def one(k: int, session: dict[str, Any]) -> None:
        await asyncio.sleep(arrivals[k])
        start = time.perf_counter()
        messages: list[dict[str, Any]] = []
        tools = session["tools"]
        # A session's name holds the run's seed: a later run of more sessions on the same
        # server starts each session anew (its agent does not already hold the conversation).
        name = f"{seed}-{session['id']}"

        async def request() -> None:
            prompts[k].append(([dict(m) for m in messages], tools))
            records.append(await ask(client, model, name, messages, tools))

        for turn in session["turns"]:
            if not turn["user"]:
                continue
            messages.extend(turn["user"])
            await request()
            if turn["calls"]:
                messages.append({"role": "assistant", "content": None, "tool_calls": turn["calls"]})
                for call, result in zip(turn["calls"], turn["results"]):
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                await request()
            messages.append({"role": "assistant", "content": "Done."})
        durations.append(time.perf_counter() - start)

    await asyncio.gather(*(one(k, s) for k, s in enumerate(sessions)))
    del begin
    return records, durations, prompts


# -- main agent and sub-agents; one warm prefix ---------------------------------------------


def _document(rng: random.Random, tokenizer: Any, tokens: int) -> str:
    words = ["the", "of", "agent", "plan", "result", "data", "model", "memory", "cache"]
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(words) for _ in range(tokens // 2)) + "\n"
    ids = tokenizer.encode(text)[:tokens]
    return str(tokenizer.decode(ids))


async def run_subagents(
    client: openai.AsyncOpenAI, model: str, tokenizer: Any, scale: float, rounds: int
) -> dict[str, Any]:
    rng = random.Random(1)
    contexts = {"main": int(28_000 * scale)}
    contexts.update({f"sub{i}": int((6_000 + 500 * i) * scale) for i in range(3)})
    conversations = {
        name: [{"role": "system", "content": _document(rng, tokenizer, size)}]
        for name, size in contexts.items()
    }
    records = []
    for r in range(rounds):
        for i in range(3):
            for name, line in ((f"sub{i}", f"Round {r}: do part {i}."), ("main", f"Sub {i} done.")):
                conversations[name].append({"role": "user", "content": line})
                record = await ask(client, model, name, conversations[name], None)
                record["turn"] = r
                records.append(record)
                conversations[name].append({"role": "assistant", "content": "Noted."})
    later = [x for x in records if x["turn"] > 0]
    return {
        "contexts": contexts,
        "first_ttft_s": {x["session"]: round(x["ttft"], 3) for x in records if x["turn"] == 0},
        "later_ttft_p50_s": round(statistics.median(x["ttft"] for x in later), 4),
        "later_ttft_max_s": round(max(x["ttft"] for x in later), 4),
        "later_max_prefilled": _known(max, [x["prefilled"] for x in later]),
        "total_s": round(sum(x["seconds"] for x in records), 3),
    }


async def run_prefix(
    client: openai.AsyncOpenAI,
    model: str,
    tokenizer: Any,
    prefix_tokens: int,
    streams: int,
    new_tokens: int,
    rounds: int = 1,
    bare: Callable[[], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Bursts of ``streams`` new sessions on the warm prefix, one after the other: the
    figures are the second's (a server that has served such a burst before); the first
    burst's spread and slowest first token are kept beside them (a server process's
    first burst of these shapes). With ``rounds`` above one, ``rounds`` timed bursts
    follow the first, and ``bare`` (mlx-lm's bare decode, in a process of its own)
    runs after each: ``rounds`` paired ratios, each of a burst and the bare decode
    measured right after it, so that the machine's drift weighs on both alike."""
    document = _document(random.Random(2), tokenizer, prefix_tokens)
    system = {"role": "system", "content": document}
    await ask(client, model, "warm", [system, {"role": "user", "content": "Ready?"}], None)
    bursts = []
    pairs: list[dict[str, float]] = []
    for burst in range(1 + rounds):
        questions = [_question(burst, i) for i in range(streams)]
        records = await asyncio.gather(
            *(
                ask(
                    client,
                    model,
                    f"p{burst}-{i}",
                    [system, {"role": "user", "content": q}],
                    None,
                    new_tokens,
                )
                for i, q in enumerate(questions)
            )
        )
        bursts.append(records)
        if burst > 0 and rounds > 1 and bare is not None:
            pairs.append({"server": _decode_rate(records), **await asyncio.to_thread(bare)})
    first, records = bursts[0], bursts[1]
    out = {
        "first_token_spread_ms": _spread_ms(records),
        "ttft_max_s": round(max(x["ttft"] for x in records), 3),
        "decode_tokens_per_s": _decode_rate(records),
        "prefilled": [x["prefilled"] for x in records],
        "first_burst_spread_ms": _spread_ms(first),
        "first_burst_ttft_max_s": round(max(x["ttft"] for x in first), 3),
    }
    if pairs:
        key = "bare_batch_decode_tokens_per_s"
        ratios = [round(x["server"] / x[key], 3) for x in pairs]
        out["rounds"] = pairs
        out["decode_over_bare"] = ratios
        out["decode_over_bare_median"] = round(statistics.median(ratios), 3)
    return out


def _decode_rate(records: list[dict[str, Any]]) -> float:
    """Tokens/s summed over ``records``, from each one's first generated text to its last,
    as the bare decode counts (the end of the stream, after the usage, would add the
    server's end of turn)."""
    return round(sum((x["generated"] - 1) / (x["last_at"] - x["first_at"]) for x in records), 1)


def _question(burst: int, i: int) -> str:
    """The prefix workload's question ``i`` of burst ``burst`` (the timed burst is 1)."""
    return f"Burst {burst}, question {i}: what does part {i} say?"


def _known(total: Any, values: list[int | None]) -> int | None:
    """``total(values)``, or ``None`` if a server did not report one of them."""
    return None if None in values else int(total(values))


def _spread_ms(records: list[dict[str, Any]]) -> float:
    """Milliseconds between the first and the last first token of ``records``."""
    firsts = [x["first_at"] for x in records]
    return round(1000 * (max(firsts) - min(firsts)), 1)


def bare_batch_decode(model_dir: Path, prefix_tokens: int, streams: int, new_tokens: int) -> float:
    """mlx-lm's BatchGenerator decoding ``streams`` sequences on a warm prefix: tokens/s
    after each sequence's first token, summed."""
    import copy

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = mlx_lm.load(str(model_dir))
    document = _document(random.Random(2), tokenizer, prefix_tokens)
    prompts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": document},
                {"role": "user", "content": _question(1, i)},
            ],
            add_generation_prompt=True,
        )
        for i in range(streams)
    ]
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    cache = make_prompt_cache(model)
    model(mx.array([prompts[0][:shared]]), cache=cache)
    mx.eval([c.state for c in cache])
    generator = BatchGenerator(model, max_tokens=new_tokens, stop_tokens=[])
    uids = generator.insert(
        [p[shared:] for p in prompts],
        [new_tokens] * streams,
        caches=[copy.deepcopy(cache) for _ in prompts],
    )
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts = dict.fromkeys(uids, 0)
    finished: set[int] = set()
    while len(finished) < streams:
        _, responses = generator.next()
        now = time.perf_counter()
        for response in responses:
            counts[response.uid] += 1
            first.setdefault(response.uid, now)
            last[response.uid] = now
            if response.finish_reason is not None:
                finished.add(response.uid)
    generator.close()
    return sum((counts[u] - 1) / (last[u] - first[u]) for u in uids)


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    global NEW_TOKENS, VLLM_MLX
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--tokenizer", help="a model directory whose tokenizer to use")
    parser.add_argument("--bfcl", help="a folder holding bfcl_eval/data (else downloaded)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--rate", type=float, default=2.0, help="sessions arriving per second")
    parser.add_argument("--scale", type=float, default=0.25, help="sub-agent contexts (1: 28K)")
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument(
        "--prefix-rounds",
        type=int,
        default=1,
        help="timed bursts of the prefix workload; above 1, mlx-lm's bare decode is "
        "measured after each (paired ratios, their median)",
    )
    parser.add_argument("--workloads", nargs="+", default=["bfcl", "subagents", "prefix"])
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["mlx-actors", "mlx-lm", "mlx-lm-64"],
        choices=["mlx-actors", *MLX_LM, "vllm-mlx"],
        help="mlx-lm's server with its defaults, one of its variants (MLX_LM), or vllm-mlx's",
    )
    parser.add_argument(
        "--vllm-mlx",
        help="vllm-mlx's executable (installed in an environment of its own), for "
        "--servers vllm-mlx: its continuous batching",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="BFCL sessions each kind of server serves, untimed, before any is timed "
        "(default: 4 on a CUDA GPU, whose kernels MLX compiles at first use, else 0)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--bare-decode", type=Path, help=argparse.SUPPRESS)  # a child run
    parser.add_argument(
        "--logs", type=Path, help="where the servers' output and mlx-actors' trace go"
    )
    args = parser.parse_args()
    if args.bare_decode is not None:  # bare_decode_rates' child: the rate, then exit
        print(round(bare_batch_decode(args.bare_decode, args.prefix_tokens, 8, 64), 1))
        return
    args.model = None
    NEW_TOKENS = args.new_tokens
    VLLM_MLX = args.vllm_mlx
    if "vllm-mlx" in args.servers and VLLM_MLX is None:
        parser.error("--servers vllm-mlx needs --vllm-mlx PATH (its executable)")
    model_dir = build_model(args)
    tokenizer = load_tokenizer(model_dir)
    facts = run_facts("serve", args)
    results: dict[str, Any] = {**facts, "new_tokens": NEW_TOKENS, "servers": {}}
    if args.warmup is None:
        import mlx.core as mx

        args.warmup = 4 if mx.cuda.is_available() else 0
    results["warmup_sessions"] = args.warmup
    sessions = (
        bfcl_sessions(bfcl_data(args), max(args.sessions) + args.warmup, seed=0)
        if "bfcl" in args.workloads
        else []
    )
    warm, sessions = sessions[len(sessions) - args.warmup :], sessions[: max(args.sessions)]
    logs = args.logs or Path(tempfile.mkdtemp(prefix="serve-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    port = 8700
    if warm:
        for kind in args.servers:
            port += 1
            warm_up(kind, model_dir, port, warm, logs / "warmup")
    for kind in args.servers:
        port += 1
        extra = MLX_LM.get(kind, [])
        name = "mlx-lm" if kind.startswith("mlx-lm") else kind
        server = Server(name, model_dir, port, extra, logs, MLX_LM_ENV.get(kind))
        out: dict[str, Any] = {}
        try:
            server.wait_ready()
            out = asyncio.run(_drive(server.url, str(model_dir), tokenizer, sessions, args))
        except Exception as exc:  # one server's failure: its figures say so, the next runs
            out["error"] = repr(exc)[:500]
        finally:
            out["memory"] = server.stop()
            if server.trace is not None and server.trace.exists():
                out["engine"] = engine_time(server.trace)
        results["servers"][kind] = out
        print(json.dumps({kind: out}), file=sys.stderr, flush=True)
    if "prefix" in args.workloads:
        results.update(bare_decode_rates(model_dir, args.prefix_tokens))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


def bare_decode_rates(model_dir: Path, prefix_tokens: int) -> dict[str, float]:
    """mlx-lm's bare ``BatchGenerator`` on the prefix workload's eight sequences, in a
    process of its own, as the server runs. On a CUDA GPU twice: with MLX's cuDNN
    attention (its default) and without (as ``mlx-actors serve`` runs), since decoding on
    long caches may take either. On a shared CPU the machine's own speed drifts by a
    fifth or more within minutes, and this runs after the servers: one run's ratio of a
    server's decoding to it carries that drift."""
    import mlx.core as mx

    rates = {}
    child = [sys.executable, __file__, "--bare-decode", str(model_dir)]
    child += ["--prefix-tokens", str(prefix_tokens)]
    kinds = (("", "1"), ("_no_cudnn", "0")) if mx.cuda.is_available() else (("", None),)
    for key, cudnn in kinds:
        done = subprocess.run(
            child,
            capture_output=True,
            text=True,
            check=True,
            env=os.environ if cudnn is None else {**os.environ, "MLX_CUDA_USE_CUDNN_SDPA": cudnn},
        )
        rates[f"bare_batch_decode{key}_tokens_per_s"] = float(done.stdout.split()[-1])
    return rates


def warm_up(
    kind: str, model_dir: Path, port: int, sessions: list[dict[str, Any]], logs: Path
) -> None:
    """A throwaway server of ``kind`` serves ``sessions`` (others than the timed ones)
    first: MLX compiles its GPU kernels at their first use and keeps them on disk for
    the machine, so that no server is timed compiling what it or another would find
    compiled on a machine that had served before."""
    logs.mkdir(parents=True, exist_ok=True)
    name = "mlx-lm" if kind.startswith("mlx-lm") else kind
    server = Server(name, model_dir, port, MLX_LM.get(kind, []), logs, MLX_LM_ENV.get(kind))
    try:
        server.wait_ready()

        async def serve_them() -> None:
            async with openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600
            ) as client:
                await run_bfcl(client, str(model_dir), sessions, rate=8.0, seed=1)

        asyncio.run(serve_them())
    finally:
        server.stop()


async def _drive(
    url: str, model: str, tokenizer: Any, sessions: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600
    ) as client:
        if "bfcl" in args.workloads:
            for n in args.sessions:
                records, durations, prompts = await run_bfcl(
                    client, model, sessions[:n], args.rate, seed=n
                )
                least = sum(least_prefill(tokenizer, p) for p in prompts)
                ttfts = [x["ttft"] for x in records]
                out[f"bfcl_{n}"] = {
                    "requests": len(records),
                    "session_mean_s": round(statistics.mean(durations), 3),
                    "session_p95_s": round(percentile(durations, 0.95), 3),
                    "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
                    "ttft_p95_s": round(percentile(ttfts, 0.95), 4),
                    "prompt_tokens": sum(x["prompt"] for x in records),
                    "prefilled": _known(sum, [x["prefilled"] for x in records]),
                    "least_prefill": least,
                }
                print(json.dumps({f"bfcl_{n}": out[f"bfcl_{n}"]}), file=sys.stderr, flush=True)
        if "subagents" in args.workloads:
            out["subagents"] = await run_subagents(client, model, tokenizer, args.scale, 3)
        if "prefix" in args.workloads:
            out["prefix"] = await run_prefix(
                client,
                model,
                tokenizer,
                args.prefix_tokens,
                8,
                64,
                args.prefix_rounds,
                lambda: bare_decode_rates(Path(model), args.prefix_tokens),
            )
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
