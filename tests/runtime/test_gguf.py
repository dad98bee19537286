"""The GGUF converter on tiny llamas written the llama.cpp way from known weights: the
converted directory must hold the original weights exactly and generate what they do."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlx_actors.errors import ModelIntegrityError, ModelNotFoundError, UnsupportedModelError
from mlx_actors.runtime._gguf import convert_gguf
from mlx_actors.testing import CHATML_TEMPLATE, tiny_config, write_random_model

from ..conftest import reference

# mlx-lm's llama names -> llama.cpp's, written out independently of the converter.
TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
PER_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# ggml tensor types
F32, Q4_1, Q8_0 = 0, 3, 8
BOS_KEY = "tokenizer.ggml.add_bos_token"


def gguf_name(name: str) -> str:
    module, suffix = name.rsplit(".", 1)
    if module in TOP_LEVEL:
        return f"{TOP_LEVEL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{PER_LAYER[rest]}.{suffix}"


def llama_cpp_permute(rows: mx.array, heads: int) -> mx.array:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (interleaving rotary halves)."""
    n = rows.shape[0]
    return (
        rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )


def heads_of(name: str, config: dict[str, Any]) -> int | None:
    if ".self_attn.q_proj." in name:
        return int(config["num_attention_heads"])
    if ".self_attn.k_proj." in name:
        return int(config["num_key_value_heads"])
    return None


def metadata(config: dict[str, Any], model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The ``llama.*`` and ``tokenizer.ggml.*`` keys llama.cpp writes, from a model dir with
    the byte tokenizer of ``mlx_actors.testing``."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    u32 = mx.uint32
    md: dict[str, Any] = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": mx.array(config["num_hidden_layers"], u32),
        "llama.context_length": mx.array(config["max_position_embeddings"], u32),
        "llama.embedding_length": mx.array(config["hidden_size"], u32),
        "llama.feed_forward_length": mx.array(config["intermediate_size"], u32),
        "llama.attention.head_count": mx.array(config["num_attention_heads"], u32),
        "llama.attention.head_count_kv": mx.array(config["num_key_value_heads"], u32),
        "llama.rope.dimension_count": mx.array(config["head_dim"], u32),
        "llama.rope.freq_base": mx.array(config["rope_theta"], mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], mx.float32),
        "llama.vocab_size": mx.array(len(tokens), u32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3 if t in special else 1 for t in tokens]),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": mx.array(config["bos_token_id"], u32),
        "tokenizer.ggml.eos_token_id": mx.array(config["eos_token_id"], u32),
        "tokenizer.ggml.padding_token_id": mx.array(vocab["<|endoftext|>"], u32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    md.update(overrides)
    return md


@pytest.fixture(scope="module")
def float_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        tmp_path_factory.mktemp("gguf") / "original", tiny_config(), seed=11, init_scale=4.0
    )


def write_float_gguf(original: Path, path: Path, **overrides: Any) -> Path:
    """The original model as llama.cpp would write it in float32, with ``mx.save_gguf``."""
    config = json.loads((original / "config.json").read_text())
    weights = mx.load(str(original / "model.safetensors"))
    assert isinstance(weights, dict)
    tensors = {}
    for name, w in weights.items():
        heads = heads_of(name, config)
        tensors[gguf_name(name)] = w if heads is None else llama_cpp_permute(w, heads)
    mx.save_gguf(str(path), tensors, metadata(config, original, **overrides))
    return path


def test_float_gguf_converts_back_to_the_original_weights(
    float_original: Path, tmp_path: Path
) -> None:
    gguf = write_float_gguf(float_original, tmp_path / "tiny.gguf")
    out = convert_gguf(gguf, tmp_path / "converted")

    original = mx.load(str(float_original / "model.safetensors"))
    converted = mx.load(str(out / "model.safetensors"))
    assert isinstance(original, dict) and isinstance(converted, dict)
    assert sorted(converted) == sorted(original)
    for name, w in original.items():
        assert converted[name].dtype == w.dtype, name
        assert mx.array_equal(converted[name], w).item(), name
    # the permutation is not the identity here, so the check above means something
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(llama_cpp_permute(original[q], 4), original[q]).item()

    config = json.loads((out / "config.json").read_text())
    expected = json.loads((float_original / "config.json").read_text())
    assert "quantization" not in config
    for key, value in expected.items():
        assert config[key] == pytest.approx(value), key


def test_float_gguf_generates_what_the_original_generates(
    float_original: Path, tmp_path: Path
) -> None:
    out = convert_gguf(write_float_gguf(float_original, tmp_path / "t.gguf"), tmp_path / "c")
    model, tokenizer = mlx_lm.load(str(out))
    original_model, original_tokenizer = mlx_lm.load(str(float_original))

    text = "Tell me 12 things about llamas."
    ids = tokenizer.encode(text)
    assert ids == original_tokenizer.encode(text)
    messages = [{"role": "user", "content": text}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        original_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )
    assert tokenizer.eos_token_ids == original_tokenizer.eos_token_ids
    expected = reference(original_model, ids, 40)
    assert reference(model, ids, 40) == expected
    assert len(set(expected)) > 3  # a degenerate output would prove little


# -- a quantized GGUF, as llama.cpp writes Q4_1 and Q8_0 --------------------------------


def _gguf_string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _gguf_value(value: Any) -> bytes:
    if isinstance(value, mx.array):
        value = value.tolist()
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _gguf_string(value)
    if all(isinstance(v, int) for v in value):
        return struct.pack(f"<IIQ{len(value)}i", 9, 5, len(value), *value)
    return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(_gguf_string, value))


def write_gguf(
    path: Path, tensors: dict[str, tuple[int, tuple[int, ...], bytes]], md: dict
) -> None:
    """A GGUF v3 file: ``tensors`` maps names to (ggml type, shape, raw data)."""
    header = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(md)))
    for key, value in md.items():
        header += _gguf_string(key) + _gguf_value(value)
    data = bytearray()
    for name, (kind, shape, raw) in tensors.items():
        dims = b"".join(struct.pack("<Q", n) for n in reversed(shape))  # ggml: innermost first
        header += _gguf_string(name) + struct.pack("<I", len(shape)) + dims
        header += struct.pack("<IQ", kind, len(data))
        data += raw + bytes(-len(raw) % 32)
    path.write_bytes(bytes(header + bytes(-len(header) % 32) + data))


def q4_1_bytes(packed: mx.array, scales: mx.array, biases: mx.array) -> bytes:
    """MLX's 4-bit affine triple as Q4_1 blocks: fp16 scale, fp16 min, 16 bytes holding
    weights 0-15 in the low nibbles and 16-31 in the high ones."""
    nibbles = np.asarray(packed).view(np.uint8)  # byte k: weight 2k low, 2k+1 high
    q = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(packed.shape[0], -1, 32)
    quants = q[..., :16] | (q[..., 16:] << 4)
    d = np.asarray(scales).view(np.uint8).reshape(*quants.shape[:2], 2)
    m = np.asarray(biases).view(np.uint8).reshape(*quants.shape[:2], 2)
    return np.concatenate([d, m, quants], axis=-1).tobytes()


def q8_0_triple(w: mx.array) -> tuple[mx.array, mx.array, mx.array, bytes]:
    """Q8_0 (symmetric int8, fp16 scale per 32) of ``w``: the MLX triple ``mx.load`` makes
    of it, and the raw blocks."""
    groups = np.asarray(w).reshape(w.shape[0], -1, 32)
    d = (np.abs(groups).max(axis=-1) / 127).astype(np.float16)
    q = np.clip(np.round(groups / d[..., None].astype(np.float32)), -127, 127).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1).tobytes()
    packed = mx.array((q.astype(np.int16) + 128).astype(np.uint8).reshape(w.shape[0], -1))
    packed = mx.array(np.asarray(packed).view(np.uint32))
    scales = mx.array(d)
    return packed, scales, scales * -128, raw


def test_quantized_gguf_converts_back_to_the_original_triples(
    float_original: Path, tmp_path: Path
) -> None:
    config = tiny_config(tie_word_embeddings=True)
    floats = mx.load(str(float_original / "model.safetensors"))
    assert isinstance(floats, dict)
    del floats["lm_head.weight"]
    # the original: 4-bit linears (fp16 scales and biases, as Q4_1 keeps them), 8-bit
    # embedding (tied, so it is the output layer too), float32 norms
    original: dict[str, mx.array] = {}
    tensors = {}
    for name, w in floats.items():
        module = name.removesuffix(".weight")
        heads = heads_of(name, config)
        target = gguf_name(name)
        if w.ndim == 1:
            original[name] = w
            tensors[target] = (F32, w.shape, np.asarray(w).tobytes())
        elif module == "model.embed_tokens":
            packed, scales, biases, raw = q8_0_triple(w)
            original.update({name: packed, f"{module}.scales": scales, f"{module}.biases": biases})
            tensors[target] = (Q8_0, w.shape, raw)
        else:
            packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
            scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
            original_triple = (packed, scales, biases)
            original.update({name: packed, f"{module}.scales": scales, f"{module}.biases": biases})
            if heads is not None:  # rows only: packed weights, scales and biases alike
                packed, scales, biases = (llama_cpp_permute(a, heads) for a in original_triple)
            tensors[target] = (Q4_1, w.shape, q4_1_bytes(packed, scales, biases))
    gguf = tmp_path / "q.gguf"
    write_gguf(gguf, tensors, metadata(config, float_original, **{BOS_KEY: mx.array(True)}))

    out = convert_gguf(gguf, tmp_path / "converted")
    converted = mx.load(str(out / "model.safetensors"))
    assert isinstance(converted, dict)
    assert sorted(converted) == sorted(original)
    for name, w in original.items():
        assert converted[name].dtype == w.dtype, name
        assert mx.array_equal(converted[name], w).item(), name
    written = json.loads((out / "config.json").read_text())
    assert written["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert written["tie_word_embeddings"] is True

    # the original as an mlx-lm directory: same config, the known triples
    original_dir = tmp_path / "original"
    original_dir.mkdir()
    (original_dir / "config.json").write_text(
        json.dumps({**config, "quantization": written["quantization"]})
    )
    mx.save_safetensors(str(original_dir / "model.safetensors"), original)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(float_original / name, original_dir / name)
    model, tokenizer = mlx_lm.load(str(out))
    original_model, _ = mlx_lm.load(str(original_dir))
    ids = [5, 77, 200, 31, 9, 140, 66, 250, 3]
    expected = reference(original_model, ids, 30)
    assert reference(model, ids, 30) == expected
    assert len(set(expected)) > 3
    # this file asks for a BOS token: the tokenizer adds it
    assert tokenizer.encode("hi") == [config["bos_token_id"], ord("h"), ord("i")]


def test_dequantize_writes_float32_weights(float_original: Path, tmp_path: Path) -> None:
    gguf = write_float_gguf(float_original, tmp_path / "tiny.gguf")
    out = convert_gguf(gguf, tmp_path / "converted", dequantize=True)
    converted = mx.load(str(out / "model.safetensors"))
    assert isinstance(converted, dict)
    assert all(w.dtype == mx.float32 for w in converted.values())


def test_unreadable_or_unsupported_files_are_refused(float_original: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    gguf = write_float_gguf(float_original, tmp_path / "tiny.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(ModelIntegrityError, match="truncated"):
        convert_gguf(truncated, tmp_path / "out")
    qwen = write_float_gguf(
        float_original, tmp_path / "qwen.gguf", **{"general.architecture": "qwen2"}
    )
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        convert_gguf(qwen, tmp_path / "out")
    other = write_float_gguf(float_original, tmp_path / "o.gguf", **{"tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        convert_gguf(other, tmp_path / "out")
