"""The prefix index: every live cache block, found by the tokens it was computed from.

The keys and values at a position depend only on the tokens up to it, so a block holding
positions ``[256 d, e)`` of any layer belongs to the prefix ``tokens[:e]``. The index is a
trie over 256-token chunks (vLLM's automatic prefix caching keys blocks by the same chain);
each node holds, per layer, the live block computed for its prefix. A turn of any agent
finds the longest prefix of its tokens that live blocks can rebuild a cache for
(:meth:`PrefixIndex.find`), and a finished cache is cut into blocks that reuse what the
index already holds. Nodes are matched by their tokens, never by a hash alone, so two
different prefixes can never share a block. The pool owns the blocks' lifetimes and tells
the index when one is released.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from ._pool import AgentBlocks, KVBlock
from ._spec import BLOCK_SIZE, SLIDING_MARGIN, LayerKind, ModelCacheSpec
from ._tokens import common_prefix


@attrs.define(eq=False, repr=False)
class Node:
    """One chunk of a prefix: positions ``[256 depth, 256 depth + len(tokens))``."""

    parent: Node | None
    #: Which 256-token chunk of the history this is (-1 for a root).
    depth: int
    #: The chunk's tokens (1 to 256 of them; none for a root).
    tokens: tuple[int, ...]
    #: Per layer, the live block computed for this prefix.
    blocks: dict[int, KVBlock] = attrs.Factory(dict)
    #: Longer prefixes, by their next chunk's tokens.
    children: dict[tuple[int, ...], Node] = attrs.Factory(dict)
    #: The namespace of the trie it is in.
    namespace: Hashable = None

    @property
    def start(self) -> int:
        return self.depth * BLOCK_SIZE

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) == BLOCK_SIZE

    def __repr__(self) -> str:
        return f"Node(tokens=[{self.start}, {self.end}), layers={sorted(self.blocks)})"


#: Positions ``[start, end)`` of a block, as used for one sequence.
Piece = tuple[KVBlock, int, int]


@attrs.frozen(kw_only=True)
class Source:
    """Where a sequence's cache comes from: its first ``length`` tokens, rebuilt from
    pieces of live blocks (any agent's)."""

    #: Tokens the blocks hold for the sequence (0: nothing to reuse).
    length: int
    #: Per layer, the pieces covering what the layer needs at ``length``, in order.
    layers: tuple[tuple[Piece, ...], ...]
    #: The trie nodes of the whole chunks within ``length``, from depth 0.
    path: tuple[Node, ...] = ()

    def blocks(self) -> list[KVBlock]:
        """The distinct blocks the pieces come from."""
        seen: dict[int, KVBlock] = {}
        for layer in self.layers:
            for block, _, _ in layer:
                seen.setdefault(block.id, block)
        return list(seen.values())


class PrefixIndex:
    """Live blocks by the prefix they were computed from, in separate namespaces (an
    agent that shares nothing has a namespace of its own).

    At most one block per layer is indexed per node (the one holding the most of it);
    the engine cuts and restores caches through the index, so an equal block is shared
    rather than made twice. Not thread-safe: the engine thread owns it.
    """

    def __init__(self, spec: ModelCacheSpec) -> None:
        self.spec = spec
        self._roots: dict[Hashable, Node] = {}
        #: The node each block was made for, by block id.
        self._node_of: dict[int, Node] = {}
        self._sliding = any(layer.kind is LayerKind.SLIDING for layer in spec.layers)
        self._global = [i for i, layer in enumerate(spec.layers) if layer.kind is LayerKind.GLOBAL]
        #: Whole chunks before a history's end that a sliding layer may need (its
        #: window and the margin it keeps before it).
        self._behind = max(
            (
                -(-(layer.window + SLIDING_MARGIN) // BLOCK_SIZE) + 1
                for layer in spec.layers
                if layer.window
            ),
            default=0,
        )

    def root(self, namespace: Hashable) -> Node:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = Node(None, -1, (), namespace=namespace)
        return node

    @property
    def nodes(self) -> int:
        """Nodes in the trie (for tests and statistics)."""
        count, stack = 0, list(self._roots.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    # -- blocks in and out ---------------------------------------------------------------

    def attach(self, node: Node, block: KVBlock) -> None:
        """Index ``block`` (made for ``node``'s prefix) unless a block holding more of the
        node is already indexed for its layer."""
        self._node_of[block.id] = node
        held = node.blocks.get(block.layer)
        if held is None or block.start < held.start:
            node.blocks[block.layer] = block

    def detach(self, block: KVBlock) -> None:
        """The pool released ``block``: forget it, and the nodes left empty."""
        node = self._node_of.pop(block.id, None)
        if node is None or node.blocks.get(block.layer) is not block:
            return
        del node.blocks[block.layer]
        self.prune(node)

    def prune(self, node: Node) -> None:
        """Remove ``node`` and its ancestors while they hold no block and no child."""
        while node.parent is not None and not node.blocks and not node.children:
            if node.parent.children.get(node.tokens) is not node:
                return  # already removed
            del node.parent.children[node.tokens]
            node = node.parent
        if node.parent is None and not node.children and self._roots.get(node.namespace) is node:
            del self._roots[node.namespace]

    def chain(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        end: int,
        known: Sequence[Node] = (),
    ) -> list[Node]:
        """The nodes of ``tokens[:end]``, one per chunk (the last may be partial), made
        where missing. ``known`` are the first nodes of the chain, found before."""
        nodes = list(known[: end // BLOCK_SIZE])
        parent = nodes[-1] if nodes else self.root(namespace)
        for start in range(len(nodes) * BLOCK_SIZE, end, BLOCK_SIZE):
            chunk = tuple(tokens[start : min(start + BLOCK_SIZE, end)])
            node = parent.children.get(chunk)
            if node is None:
                node = parent.children[chunk] = Node(
                    parent, parent.depth + 1, chunk, namespace=parent.namespace
                )
            nodes.append(node)
            parent = node
        return nodes

    # -- finding a prefix -----------------------------------------------------------------

    def find(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        limit: int,
        own: AgentBlocks | None = None,
        kept: int = 0,
    ) -> Source:
        """The longest prefix of ``tokens``, at most ``limit`` tokens, that live blocks
        hold for every layer: all of it for global layers, its last ``window`` tokens
        for sliding-window ones.

        ``own``: blocks whose first ``kept`` tokens are those of ``tokens`` (the agent's
        own history). Their whole chunks are taken as they are rather than found again
        (the walk starts where they end), when the prefix found is at least ``kept``
        long: a turn costs the walk over its new tokens, not over the whole history."""
        if own is not None and kept:
            found = self._find_after(namespace, tokens, min(kept, limit), limit, own)
            if found is not None:
                return found
        levels, path = self._walk(self._roots.get(namespace), tokens, 0)
        return self._source(self._spans(levels), limit, path)

    def _find_after(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        agreed: int,
        limit: int,
        own: AgentBlocks,
    ) -> Source | None:
        """:meth:`find` from ``own``'s whole chunks: the global layers' first blocks are
        ``own``'s, the walk starts a sliding window before their end. ``None`` where
        that cannot give what the whole walk would (no global layer, no whole chunk,
        chunks that are not ``own``'s nodes', or a prefix shorter than ``agreed``:
        blocks before the walk's start might have served it)."""
        whole = agreed // BLOCK_SIZE
        if not self._global or whole == 0:
            return None
        for layer in self._global:
            blocks = own.layers[layer]
            if len(blocks) < whole or blocks[whole - 1].end != whole * BLOCK_SIZE:
                return None  # not whole blocks from 0 (they are contiguous from 0)
        node = self._node_of.get(own.layers[self._global[0]][whole - 1].id)
        if (
            node is None
            or node.depth != whole - 1
            or node.namespace != namespace
            or node.parent is None
            or node.parent.children.get(node.tokens) is not node  # pruned
        ):
            return None
        path = [node]
        while path[-1].parent is not None and path[-1].depth > 0:
            path.append(path[-1].parent)
        path.reverse()
        start = max(0, whole - self._behind) if self._sliding else whole
        parent = path[start - 1] if start else path[0].parent
        levels, more = self._walk(parent, tokens, start)
        head = start * BLOCK_SIZE
        spans = self._spans(levels)
        runs = [runs_of(layer_spans) for layer_spans in spans]
        for layer in self._global:
            layer_runs = runs[layer]
            if layer_runs and layer_runs[0][0] <= head:
                layer_runs[0] = (0, max(head, layer_runs[0][1]))
            else:
                layer_runs.insert(0, (0, head))
        length = self._servable(runs, limit)
        if length < agreed:
            return None
        layers: list[tuple[Piece, ...]] = []
        for number, (spec, layer_spans) in enumerate(zip(self.spec.layers, spans, strict=True)):
            if spec.window is None:
                firsts = tuple((b, b.start, b.end) for b in own.layers[number][:start])
                layers.append(
                    firsts + cover(layer_spans, head, length) if length > head else firsts
                )
            else:
                layers.append(cover(layer_spans, max(0, length - spec.window), length))
        path = [*path[:start], *more]
        return Source(length=length, layers=tuple(layers), path=tuple(path[: length // BLOCK_SIZE]))

    def own(self, blocks: AgentBlocks | None, limit: int) -> Source:
        """The longest prefix, at most ``limit`` tokens (which ``blocks``' tokens agree
        with), that ``blocks`` rebuild a cache for by themselves: one agent's own
        history, holding no other agent's block (``None``: none, nothing to start from)."""
        layers = blocks.layers if blocks is not None else [() for _ in self.spec.layers]
        return self._source([[(b, b.end) for b in layer] for layer in layers], limit, [])

    def _spans(self, levels: list[list[tuple[Node, int]]]) -> list[list[tuple[KVBlock, int]]]:
        """Per layer, every block of the walk's nodes, and up to where it agrees with the
        tokens, in order of their starts."""
        spans: list[list[tuple[KVBlock, int]]] = [[] for _ in self.spec.layers]
        for level in levels:
            for node, usable in level:
                for layer, block in node.blocks.items():
                    spans[layer].append((block, node.start + usable))
        for layer_spans in spans:
            layer_spans.sort(key=lambda span: span[0].start)
        return spans

    def _source(
        self, spans: list[list[tuple[KVBlock, int]]], limit: int, path: list[Node]
    ) -> Source:
        """The longest prefix of at most ``limit`` tokens that ``spans`` (per layer, in
        order of their starts) can serve, as a :class:`Source`."""
        length = self._servable([runs_of(layer_spans) for layer_spans in spans], limit)
        if length == 0:
            return Source(length=0, layers=tuple(() for _ in self.spec.layers))
        layers = []
        for spec, layer_spans in zip(self.spec.layers, spans, strict=True):
            lo = 0 if spec.window is None else max(0, length - spec.window)
            layers.append(cover(layer_spans, lo, length))
        return Source(length=length, layers=tuple(layers), path=tuple(path[: length // BLOCK_SIZE]))

    def _walk(
        self, node: Node | None, tokens: Sequence[int], depth: int
    ) -> tuple[list[list[tuple[Node, int]]], list[Node]]:
        """From ``node`` (the chunk before ``depth``'s, or a root), per chunk of
        ``tokens`` the nodes whose tokens agree with it (and for how many tokens); and
        the nodes of the whole chunks matched."""
        levels: list[list[tuple[Node, int]]] = []
        path: list[Node] = []
        start = depth * BLOCK_SIZE
        while node is not None and node.children and start < len(tokens):
            chunk = tuple(tokens[start : start + BLOCK_SIZE])
            exact = node.children.get(chunk)
            level: list[tuple[Node, int]] = []
            if exact is not None:
                level.append((exact, len(chunk)))
            if exact is None or self._sliding:
                # Shorter nodes at this depth (other histories' last chunks, kept
                # boundaries) can serve what the whole chunk's blocks no longer hold.
                for other in node.children.values():
                    if other is not exact:
                        n = common_prefix(other.tokens, chunk)
                        if n:
                            level.append((other, n))
            if level:
                levels.append(level)
            if exact is None or not exact.full:
                break
            path.append(exact)
            node = exact
            start += BLOCK_SIZE
        return levels, path

    def _servable(self, runs: list[list[tuple[int, int]]], limit: int) -> int:
        """The largest ``x <= limit`` at which every layer's runs cover what it needs."""
        candidates = {limit}
        for layer_runs in runs:
            candidates.update(min(end, limit) for _, end in layer_runs)
        for x in sorted(candidates, reverse=True):
            if x <= 0:
                break
            if all(
                _covers(layer_runs, 0 if spec.window is None else max(0, x - spec.window), x)
                for spec, layer_runs in zip(self.spec.layers, runs, strict=True)
            ):
                return x
        return 0


def runs_of(spans: Sequence[tuple[KVBlock, int]]) -> list[tuple[int, int]]:
    """Maximal stretches ``[start, end)`` of positions the spans cover."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted((block.start, end) for block, end in spans):
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


def _covers(runs: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(start <= lo and hi <= end for start, end in runs)


def cover(spans: Sequence[tuple[KVBlock, int]], lo: int, hi: int) -> tuple[Piece, ...]:
    """Pieces of the spans (a block, and where what it can serve ends), given in order
    of their blocks' starts, covering ``[lo, hi)``, each point from the span reaching
    furthest; the caller checked that they cover it."""
    pieces: list[Piece] = []
    at, i, count = lo, 0, len(spans)
    best, reach = None, -1
    while at < hi:
        while i < count:
            block, end = spans[i]
            if block.start > at:
                break
            if end > reach:
                best, reach = block, end
            i += 1
        assert best is not None and reach > at, "the spans do not cover the range"
        end = min(reach, hi)
        pieces.append((best, at, end))
        at = end
    return tuple(pieces)
