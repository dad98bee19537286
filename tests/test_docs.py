"""Every ```python block of README.md and docs/ runs here, as written, so that the docs
cannot rot.

The default model is a tiny random-weight model installed where ``Runtime()`` looks for
the default one (``$MLX_ACTORS_CACHE/models/...`` with the converter's marker), so the
snippets go through the real loading path and the real engine in well under a second
each. Each runs in a temporary working directory, on asyncio, with top-level ``await``
(as in ``python -m asyncio``). A snippet may use two names it does not define, as the
guides say: ``rt``, a running ``Runtime()``, and ``agent``, an agent of it. A snippet that
talks to ``http://127.0.0.1:8000`` (where ``python -m mlx_actors serve`` listens) gets a
server of ``rt`` on a free port, and the address is rewritten to it.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import inspect
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import anyio
import attrs
import pytest

from mlx_actors import Runtime
from mlx_actors.runtime import _default
from mlx_actors.runtime._gguf import CONVERTER_VERSION
from mlx_actors.testing import tiny_config, write_random_model

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: Names a snippet may use without defining them (see the module's docstring).
FIXTURES = frozenset({"rt", "agent"})
#: Where ``python -m mlx_actors serve`` listens by default.
SERVER = "127.0.0.1:8000"
#: Fence languages the docs may use; only ``python`` blocks are run.
LANGUAGES = frozenset({"python", "sh", "console", "text", "json"})
#: Most seconds one snippet may take (the cluster starts Ray: ~15 s, ~110 s on a loaded machine).
LIMIT = 600

#: The Quick start's two commands, as the README gives them.
QUICK_START = (
    "bash scripts/demo    # sets up .venv, fetches the default model once (~95 MB from PyPI), "
    "runs examples/debate.py",
    "bash scripts/test    # sets up .venv with the test tools and runs the test suite "
    "(~7 min on 2 cores)",
)

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^`\s]*)\s*$")


@attrs.frozen
class Snippet:
    page: Path
    #: The line of the opening fence (1-based).
    line: int
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fences(page: Path) -> list[Snippet]:
    """The fenced code blocks of ``page``, in order."""
    found: list[Snippet] = []
    opened: tuple[int, str, list[str]] | None = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = _FENCE.match(line)
        if opened is None:
            if match:
                opened = (number, match["lang"], [])
        elif match and not match["lang"]:
            start, language, body = opened
            found.append(Snippet(page, start, language, "\n".join(body) + "\n"))
            opened = None
        else:
            opened[2].append(line)
    assert opened is None, f"{page.relative_to(ROOT)}:{opened[0]}: a fence is never closed"
    return found


def python_snippets() -> list[Snippet]:
    return [s for page in PAGES for s in fences(page) if s.language == "python"]


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads but never binds (anywhere), and that are not builtins."""
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache whose default model is a tiny random model, marked as the converter
    marks a finished conversion, so ``default_model_dir()`` takes it as it is."""
    root = tmp_path_factory.mktemp("mlx-actors-cache")
    for dequantize, form in ((False, "Q4_1"), (True, "float32")):
        target = root / "models" / f"{_default.DEFAULT_MODEL_NAME}-{form}"
        target.parent.mkdir(parents=True, exist_ok=True)
        # Heads of 64 as SmolLM2's, so that kv_group_size's default divides them.
        write_random_model(target, tiny_config(num_hidden_layers=2, head_dim=64), seed=7)
        marker = {
            "source": f"{_default.WHEEL_REQUIREMENT}:{_default.GGUF_MEMBER}",
            "source_sha256": _default.GGUF_SHA256,
            "converter_version": CONVERTER_VERSION,
            "dequantize": dequantize,
        }
        (target / _default.MARKER).write_text(json.dumps(marker, indent=2))
    return root


@pytest.fixture
def logging_kept() -> Iterator[None]:
    """Put back the logging setup a snippet changes (``basicConfig``, levels)."""
    loggers = [logging.getLogger(), logging.getLogger("mlx_actors")]
    saved = [(lg, lg.level, lg.handlers[:]) for lg in loggers]
    yield
    for lg, level, handlers in saved:
        lg.setLevel(level)
        for handler in lg.handlers[:]:
            if handler not in handlers:
                lg.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in lg.handlers:
                lg.addHandler(handler)


def test_the_default_model_is_the_tiny_one(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippets' ``Runtime()`` loads the model written here, not a real one."""
    monkeypatch.setenv("MLX_ACTORS_CACHE", str(model_cache))
    assert _default.default_model_dir().parent == model_cache / "models"
    assert _default.default_model_dir(dequantize=True).parent == model_cache / "models"


def test_every_fence_is_closed_and_named() -> None:
    """Every code block has a language the docs use; a python block inside a list (indented)
    would escape the runner, so there is none."""
    snippets = [s for page in PAGES for s in fences(page)]
    assert {s.language for s in snippets} <= LANGUAGES, {s.id: s.language for s in snippets}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            match = _FENCE.match(line)
            assert not (match and match["indent"]), f"{page.name}:{number}: indented fence"
    assert len(python_snippets()) >= 20


def test_the_quick_start_commands_stay_as_they_are() -> None:
    """Users and CI run these two lines as the README gives them."""
    readme = (ROOT / "README.md").read_text()
    for line in QUICK_START:
        assert f"\n{line}\n" in readme


def test_relative_links_reach_files() -> None:
    """Links between the README, the docs and the changelog point at files that exist
    (``mkdocs build --strict`` checks the site's own; this covers the README too)."""
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name}: {target}"


def _params() -> list[Any]:
    """One test per distinct snippet: a snippet repeated word for word (the README's
    examples that a guide shows too) runs once, under its first place."""
    unique = {s.code: s for s in reversed(python_snippets())}
    return [
        pytest.param(
            s,
            id=s.id,
            # One local Ray instance at a time: with the cluster's own tests.
            marks=[pytest.mark.xdist_group("ray")] if "Cluster(" in s.code else [],
        )
        for s in sorted(unique.values(), key=lambda s: (PAGES.index(s.page), s.line))
    ]


def _compile(text: str, name: str) -> CodeType:
    """Code as a module with top-level ``await``, without this file's ``__future__``
    imports (which would turn a snippet's annotations into strings)."""
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(text, name, "exec", flags=flags, dont_inherit=True)


@pytest.mark.parametrize("snippet", _params())
def test_snippet_runs(
    snippet: Snippet,
    model_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    logging_kept: None,
) -> None:
    """The snippet runs to its end without an exception (its own asserts included)."""
    monkeypatch.setenv("MLX_ACTORS_CACHE", str(model_cache))
    monkeypatch.chdir(tmp_path)
    free = free_names(ast.parse(snippet.code))
    assert free <= FIXTURES, f"{snippet.id} uses undefined names: {sorted(free - FIXTURES)}"
    code = _compile(snippet.code, snippet.id)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    if not code.co_flags & inspect.CO_COROUTINE and not free and SERVER not in snippet.code:
        exec(code, namespace)  # a script: it may start its own event loop (mlx_actors.run)
    else:
        anyio.run(functools.partial(_run_async, snippet, free, namespace), backend="asyncio")


async def _run_async(snippet: Snippet, free: set[str], namespace: dict[str, Any]) -> None:
    text = snippet.code
    with anyio.fail_after(LIMIT):
        async with contextlib.AsyncExitStack() as stack:
            if free or SERVER in text:
                rt = await stack.enter_async_context(Runtime())
                namespace["rt"] = rt
                if "agent" in free:
                    namespace["agent"] = await rt.spawn("agent", system="You are helpful.")
            if SERVER in text:
                text = text.replace(SERVER, await _serve(stack, rt))
            result = eval(_compile(text, snippet.id), namespace)
            if inspect.iscoroutine(result):
                await result


async def _serve(stack: contextlib.AsyncExitStack, rt: Runtime) -> str:
    """Serve ``rt`` on a free port until ``stack`` closes; its address."""
    from mlx_actors.server import listen, serve

    sock = listen("127.0.0.1", 0)
    stack.callback(sock.close)
    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)  # runs first: the server stops, then the group
    tg.start_soon(functools.partial(serve, rt, sock=sock))
    return f"127.0.0.1:{sock.getsockname()[1]}"
