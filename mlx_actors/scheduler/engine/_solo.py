"""The one-sequence fast path: while a single sequence runs, it decodes on a plain mlx-lm
cache, exactly as mlx-lm's own ``generate_step`` does, instead of inside the
``BatchGenerator``.

At a batch of one the generator is the slow way to run a sequence: its batch cache is a
copy of the sequence's cache (merged, left-padded), its attention takes an explicit
mask, and a prompt reaches the first token only at its third step. Sequential dialogues
(agent A answers, then B) run at a batch of one all the time. :class:`Solo` owns such a
sequence's cache and its pipelined decode (the next token computed while the current one
is read back); the engine hands it to the generator, with its cache, as soon as another
sequence joins. Greedy output stays token-identical: the computation is
``generate_step``'s on the same cache, and the hand-over feeds the generator the token
the solo run sampled last, with the cache that holds everything before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import greedy_sampler

from ..kv._pool import BlockPool
from ._pacing import chunk as fit
from ._records import LogitsProcessor, Sampler

#: Most prompt tokens run through the model in one call (mlx-lm's own prefill chunk).
CHUNK = 2048


class Solo:
    """One sequence decoding alone on ``cache``.

    Args:
        model: the mlx-lm model.
        cache: the per-layer cache holding the sequence's history; updated in place.
        prompt: the tokens after the history (at least one); all but the last are
            prefilled by :meth:`start`.
        sampler: the sequence's sampler (``None``: greedy).
        budget: most tokens to generate.
        eos: the tokens that end the sequence.
        stream: the MLX stream to run on (the generator's).
        processors: the sequence's logits processors, called as ``generate_step``
            calls them: with every token so far (``context``, the tokens before the
            prompt's last, then each token run).
        context: the sequence's tokens before the prompt's last (read only with
            ``processors``).
    """

    def __init__(
        self,
        model: Module,
        cache: list[Any],
        prompt: list[int],
        *,
        sampler: Sampler | None,
        budget: int,
        eos: frozenset[int],
        stream: Any,
        processors: Sequence[LogitsProcessor] = (),
        context: Sequence[int] = (),
    ) -> None:
        self.model, self.cache, self.prompt = model, cache, prompt
        self.sampler = sampler if sampler is not None else greedy_sampler
        self.budget, self.eos, self.stream = budget, eos, stream
        self.processors = list(processors)
        self._context = TokenBuffer(list(context)) if processors else None
        #: The distribution the token :meth:`next` emitted last was chosen from.
        self.logprobs: mx.array | None = None
        #: Tokens emitted so far, and prompt tokens prefilled.
        self.emitted = self.done = 0
        #: The next token, sampled lazily (its forward pass may still run), and its
        #: distribution; the cache holds every token before it.
        self._next: tuple[mx.array, mx.array] | None = None
        #: The token :meth:`next` emitted without running it through the model.
        self._unfed: mx.array | None = None

    @property
    def started(self) -> bool:
        """Whether the prompt is in the cache and the first token is on its way."""
        return self._next is not None

    @property
    def prefilled(self) -> bool:
        """Whether the prompt but its last token is in the cache."""
        return self.done >= len(self.prompt) - 1

    def prefill(self, limit: int) -> int:
        """Prefill at most ``limit`` more tokens of the prompt but its last (a short
        rest goes along: :func:`~._pacing.chunk`); returns how many."""
        n = min(fit(limit, len(self.prompt) - 1 - self.done), CHUNK)
        if n > 0:
            with mx.stream(self.stream):
                self.model(mx.array(self.prompt[self.done : self.done + n])[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
            self.done += n
        return n

    def begin(self) -> None:
        """Start computing the first token from the prompt's last (once prefilled)."""
        assert self.prefilled
        with mx.stream(self.stream):
            self._next = self._sample(self.prompt[-1:])

    def _sample(self, token: list[int] | mx.array) -> tuple[mx.array, mx.array]:
        inputs = mx.array(token) if isinstance(token, list) else token
        logits = self.model(inputs[None], cache=self.cache)[:, -1, :]
        if self._context is not None:
            tokens = self._context.update_and_fetch(inputs)
            for processor in self.processors:
                logits = processor(tokens, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self.sampler(logprobs)
        mx.async_eval(sampled, logprobs)  # type: ignore[no-untyped-call]
        return sampled, logprobs

    def next(self, *, go_on: bool = True) -> tuple[int, str | None]:
        """Emit the next token and its finish reason (``"length"``, ``"stop"`` or
        ``None``). With ``go_on`` the token after it is computed meanwhile (the cache
        then holds the emitted token, as a finished generator sequence's does);
        without, :meth:`settle` puts the emitted token into the cache."""
        assert self._next is not None, "start() first"
        current, self.logprobs = self._next
        with mx.stream(self.stream):
            if go_on:
                self._next = self._sample(current)
            else:
                self._unfed = current
            token = int(current.item())  # type: ignore[arg-type]
        self.emitted += 1
        reason = "length" if self.emitted >= self.budget else None
        if token in self.eos:
            reason = "stop"
        return token, reason

    def settle(self) -> list[Any]:
        """The cache, holding every token emitted (lazily: evaluate it before use)."""
        if self._unfed is not None:
            with mx.stream(self.stream):
                self.model(self._unfed[None], cache=self.cache)
            self._unfed = None
        return self.cache


class KeptCaches:
    """The caches of the last few sequences that finished alone, kept as they are (as
    mlx-lm's chat keeps its one prompt cache), so that the same agent's next turn
    starts from them instead of gathering its blocks again.

    The blocks stay the record of every history: a kept cache is only a copy of what its
    agent's blocks hold, used when it still matches. It lives outside the blocks but
    inside the pool's budget: each holds the pool units its bytes cost
    (:meth:`BlockPool.hold_copy`), only while the pool has them free, and gives them
    back when a turn needs room (:meth:`make_way`, before any agent is evicted) or
    when it is taken; the least recently finished makes way first.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        #: By agent: the tokens held, the cache and the pool units it holds.
        self._caches: dict[str, tuple[tuple[int, ...], list[Any], int]] = {}

    def keep(self, agent: str, tokens: tuple[int, ...], cache: list[Any]) -> None:
        """Keep ``cache`` (holding ``tokens``) as ``agent``'s, in place of any older, if
        the budget has room for it (older caches make way)."""
        self.drop(agent)
        size = sum(int(c.nbytes) for c in cache)
        units = self.pool.hold_copy(size)
        while units is None and self._caches:
            self.drop(next(iter(self._caches)))
            units = self.pool.hold_copy(size)
        if units is not None:
            self._caches[agent] = (tokens, cache, units)

    def take(self, agent: str, tokens: Sequence[int], start: int) -> list[Any] | None:
        """``agent``'s cache, cut back to its first ``start`` tokens, if it holds the
        first ``start`` of ``tokens`` and can be cut there (it is no longer kept)."""
        entry = self._caches.pop(agent, None)
        if entry is None:
            return None
        held, cache, units = entry
        self.pool.release_copy(units)
        if not 0 < start <= len(held) or tuple(tokens[:start]) != held[:start]:
            return None
        extra = len(held) - start
        if extra:
            if not all(c.is_trimmable() for c in cache):
                return None
            for c in cache:
                c.trim(extra)
        return cache

    def drop(self, agent: str | None = None) -> None:
        """Forget ``agent``'s cache (every cache: ``None``)."""
        for name in list(self._caches) if agent is None else [agent]:
            entry = self._caches.pop(name, None)
            if entry is not None:
                self.pool.release_copy(entry[2])

    def make_way(self, agent: str) -> bool:
        """Give back one cache's units, for a turn of ``agent`` that needs room: the least
        recently kept of the others', else ``agent``'s own (its turn then starts from
        its blocks: a copy is not worth evicting anyone for). Whether one went."""
        name = next((name for name in self._caches if name != agent), None)
        if name is None and agent not in self._caches:
            return False
        self.drop(agent if name is None else name)
        return True


def kept_for(pool: BlockPool) -> KeptCaches:
    """Kept caches counted in ``pool``'s budget, in whatever units it has free."""
    return KeptCaches(pool)
