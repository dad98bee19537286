"""KV blocks and what holds them: the model's cache spec, the block pool, the prefix
index, and cutting caches into blocks and assembling them back. Imports only
:mod:`..caches`."""

from ._blocks import blocks_needed as blocks_needed
from ._blocks import evaluate as evaluate
from ._blocks import from_cache as from_cache
from ._blocks import make_cache as make_cache
from ._blocks import to_cache as to_cache
from ._pool import AgentBlocks as AgentBlocks
from ._pool import BlockPool as BlockPool
from ._pool import KVBlock as KVBlock
from ._prefix import PrefixIndex as PrefixIndex
from ._prefix import runs_of as runs_of
from ._spec import ModelCacheSpec as ModelCacheSpec
from ._tokens import common_prefix as common_prefix
