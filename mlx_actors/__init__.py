"""mlx-actors: multi-agent programs on local MLX language models.

Agents are long-lived actors that keep their conversation and KV cache (as blocks of a
shared pool); one scheduler batches every agent's turns through mlx-lm. The public API
is what this module re-exports; the subpackages are its three layers, from the bottom:
``scheduler`` (token ids and cache blocks), ``actors`` (agents) and ``runtime`` (model
loading, the ``Runtime``, tracing).
"""

from . import errors as errors
from ._threads import clear_streams_when_thread_ends as _clear_streams_when_thread_ends
from .actors import Agent as Agent
from .actors import AgentStatistics as AgentStatistics
from .actors import Message as Message
from .actors import Reply as Reply
from .actors import Tool as Tool
from .actors import ToolCall as ToolCall
from .actors import TurnSettings as TurnSettings
from .actors import TurnStream as TurnStream
from .actors import gather as gather
from .actors import tool as tool
from .runtime import Runtime as Runtime
from .runtime import RuntimeStatistics as RuntimeStatistics
from .runtime import run as run
from .scheduler import PoolStatistics as PoolStatistics
from .scheduler import Usage as Usage

# Importing mlx-lm (above) gave this thread MLX state that must not outlive it.
_clear_streams_when_thread_ends()

__version__ = "0.1.0"
