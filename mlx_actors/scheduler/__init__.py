"""The scheduler side: token ids in, token ids and cache blocks out.

``ModelCacheSpec`` reads a model's cache shape, ``BlockPool`` budgets 256-token blocks,
and ``BlockPoolBatchEngine`` runs every sequence through one mlx-lm ``BatchGenerator``.
It knows nothing of chats, names or templates.
"""

from ._actor import Scheduler as Scheduler
from ._actor import SchedulerStatistics as SchedulerStatistics
from ._actor import Turn as Turn
from ._engine import BlockPoolBatchEngine as BlockPoolBatchEngine
from ._engine import CompletedGeneration as CompletedGeneration
from ._engine import EngineStatistics as EngineStatistics
from ._engine import Sampling as Sampling
from ._engine import StepInfo as StepInfo
from ._engine import TokenEvent as TokenEvent
from ._engine import Usage as Usage
from ._pool import AgentBlocks as AgentBlocks
from ._pool import BlockPool as BlockPool
from ._pool import KVBlock as KVBlock
from ._pool import PoolStatistics as PoolStatistics
from ._spec import BLOCK_SIZE as BLOCK_SIZE
from ._spec import LayerKind as LayerKind
from ._spec import LayerSpec as LayerSpec
from ._spec import ModelCacheSpec as ModelCacheSpec
