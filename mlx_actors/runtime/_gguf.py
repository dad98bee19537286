"""Convert a llama-architecture GGUF file, as llama.cpp writes it, into a normal mlx-lm
model directory (``config.json``, ``model.safetensors``, tokenizer), reading it with
``mx.load`` alone."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ModelIntegrityError, ModelNotFoundError, UnsupportedModelError
from ._gguf_check import check_gguf

__all__ = ["CONVERTER_VERSION", "convert_gguf"]

#: Bump whenever the files the converter writes change, so cached conversions are redone.
CONVERTER_VERSION = 1

#: The quantized ggml types ``mx.load`` hands back packed (Q4_0, Q4_1, Q8_0) all quantize
#: blocks of 32 weights; every other type it dequantizes itself.
GGML_BLOCK = 32

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ``scales``/``biases`` are the quantization parameters mx.load adds; ``bias`` a layer's own.
_SUFFIXES = ("weight", "scales", "biases", "bias")

# GGUF ``tokenizer.ggml.token_type`` values.
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(
    gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dequantize: bool = False
) -> Path:
    """Write the model in a llama GGUF file as an mlx-lm model directory.

    Quantized tensors stay quantized exactly as stored (``mx.load`` returns Q4_0, Q4_1 and
    Q8_0 tensors as MLX affine triples of group size 32): ``config.json`` gets a
    ``quantization`` entry with the most common bit width, and a per-module entry for
    modules stored at another width (SmolLM2's 8-bit token embedding). Tensors of other
    ggml types arrive already dequantized by ``mx.load`` and are written as they come.

    The rows of the query and key projections are put back in Hugging Face order:
    llama.cpp interleaves the two rotary halves of each head, mlx-lm's llama expects them
    split. Rows only, so the same reshuffle serves packed weights, scales and biases.

    Args:
        gguf: the ``.gguf`` file.
        out_dir: the directory to write (created if missing; existing files are replaced).
        dequantize: write every weight as float32 and no ``quantization`` entry: about
            5 times the size, faster on CPUs.

    Returns:
        ``out_dir``, ready for ``mlx_lm.load``.

    Raises:
        ModelNotFoundError: ``gguf`` does not exist.
        ModelIntegrityError: the file is not a readable GGUF (corrupt or truncated).
        UnsupportedModelError: it is not a llama model with a byte-level BPE tokenizer.
    """
    path = Path(gguf)
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    check_gguf(path)
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelIntegrityError(
            f"cannot read {path} as GGUF (corrupt or truncated?): {exc}"
        ) from exc
    assert isinstance(loaded, tuple)
    tensors, metadata = loaded
    reader = _Metadata(metadata, path)
    config = _llama_config(reader, tensors)
    weights = _mlx_weights(tensors, config, path)
    if dequantize:
        weights = _dequantized(weights)
    else:
        quantization = _quantization(weights)
        if quantization:
            config["quantization"] = quantization
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    _write_tokenizer(reader, config, out)
    return out


class _Metadata:
    """Typed access to GGUF metadata (values come as MLX arrays or Python values)."""

    def __init__(self, metadata: Mapping[str, Any], path: Path) -> None:
        self._metadata = metadata
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._metadata

    def _get(self, key: str, default: Any) -> Any:
        value = self._metadata.get(key, default)
        if value is None:
            raise UnsupportedModelError(f"{self.path}: GGUF metadata lacks {key!r}")
        return value.tolist() if isinstance(value, mx.array) else value

    def integer(self, key: str, default: int | None = None) -> int:
        return int(self._get(key, default))

    def real(self, key: str, default: float | None = None) -> float:
        return float(self._get(key, default))

    def flag(self, key: str, default: bool | None = None) -> bool:
        return bool(self._get(key, default))

    def text(self, key: str, default: str | None = None) -> str:
        return str(self._get(key, default))

    def items(self, key: str) -> list[Any]:
        value = self._get(key, None)
        if not isinstance(value, list):
            raise ModelIntegrityError(f"{self.path}: GGUF metadata {key!r} is not a list")
        return value

    def unsupported(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.path}: {what}; only llama models convert")


def _llama_config(md: _Metadata, tensors: Mapping[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's llama ``config.json`` from the ``llama.*`` metadata."""
    arch = md.text("general.architecture")
    if arch != "llama":
        raise md.unsupported(f"architecture {arch!r}")
    if md.text("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensors:
        raise md.unsupported("rope scaling is not supported")
    hidden = md.integer("llama.embedding_length")
    heads = md.integer("llama.attention.head_count")
    head_dim = md.integer("llama.attention.key_length", hidden // heads)
    if md.integer("llama.rope.dimension_count", head_dim) != head_dim:
        raise md.unsupported("partial rotary embeddings are not supported")
    vocab = md.integer("llama.vocab_size", len(md.items("tokenizer.ggml.tokens")))
    embedding = tensors.get("token_embd.weight")
    if embedding is None or embedding.shape[0] != vocab:
        raise ModelIntegrityError(f"{md.path}: the token embedding does not match the vocabulary")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": md.integer("llama.block_count"),
        "intermediate_size": md.integer("llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.integer("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        # stored as float32: round to the decimal it was written from (9.9999997e-06 -> 1e-05)
        "rms_norm_eps": float(f"{md.real('llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(f"{md.real('llama.rope.freq_base', 10000.0):.7g}"),
        "rope_traditional": False,
        "max_position_embeddings": md.integer("llama.context_length"),
        "vocab_size": vocab,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in md:
            config[f"{key}_token_id"] = md.integer(f"tokenizer.ggml.{key}_token_id")
    return config


def _mlx_name(name: str) -> str | None:
    """mlx-lm's name for a GGUF tensor name, or ``None`` for a name the llama lacks."""
    module, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if module in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[module]}.{suffix}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute_rows(a: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation: rows viewed as ``(heads, head_dim/2, 2)``
    become ``(heads, 2, head_dim/2)``."""
    rows = a.shape[0]
    if rows % (2 * heads):
        raise ModelIntegrityError(f"{rows} query/key rows do not split into {heads} heads")
    return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _mlx_weights(
    tensors: Mapping[str, mx.array], config: Mapping[str, Any], path: Path
) -> dict[str, mx.array]:
    """The tensors under mlx-lm's names, with q/k rows back in Hugging Face order."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        mlx_name = _mlx_name(name)
        if mlx_name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for a llama")
        n = heads.get(mlx_name.split(".")[-2])  # the module's own name
        weights[mlx_name] = _unpermute_rows(tensor, n) if n is not None else tensor
    if "model.norm.weight" not in weights:
        raise ModelIntegrityError(f"{path}: lacks the output norm")
    return weights


def _bits(weights: Mapping[str, mx.array], module: str) -> int:
    """Bit width of a packed module: 32-bit words per row over weights per row."""
    words = weights[f"{module}.weight"].shape[-1]
    return words * 32 // (weights[f"{module}.scales"].shape[-1] * GGML_BLOCK)


def _quantized_modules(weights: Mapping[str, mx.array]) -> list[str]:
    return [name.removesuffix(".scales") for name in weights if name.endswith(".scales")]


def _quantization(weights: Mapping[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's ``quantization`` entry: the most common width, plus one entry per module of
    another width (mlx-lm's ``load_model`` looks each module's path up in it first)."""
    bits = {module: _bits(weights, module) for module in _quantized_modules(weights)}
    if not bits:
        return {}
    common = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GGML_BLOCK, "bits": common}
    for module, width in sorted(bits.items()):
        if width != common:
            quantization[module] = {"group_size": GGML_BLOCK, "bits": width}
    return quantization


def _dequantized(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Every weight as float32, packed triples unpacked."""
    modules = _quantized_modules(weights)
    out = {name: w.astype(mx.float32) for name, w in weights.items() if w.dtype != mx.uint32}
    for module in modules:
        out[f"{module}.weight"] = mx.dequantize(
            weights[f"{module}.weight"],
            weights[f"{module}.scales"],
            weights[f"{module}.biases"],
            group_size=GGML_BLOCK,
            bits=_bits(weights, module),
            dtype=mx.float32,
        )
        del out[f"{module}.scales"], out[f"{module}.biases"]
    return out


def _write_tokenizer(md: _Metadata, config: Mapping[str, Any], out: Path) -> None:
    """``tokenizer.json`` (byte-level BPE from the token list and merges) and
    ``tokenizer_config.json`` (special tokens, chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = md.text("tokenizer.ggml.model")
    if kind != "gpt2":
        raise md.unsupported(f"tokenizer {kind!r} is not byte-level BPE")
    pre = md.text("tokenizer.ggml.pre", "gpt-2")
    if pre not in ("gpt-2", "smollm"):
        raise md.unsupported(f"pre-tokenizer {pre!r} is not supported (gpt-2 and smollm are)")
    tokens: list[str] = md.items("tokenizer.ggml.tokens")
    kinds = md.items("tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in md else []
    merges = [tuple(m.split(" ")) for m in md.items("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ModelIntegrityError(f"{md.path}: malformed tokenizer merges")

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelIntegrityError(f"{md.path}: the token list repeats tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp's "smollm": every digit alone, then GPT-2's split
        digits = pre_tokenizers.Digits(individual_digits=True)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    add_bos = md.flag("tokenizer.ggml.add_bos_token", False)
    if add_bos and "bos_token_id" in config:
        bos, bos_id = tokens[config["bos_token_id"]], config["bos_token_id"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>...) and user-defined ones must match whole in text.
    marked = list(zip(tokens, kinds, strict=False))  # no types: nothing is marked
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in marked if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in marked if k == _USER_DEFINED]
    )
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = md.integer(f"tokenizer.ggml.{key}_token_id", -1)
        return tokens[index] if 0 <= index < len(tokens) else None

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in md:
        tokenizer_config["chat_template"] = md.text("tokenizer.chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
