"""Multi-turn tool gyms: the environment protocol, Qwen-style tool calls, the built-in table and research gyms.

Pure Python (no torch): the driver runs gyms next to the loss.
"""

from gyms.protocol import Env, EpisodeMetrics, StepResult, Task, TaskSource
from gyms.registry import GymRegistryError, make_env_factory
from gyms.research import ResearchGym
from gyms.table import TableGym
from gyms.tools import Tool, ToolCall, ToolCallError, ToolError, calc, format_tool_call, parse_tool_call

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
