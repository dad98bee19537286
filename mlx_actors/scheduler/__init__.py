"""The scheduler side: token ids in, token ids and cache blocks out.

``ModelCacheSpec`` reads a model's cache shape, ``BlockPool`` budgets 256-token blocks,
``BlockPoolBatchEngine`` runs every sequence through one mlx-lm ``BatchGenerator``, and
the ``Scheduler`` actor owns that engine on its thread, moving idle agents' caches to a
``CacheStore`` when the pool runs short. It knows nothing of chats or templates.
"""

from ._actor import Scheduler as Scheduler
from ._constraint import Constraint as Constraint
from ._constraint import grammar_tokenizer as grammar_tokenizer
from ._engine import BlockPoolBatchEngine as BlockPoolBatchEngine
from ._image import BlockEntry as BlockEntry
from ._image import CacheImage as CacheImage
from ._pool import AgentBlocks as AgentBlocks
from ._pool import BlockPool as BlockPool
from ._pool import KVBlock as KVBlock
from ._pool import PoolStatistics as PoolStatistics
from ._protocol import CacheStore as CacheStore
from ._protocol import SchedulerStatistics as SchedulerStatistics
from ._protocol import Turn as Turn
from ._quantized import BatchQuantizedKVCache as BatchQuantizedKVCache
from ._quantized import BlockQuantizedKVCache as BlockQuantizedKVCache
from ._quantized import KVQuantization as KVQuantization
from ._records import MAX_STOP_CHARS as MAX_STOP_CHARS
from ._records import MAX_STOPS as MAX_STOPS
from ._records import SEEDS as SEEDS
from ._records import CompletedGeneration as CompletedGeneration
from ._records import EngineStatistics as EngineStatistics
from ._records import Sampling as Sampling
from ._records import StepInfo as StepInfo
from ._records import TokenEvent as TokenEvent
from ._records import Usage as Usage
from ._records import check_stops as check_stops
from ._schema import check_grammar as check_grammar
from ._schema import json_schema as json_schema
from ._schema import parse_reply as parse_reply
from ._schema import schema_grammar as schema_grammar
from ._spec import BLOCK_SIZE as BLOCK_SIZE
from ._spec import SLIDING_MARGIN as SLIDING_MARGIN
from ._spec import LayerKind as LayerKind
from ._spec import LayerSpec as LayerSpec
from ._spec import ModelCacheSpec as ModelCacheSpec
