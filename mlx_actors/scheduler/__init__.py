"""The scheduler side: token ids in, token ids and cache blocks out.

``ModelCacheSpec`` reads a model's cache shape, ``BlockPool`` budgets 256-token blocks,
``BlockPoolBatchEngine`` runs every sequence through one mlx-lm ``BatchGenerator``, and
the ``Scheduler`` actor owns that engine on its thread, moving idle agents' caches to a
``CacheStore`` when the pool runs short. It knows nothing of chats or templates.

Five parts, each importing only those before it: ``caches`` (the cache kinds mlx-lm's
models run on beyond its own), ``kv`` (blocks, the pool, the prefix index), ``engine``
(running sequences), ``residency`` (caches out of the pool: host memory and disk
images), ``service`` (the thread boundary and the ``Scheduler`` actor). Each part's
``__init__`` names what it offers the parts above it.
"""

from .caches._quantized import BatchQuantizedKVCache as BatchQuantizedKVCache
from .caches._quantized import BlockQuantizedKVCache as BlockQuantizedKVCache
from .caches._quantized import KVQuantization as KVQuantization
from .engine._constraint import Constraint as Constraint
from .engine._constraint import grammar_tokenizer as grammar_tokenizer
from .engine._engine import BlockPoolBatchEngine as BlockPoolBatchEngine
from .engine._records import MAX_STOP_CHARS as MAX_STOP_CHARS
from .engine._records import MAX_STOPS as MAX_STOPS
from .engine._records import SEEDS as SEEDS
from .engine._records import CompletedGeneration as CompletedGeneration
from .engine._records import EngineStatistics as EngineStatistics
from .engine._records import Sampling as Sampling
from .engine._records import StepInfo as StepInfo
from .engine._records import TokenEvent as TokenEvent
from .engine._records import Usage as Usage
from .engine._records import check_stops as check_stops
from .engine._schema import check_grammar as check_grammar
from .engine._schema import json_schema as json_schema
from .engine._schema import parse_reply as parse_reply
from .engine._schema import schema_grammar as schema_grammar
from .kv._pool import AgentBlocks as AgentBlocks
from .kv._pool import BlockPool as BlockPool
from .kv._pool import KVBlock as KVBlock
from .kv._pool import PoolStatistics as PoolStatistics
from .kv._spec import BLOCK_SIZE as BLOCK_SIZE
from .kv._spec import SLIDING_MARGIN as SLIDING_MARGIN
from .kv._spec import LayerKind as LayerKind
from .kv._spec import LayerSpec as LayerSpec
from .kv._spec import ModelCacheSpec as ModelCacheSpec
from .residency._image import BlockEntry as BlockEntry
from .residency._image import CacheImage as CacheImage
from .residency._manager import EVICTION_POLICIES as EVICTION_POLICIES
from .residency._transfer import host_memory as host_memory
from .service._actor import Scheduler as Scheduler
from .service._coming import Expected as Expected
from .service._protocol import CacheStore as CacheStore
from .service._protocol import SchedulerStatistics as SchedulerStatistics
from .service._protocol import Turn as Turn
