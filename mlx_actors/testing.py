"""Tiny real models for tests and benchmarks: random weights of any mlx-lm architecture,
written as a normal mlx-lm model directory so they load through ``mlx_lm.load``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

__all__ = [
    "CHATML_TEMPLATE",
    "CHATML_TOOLS_TEMPLATE",
    "SPECIAL_TOKENS",
    "family_configs",
    "tiny_config",
    "write_random_model",
]

#: The ChatML template of SmolLM2 and Qwen, without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: ChatML with tools, in the shape of Qwen 2.5's template: the tools listed in the
#: system message, calls as ``<tool_call>`` JSON, results as ``<tool_response>``.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Special tokens after the 256 byte tokens, as in SmolLM2's vocabulary.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A small config of ``model_type`` (hidden 64, 2 layers) for the byte tokenizer."""
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>"),
        "bos_token_id": 256 + SPECIAL_TOKENS.index("<|im_start|>"),
    }
    config.update(overrides)
    return config


def family_configs(window: int = 40) -> dict[str, dict[str, Any]]:
    """Tiny configs of the four families mlx-actors is checked on, with their real layer
    patterns: Llama, Qwen 2.5, Gemma 3 (five sliding-window layers of ``window`` tokens
    to one global) and Qwen MoE."""
    return {
        "llama": tiny_config("llama", num_hidden_layers=3),
        "qwen2": tiny_config("qwen2", num_hidden_layers=3, tie_word_embeddings=True),
        "gemma3_text": tiny_config(
            "gemma3_text",
            num_hidden_layers=6,
            sliding_window=window,
            sliding_window_pattern=6,
            query_pre_attn_scalar=16,
        ),
        "qwen2_moe": tiny_config(
            "qwen2_moe",
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
    }


def write_random_model(
    path: str | Path,
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    init_scale: float = 1.0,
    chat_template: str = CHATML_TEMPLATE,
) -> Path:
    """Write an mlx-lm model directory with random weights and a byte-level tokenizer.

    Args:
        path: the directory to create (its parent must exist).
        config: an mlx-lm ``config.json`` (see :func:`tiny_config`). Its ``vocab_size``
            must be at least 259, the byte tokenizer's size.
        seed: seeds MLX's generator, so the same arguments give the same weights.
        dtype: the floating-point type of the weights.
        init_scale: multiplies every weight matrix. mlx-lm's default initialisation
            gives a near-uniform model whose greedy output hardly depends on its
            context; 3 or 4 makes outputs sensitive to every cached token, which is
            what tests comparing against a reference want.
        chat_template: the tokenizer's chat template.

    Returns:
        The directory, ready for ``mlx_lm.load``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if config.get("vocab_size", 0) < 256 + len(SPECIAL_TOKENS):
        raise ValueError("vocab_size must cover the byte tokenizer's 259 tokens")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model, _ = load_model(path, strict=False)
    model.set_dtype(dtype)
    params: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    weights = {name: w * init_scale if w.ndim >= 2 else w for name, w in params.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    _write_byte_tokenizer(path, chat_template)
    return path


def _write_byte_tokenizer(path: Path, chat_template: str = CHATML_TEMPLATE) -> None:
    """A GPT-2 style byte-level BPE tokenizer with no merges: one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet is unordered; give byte b the id b, as GPT-2 does.
    table = _bytes_to_unicode()
    assert set(table.values()) == set(byte_chars)
    vocab = {table[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1 << 20,
                "chat_template": chat_template,
            },
            indent=2,
        )
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table
