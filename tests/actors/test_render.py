"""Rendering a conversation while tokenising only what changed gives exactly the tokens
of mlx-lm's ``apply_chat_template`` over the whole conversation, turn after turn, for
tokenizers with merges, SentencePiece-style prefixes, added tokens with odd flags, and
templates that trim or rewrite earlier turns."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from mlx_actors.actors._render import RecentRenderings, Renderer, Rendering
from mlx_actors.runtime import default_model_dir
from mlx_actors.scheduler.kv import common_prefix
from mlx_actors.testing import CHATML_TEMPLATE

#: Gemma's shape: turns marked by added tokens, contents trimmed.
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

#: Qwen 3's shape: reasoning is dropped from assistant turns before the last user turn.
REWRITING_TEMPLATE = (
    "{% set ns = namespace(last=0) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PIECES = [
    "a", "b", "ab", "abc", " ", "  ", "\n", "\n\n", "hello", " world", "é", "日本", "▁",
    "<", "|", ">", "<|im_", "im_start|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>",
    "<end_of_turn>", "<think>", "</think>", "<mask>", "<norm>", "user", "model", "<tool>",
]  # fmt: skip


def _write(path: Path, tokenizer: Tokenizer, template: str, **config: Any) -> Any:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1 << 20,
                "chat_template": template,
                **config,
            }
        )
    )
    return load_tokenizer(path)


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["hello", "world", "agent", "reply", "the", "of", "a", "user", "model", "think"]
    return [" ".join(rng.choice(words) for _ in range(20)) for _ in range(200)]


def _specials() -> list[AddedToken]:
    return [
        AddedToken(t, special=True, normalized=False)
        for t in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>")
    ] + [
        AddedToken("<mask>", special=True, lstrip=True, normalized=False),  # takes spaces
        AddedToken("<norm>", special=False, normalized=True),
        AddedToken("<tool>", special=False, normalized=False),  # not special, still split
        AddedToken("<|im_start|>user", special=True, normalized=False),  # a longer one
    ]


def byte_level_bpe(path: Path, template: str) -> Any:
    """A GPT-2 style tokenizer with merges (as Llama 3, Qwen, SmolLM2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_tokens(_specials())
    return _write(path, tokenizer, template)


def sentencepiece_like(path: Path, template: str) -> Any:
    """A Metaspace tokenizer that prefixes only the text's first piece (as Llama 2, Gemma),
    with a normaliser."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>"],
        initial_alphabet=[f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_tokens(_specials())
    return _write(path, tokenizer, template, bos_token="<bos>")


TOKENIZERS = {"byte-level-bpe": byte_level_bpe, "sentencepiece-like": sentencepiece_like}
TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "trimming": TRIMMING_TEMPLATE,
    "rewriting": REWRITING_TEMPLATE,
}


@pytest.fixture(scope="module", params=[(t, m) for t in TOKENIZERS for m in TEMPLATES])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind, template = request.param
    return TOKENIZERS[kind](tmp_path_factory.mktemp(f"{kind}-{template}"), TEMPLATES[template])


def full(tokenizer: Any, conversation: list[dict[str, str]]) -> tuple[int, ...]:
    """mlx-lm's reading of the conversation."""
    return tuple(tokenizer.apply_chat_template(conversation, add_generation_prompt=True))


texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    turns=st.lists(st.tuples(texts, texts), min_size=1, max_size=6),
    system=st.one_of(st.none(), texts),
    rewrite=st.lists(st.tuples(st.integers(0, 20), texts), max_size=2),
)
def test_incremental_rendering_is_mlx_lms(
    tokenizer: Any,
    turns: list[tuple[str, str]],
    system: str | None,
    rewrite: list[tuple[int, str]],
) -> None:
    renderer = Renderer(tokenizer)
    assert renderer.incremental
    conversation = [{"role": "system", "content": system}] if system else []
    previous: Rendering | None = None
    for n, (question, answer) in enumerate(turns):
        conversation.append({"role": "user", "content": question})
        if n == len(turns) - 1:  # the history changes under the cache: an edit
            for where, content in rewrite:
                conversation[where % len(conversation)]["content"] = content
        rendering = renderer.render(conversation, previous)
        assert rendering.tokens == full(tokenizer, conversation)
        # The text is what the template gives, the cuts are where the tokenizer splits.
        assert rendering.text == tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        for at, index in rendering.cuts:
            assert (
                tuple(tokenizer.encode(rendering.text[:at], add_special_tokens=False))
                == (rendering.tokens[:index])
            )
        conversation.append({"role": "assistant", "content": answer})
        previous = rendering


def test_a_long_dialogue_encodes_only_its_new_turns(tokenizer: Any) -> None:
    renderer = Renderer(tokenizer)
    rng = random.Random(1)
    conversation = [{"role": "system", "content": "You listen."}]
    previous = None
    for turn in range(40):
        conversation.append({"role": "user", "content": f"question {turn}: " + "ab " * turn})
        rendering = renderer.render(conversation, previous)
        assert rendering.tokens == full(tokenizer, conversation)
        if previous is not None:
            # Encoded from the last cut on: the generation prompt the reply followed.
            assert rendering.reused == previous.cuts[-1][1] > len(previous.tokens) - 16
        reply = "".join(rng.choice(["x", "y ", "<think>z</think> ", "\n"]) for _ in range(9))
        conversation.append({"role": "assistant", "content": reply})
        previous = rendering


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(brief=texts, questions=st.lists(texts, min_size=2, max_size=4))
def test_a_new_conversation_starts_from_the_closest_recent_rendering(
    tokenizer: Any, brief: str, questions: list[str]
) -> None:
    renderer = Renderer(tokenizer)
    brief = (brief + "\n") * (RecentRenderings.MIN_CHARS // (len(brief) + 1) + 1)
    renderings = []
    for question in questions:  # each a conversation of its own, sharing the brief
        conversation = [
            {"role": "system", "content": brief},
            {"role": "user", "content": question},
        ]
        rendering = renderer.render(conversation, share=True)
        assert rendering.tokens == full(tokenizer, conversation)
        renderings.append(rendering)
    assert renderings[0].reused == 0  # nothing recent yet


def test_a_long_shared_start_is_encoded_once(tokenizer: Any) -> None:
    renderer = Renderer(tokenizer)
    brief = "Read this brief with care. " * 200

    def conversation(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": brief}, {"role": "user", "content": question}]

    first = renderer.render(conversation("a"), share=True)
    second = renderer.render(conversation("b"), share=True)
    alone = renderer.render(conversation("c"))  # not sharing: encoded in full
    assert second.tokens == full(tokenizer, conversation("b"))
    # Encoded from the last cut inside the shared text: after the brief.
    shared = common_prefix(first.text, second.text)
    assert second.reused == max(i for at, i in first.cuts if at < shared) > len(brief) // 10
    assert alone.reused == 0
    # A start shorter than a rendering worth keeping is not looked for.
    short = [{"role": "system", "content": "Brief."}, {"role": "user", "content": "a"}]
    assert renderer.render(short, share=True).reused == 0


def test_without_a_usable_cut_the_whole_text_is_encoded(tmp_path: Path) -> None:
    # A template with no added tokens at all: nothing splits the text.
    tokenizer = byte_level_bpe(
        tmp_path,
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}",
    )
    renderer = Renderer(tokenizer)
    conversation = [{"role": "user", "content": "hello world"}]
    first = renderer.render(conversation)
    conversation += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    second = renderer.render(conversation, first)
    assert (first.cuts, second.cuts, second.reused) == ((), (), 0)
    assert second.tokens == full(tokenizer, conversation)


def test_an_overlapping_added_token_prevents_a_cut(tmp_path: Path) -> None:
    tokenizer = byte_level_bpe(tmp_path, CHATML_TEMPLATE)
    renderer = Renderer(tokenizer)
    # "<tool>" and "<|im_start|>" can't overlap; build one with an added token that
    # ends inside another's text: "<|im_" + "start|>" where "<|im_start|>" starts 5
    # characters into an occurrence of "x<|im_start|>".
    text = "ab<|im_start|>user"
    assert not renderer._overlapped(text, 2)
    assert renderer._overlapped(text, 5)  # inside "<|im_start|>"


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [("", "", 0), ("abc", "abc", 3), ("abc", "abd", 2), ("abc", "ab", 2), ("x", "y", 0)],
)
def test_common_prefix(a: str, b: str, n: int) -> None:
    assert common_prefix(a, b) == n


@pytest.mark.smollm
def test_the_default_models_tokenizer() -> None:
    tokenizer = load_tokenizer(default_model_dir())
    renderer = Renderer(tokenizer)
    assert renderer.incremental
    rng = random.Random(2)
    conversation = [{"role": "system", "content": "You are terse."}]
    previous = None
    for _ in range(20):
        words = rng.choices(PIECES, k=rng.randrange(1, 30))
        conversation.append({"role": "user", "content": "".join(words)})
        rendering = renderer.render(conversation, previous)
        assert rendering.tokens == full(tokenizer, conversation)
        conversation.append({"role": "assistant", "content": " ".join(reversed(words))})
        previous = rendering
    assert previous is not None and previous.reused > 0
