"""The actors: each agent is a task with a mailbox, its conversation and its cache blocks.

Actors render conversations with the chat template and send the scheduler only the
tokens their cache lacks; they never touch MLX arrays.
"""

from ._agent import Agent as Agent
from ._agent import AgentStatistics as AgentStatistics
from ._agent import Keeper as Keeper
from ._envelope import running_here as running_here
from ._reply import Message as Message
from ._reply import Reply as Reply
from ._reply import TurnStream as TurnStream
from ._settings import NAME as NAME
from ._settings import TurnOptions as TurnOptions
from ._settings import TurnSettings as TurnSettings
from ._settings import check_name as check_name
from ._settings import check_text as check_text
from ._together import gather as gather
from ._tools import Tool as Tool
from ._tools import ToolCall as ToolCall
from ._tools import as_tools as as_tools
from ._tools import check_parameters as check_parameters
from ._tools import check_tool_choice as check_tool_choice
from ._tools import check_tool_name as check_tool_name
from ._tools import tool as tool
