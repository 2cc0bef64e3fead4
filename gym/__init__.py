"""Multi-turn tool gyms: the environment protocol, Qwen-style tool calls, the built-in table and research gyms.

Pure Python (no torch): the driver runs gyms next to the loss.
"""

from gym.protocol import Env, EpisodeMetrics, StepResult, Task, TaskSource
from gym.registry import GymRegistryError, make_env_factory
from gym.research import ResearchGym
from gym.table import TableGym
from gym.tools import Tool, ToolCall, ToolCallError, ToolError, calc, format_tool_call, parse_tool_call

__all__ = [
    "Env",
    "EpisodeMetrics",
    "GymRegistryError",
    "ResearchGym",
    "StepResult",
    "TableGym",
    "Task",
    "TaskSource",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolError",
    "calc",
    "format_tool_call",
    "make_env_factory",
    "parse_tool_call",
]
