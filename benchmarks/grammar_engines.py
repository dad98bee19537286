"""llguidance, outlines-core and xgrammar, JSON-schema constrained decoding on the CPU.

Each engine, in a fresh process (cold imports, its own RSS), prepares the tokenizer, then
per schema compiles it (cold, then --repeat more) and walks one fixed valid reply (compact
JSON, tokenised): per token the next-token mask, then the advance. Each engine must allow
every token of the reply and end-of-sequence after it (else a warning on stderr: they
would not constrain the same language). No free whitespace anywhere. Engines not
installed are reported missing. Prints JSON; needs transformers, not mlx-actors.

    python benchmarks/grammar_engines.py [--tokenizer DIR ...] [--repeat 10]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2 = Path.home() / ".cache/mlx-actors/models/SmolLM2-135M-Instruct-Q4_1"
STR, INT, NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A closed object whose properties are all required (one order, one language)."""
    closed = {"required": list(props), "additionalProperties": False}
    return {"type": "object", "properties": props} | extra | closed


ITEMS = {"type": "array", "items": obj({"sku": STR, "qty": INT}), "maxItems": 8}
ADD = obj({"name": {"const": "add"}, "arguments": obj({"a": NUM, "b": NUM})})
SEARCH = obj({"name": {"const": "search"}, "arguments": obj({"query": STR, "limit": INT})})
# name: (schema, the fixed reply)
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        obj({"name": {"type": "string", "maxLength": 40}, "age": INT}),
        {"name": "Ada Lovelace, Countess of Lovelace", "age": 36},
    ),
    "enum_nested_array": (
        obj({"status": {"enum": ["open", "closed", "pending"]}, "items": ITEMS}),
        {"status": "pending", "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}]},
    ),
    "pydantic_defs_ref": (
        obj(
            {
                "name": {"title": "Name", "type": "string"},
                "address": {"$ref": "#/$defs/Address"},
                "nickname": {"anyOf": [STR, {"type": "null"}], "default": None},
                "tags": {"title": "Tags", "type": "array", "items": STR},
            },
            title="Person",
            **{"$defs": {"Address": obj({"street": STR, "city": STR}, title="Address")}},
        ),
        {"name": "Grace Hopper", "address": {"street": "1 Navy Way", "city": "Arlington"}}
        | {"nickname": None, "tags": ["cobol", "compilers", "nanoseconds"]},
    ),
    "anyof_tool_calls": (
        {"anyOf": [ADD, SEARCH]},
        {"name": "search", "arguments": {"query": "grammar engines on the CPU", "limit": 5}},
    ),
}


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + n for n in range(len(rest))])}


#: A compiled schema as its matcher's two calls: fill a mask, advance with a token.
Matcher = tuple[Callable[[Any], object], Callable[[int], object]]


class Llguidance:
    dist = "llguidance"

    def prepare(self, tok: Any, n_vocab: int) -> None:
        import llguidance.hf

        eos = tok.eos_token_id
        self.ll, self.tok = llguidance, llguidance.hf.from_tokenizer(tok, n_vocab, eos_token=eos)

    def compile(self, schema: dict[str, Any]) -> Matcher:
        from llguidance.numpy import fill_next_token_bitmask

        # As mlx_actors/scheduler/engine/_schema.py: no free whitespace.
        compact: Any = {"whitespace_flexible": False}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        m = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return lambda mask: fill_next_token_bitmask(m, mask, 0), m.consume_token


class OutlinesCore:
    dist = "outlines-core"

    def prepare(self, tok: Any, n_vocab: int) -> None:
        # Vocabulary.from_pretrained fetches from the hub: the token bytes are built here,
        # as outlines does (byte-level BPE only; special tokens left out).
        from outlines_core import Vocabulary

        dec, special = byte_decoder(), set(tok.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i not in special and i < n_vocab:
                raw = bytes(dec[c] for c in text) if set(text) <= dec.keys() else text.encode()
                vocab.setdefault(raw, []).append(i)
        self.vocab = Vocabulary(tok.eos_token_id, vocab)

    def compile(self, schema: dict[str, Any]) -> Matcher:
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        g = Guide(Index(build_regex_from_schema(json.dumps(schema), ""), self.vocab))
        return (
            lambda mask: g.write_mask_into(mask.ctypes.data, mask.size, 4),
            lambda token: g.advance(token, return_tokens=False),  # no list of allowed tokens
        )


class Xgrammar:
    dist = "xgrammar"

    def prepare(self, tok: Any, n_vocab: int) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=n_vocab)
        # No cache: each compile is a real one (by default it caches by schema).
        self.xgr, self.compiler = xgrammar, xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Matcher:
        grammar = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )
        m = self.xgr.GrammarMatcher(grammar)
        return m.fill_next_token_bitmask, m.accept_token  # a numpy mask (DLPack), no torch


ENGINES: dict[str, Any] = {e.dist: e for e in (Llguidance, OutlinesCore, Xgrammar)}


def rss_mb() -> float:
    """The resident set now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def p50_p95(name: str, samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {f"{name}_p50": q[49], f"{name}_p95": q[94]}


Walk = tuple[float, list[tuple[float, float]], list[str], bool]


def walk(engine: Any, schema: dict[str, Any], tokens: list[int], tok: Any, mask: Any) -> Walk:
    """Compile, then follow ``tokens``: (compile s, [(mask s, advance s)], refusals, eos ok)."""
    start = time.perf_counter()
    fill, advance = engine.compile(schema)
    compiled = time.perf_counter() - start
    steps: list[tuple[float, float]] = []
    refused: list[str] = []
    for i, t in enumerate(tokens):
        mask.fill(0)
        a = time.perf_counter()
        fill(mask)
        b = time.perf_counter()
        try:
            ok = advance(t) is not False  # outlines-core returns nothing, or raises
        except ValueError:
            ok = False
        steps.append((b - a, time.perf_counter() - b))
        if not allowed(mask, t) or not ok:
            refused.append(f"token {i} {tok.convert_ids_to_tokens(t)!r} (advance {ok})")
        if not ok:
            break
    fill(mask)
    return compiled, steps, refused, allowed(mask, tok.eos_token_id)


def worker(name: str, path: str, repeat: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    n_vocab, dist, rss = len(tok), ENGINES[name].dist, [rss_mb()]
    try:
        out: dict[str, Any] = {"version": importlib.metadata.version(dist), "n_vocab": n_vocab}
        start = time.perf_counter()
        importlib.import_module(dist.replace("-", "_"))
    except ImportError as exc:
        return {"missing": str(exc)}
    out["import_ms"] = (time.perf_counter() - start) * 1e3
    rss.append(rss_mb())
    start, engine = time.perf_counter(), ENGINES[name]()
    engine.prepare(tok, n_vocab)
    out["prepare_tokenizer_ms"] = (time.perf_counter() - start) * 1e3
    rss.append(rss_mb())
    mask = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)
    for key, (schema, value) in SCHEMAS.items():
        tokens = tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False)
        try:
            runs = [walk(engine, schema, tokens, tok, mask) for _ in range(repeat + 1)]
        except Exception as exc:  # an engine that cannot compile a schema is a result
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        (compiled, steps, refused, eos), warm = runs[0], runs[1:]
        out[key] = {
            "tokens": len(tokens),
            "compile_ms_cold": compiled * 1e3,
            "first_mask_ms_cold": steps[0][0] * 1e3,
            "compile_ms_p50": statistics.median(r[0] for r in warm) * 1e3,
            "first_mask_ms_p50": statistics.median(r[1][0][0] for r in warm) * 1e3,
            # after the first mask: what each generated token costs
            **p50_p95("mask_us", [m * 1e6 for r in warm for m, _ in r[1][1:]]),
            **p50_p95("step_us", [(m + a) * 1e6 for r in warm for m, a in r[1][1:]]),
            "walk_ms_p50": statistics.median(sum(map(sum, r[1])) for r in warm) * 1e3,
            "refused": refused + ([] if eos else ["end-of-sequence after the reply"]),
        }
    out["rss_mb_start_import_prepare_end"] = [*rss, rss_mb()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", nargs="+", default=[str(SMOLLM2)], help="HF dirs")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--repeat", type=int, default=10, help="walks after the cold one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokenizer[0], args.repeat)))
        return
    runs = []
    for path in args.tokenizer:
        engines: dict[str, Any] = {}
        for name in args.engines:
            cmd = [sys.executable, __file__, "--worker", name, "--repeat", str(args.repeat)]
            done = subprocess.run([*cmd, "--tokenizer", path], capture_output=True, text=True)
            if done.returncode:
                engines[name] = {"error": done.stderr.strip().splitlines()[-1:]}
                continue
            engines[name] = json.loads(done.stdout.strip().splitlines()[-1])
            for key in SCHEMAS:
                for refusal in engines[name].get(key, {}).get("refused", []):
                    print(f"WARNING: {name} refuses {key}'s {refusal}", file=sys.stderr)
        runs.append({"tokenizer": path, "engines": engines})
    results = {
        "benchmark": "grammar_engines",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "schemas": {k: {"schema": s, "reply": v} for k, (s, v) in SCHEMAS.items()},
        "runs": runs,
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
