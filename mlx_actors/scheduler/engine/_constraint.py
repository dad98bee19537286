"""Constrained decoding: a reply that must follow a grammar (a JSON schema's), token by
token, as one sequence's logits processor, driven by llguidance.

llguidance (the grammar engine of Guidance, also used by vLLM and llama.cpp) compiles a
JSON schema into a grammar and, given the tokens so far, computes which tokens may come
next, lazily, from the tokenizer's trie: no index is built per schema. This module owns
the glue: the model's tokenizer as llguidance's (built once per engine) and the mask
applied to the logits with plain MLX ops (llguidance's own MLX helper is a Metal kernel;
this runs on any backend); the schema's side (to grammar, and the reply parsed back) is
:mod:`._schema`'s. A :class:`Constraint` is an mlx-lm logits processor like the
penalties, so it works alone (``Solo``) and inside the ``BatchGenerator``, where the
other sequences' logits are untouched.
"""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ...errors import EngineError, InvalidRequestError


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """mlx-lm's tokenizer (a ``TokenizerWrapper``) as llguidance's, for a model whose
    logits are ``vocab_size`` wide. Costs up to a second on large vocabularies."""
    eos = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos[0])
    except Exception as exc:
        raise InvalidRequestError(
            f"this model's tokenizer cannot drive constrained decoding: {exc}"
        ) from None


class Constraint:
    """A logits processor that masks every token ``grammar`` does not allow next.

    It reads the sequence's tokens (as mlx-lm hands them to processors: the whole
    sequence so far) from ``start``, the number before the reply, and feeds the ones it
    has not seen to its matcher (reading them waits for the device: a constrained
    sequence costs a synchronisation per token). Once the grammar is complete only the
    end-of-sequence token is allowed, so the sequence ends there. Under a grammar
    that always ends, so does the reply, whatever the model: only ``max_tokens`` (or a
    stop string) can cut it.
    """

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, grammar: str, start: int, vocab_size: int
    ) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequestError(f"the grammar is invalid: {self._matcher.get_error()}")
        self._start, self._seen = start, 0
        self._bits = allocate_token_bitmask(1, tokenizer.vocab_size)
        self._vocab = vocab_size
        self._allowed = np.zeros(vocab_size, dtype=np.bool_)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = tokens[self._start + self._seen :].tolist()
        assert isinstance(new, list)
        self._seen += len(new)
        for token in new:
            # A generator computes one step past the end: after the end-of-sequence
            # token (the grammar stopped), what comes is discarded.
            if self._matcher.is_stopped():
                break
            if not self._matcher.consume_token(token):  # type: ignore[arg-type]
                raise EngineError(f"the constraint failed: {self._matcher.get_error()}")
        fill_next_token_bitmask(self._matcher, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(self._vocab, bits.size)
        self._allowed[:n] = bits[:n]
        return mx.where(mx.array(self._allowed), logits, -mx.inf)
