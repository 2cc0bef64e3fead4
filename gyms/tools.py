"""Tool declarations, Qwen-style tool-call parsing and the safe arithmetic evaluator ``calc``.

A model turn calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
``parse_tool_call`` never raises: it returns a ``ToolCall``, ``None`` (no tag: a final answer) or a
``ToolCallError`` whose ``observation`` tells the model what was wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ERROR_PREFIX = "error: "

MAX_TOOL_CALL_CHARS = 2000  # the JSON body between the tags
_ECHO_CHARS = 32  # how much of a bad value an error message may quote

# JSON-schema type name -> description used in error messages.
_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean"}


class ToolError(Exception):
    """Raised by a tool's callable when it refuses its arguments; the message becomes ``error: <message>``."""


@dataclass(frozen=True)
class Tool:
    """A tool declaration: name, description, a JSON-schema ``parameters`` object and the Python callable.

    ``parameters`` supports ``{"type": "object", "properties": {name: {"type": T, "description": ...}},
    "required": [...]}`` with T in string / integer / number / boolean. ``fn(**arguments) -> str``
    returns the observation text, or raises ``ToolError``. With ``takes_context`` the tool also gets ``context=``, the
    episode's data the gym sends with each call (for a stateless server: the table gym's table).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str] = field(compare=False, repr=False)
    takes_context: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        _check_declaration(self.name, self.parameters)

    @property
    def properties(self) -> dict[str, dict[str, Any]]:
        return self.parameters.get("properties", {})

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))

    def signature(self) -> str:
        """Compact text form, e.g. ``lookup(key: string)``."""
        args = ", ".join(f"{name}: {spec['type']}" for name, spec in self.properties.items())
        return f"{self.name}({args})"

    def to_schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen ``tools=[...]`` entry for chat templates."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _check_declaration(name: str, parameters: dict[str, Any]) -> None:
    """Reject a tool declaration this module cannot validate arguments against."""
    if not name or not isinstance(name, str):
        raise ValueError(f"tool name must be a non-empty string, got {name!r}")
    if parameters.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters.type must be 'object'")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"tool {name!r}: parameters.properties must be a dict")
    for prop, spec in properties.items():
        if not isinstance(spec, dict) or spec.get("type") not in _TYPE_WORDS:
            raise ValueError(
                f"tool {name!r}: parameter {prop!r} needs a type among {sorted(_TYPE_WORDS)}, got {spec!r}"
            )
    for prop in parameters.get("required", []):
        if prop not in properties:
            raise ValueError(f"tool {name!r}: required parameter {prop!r} is not in properties")


def one_arg_tool(name: str, description: str, param: str, param_description: str, fn: Callable[..., Any],
                 type_: str = "string") -> Tool:
    """A tool with a single required argument (the shape of every built-in tool)."""
    return Tool(name=name, description=description, fn=fn, parameters={
        "type": "object",
        "properties": {param: {"type": type_, "description": param_description}},
        "required": [param],
    })


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a known tool with validated arguments."""

    name: str
    arguments: dict[str, Any]

    def render(self) -> str:
        return format_tool_call(self.name, self.arguments)


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` tag was present but unusable; ``observation`` is what the model sees."""

    message: str
    tool_name: str | None = None

    @property
    def observation(self) -> str:
        return ERROR_PREFIX + self.message


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """Canonical turn text of a tool call (``json.dumps`` with default separators)."""
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE


def has_tool_call(text: str) -> bool:
    """True when the text contains a ``<tool_call>`` tag (then it is not a final answer)."""
    return TOOL_CALL_OPEN in text


def _short(text: str) -> str:
    """A user-supplied string cut to a length an error message may quote."""
    return text if len(text) <= _ECHO_CHARS else text[:_ECHO_CHARS] + "..."


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def _extract_body(text: str) -> str | ToolCallError:
    """The JSON text between the single ``<tool_call>`` tag and its closing tag."""
    start = text.find(TOOL_CALL_OPEN)
    body_start = start + len(TOOL_CALL_OPEN)
    if text.find(TOOL_CALL_OPEN, body_start) != -1:
        return ToolCallError("only one <tool_call> per turn")
    end = text.find(TOOL_CALL_CLOSE, body_start)
    if end == -1:
        return ToolCallError("missing </tool_call>")
    body = text[body_start:end].strip()
    if not body:
        return ToolCallError("empty <tool_call>")
    if len(body) > MAX_TOOL_CALL_CHARS:
        return ToolCallError(f"tool call too long ({len(body)} chars, max {MAX_TOOL_CALL_CHARS})")
    return body


def _decode_json(body: str) -> Any | ToolCallError:
    """``json.loads`` that reports instead of raising (bad syntax, NaN, giant ints, deep nesting)."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    except ValueError as exc:  # int digit limit, NaN/Infinity
        return ToolCallError(f"tool call is not valid JSON ({str(exc)[:60]})")
    except RecursionError:
        return ToolCallError("tool call JSON is nested too deeply")


_XML_FUNCTION = "<function="
_XML_CALL = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _decode_xml(body: str, tools: Sequence[Tool]) -> dict | ToolCallError:
    """Qwen3.5/3.6's tool-call form (their chat templates write calls this way):

        <function=NAME>
        <parameter=ARG>
        VALUE
        </parameter>
        </function>

    as {"name", "arguments"}. Values are text; a parameter the tool declares as integer, number or boolean is
    read as JSON (``7`` -> 7), so the same argument checks apply as to the JSON form."""
    m = _XML_CALL.fullmatch(body.strip())
    if m is None:
        return ToolCallError("tool call is neither a JSON object nor <function=NAME>...</function>")
    name, inner = m.group(1).strip(), m.group(2)
    arguments: dict[str, Any] = {}
    for pm in _XML_PARAM.finditer(inner):
        arguments[pm.group(1).strip()] = pm.group(2)
    if _XML_PARAM.sub("", inner).strip():
        return ToolCallError("text between <parameter=...> blocks of the tool call", tool_name=name)
    spec = {t.name: t for t in tools}.get(name)
    for key, value in list(arguments.items()):
        kind = spec.properties.get(key, {}).get("type") if spec is not None else None
        if kind in ("integer", "number", "boolean"):
            decoded = _decode_json(value.strip())
            arguments[key] = value if isinstance(decoded, ToolCallError) else decoded
    return {"name": name, "arguments": arguments}


def _check_type(value: Any, type_name: str) -> bool:
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_name == "integer":
        return isinstance(value, int)
    if type_name == "number":
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    return False


def validate_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """The first problem with ``arguments`` for ``tool`` (message without the ``error:`` prefix), or None."""
    for name in tool.required:
        if name not in arguments:
            return f"arguments.{name} is required for {tool.name}"
    for name, value in arguments.items():
        spec = tool.properties.get(name)
        if spec is None:
            known = ", ".join(tool.properties) or "none"
            return f"arguments.{_short(name)} is not a parameter of {tool.name} (parameters: {known})"
        if not _check_type(value, spec["type"]):
            return f"arguments.{name} must be {_TYPE_WORDS[spec['type']]}"
    return None


def parse_tool_call(text: str, tools: Sequence[Tool]) -> ToolCall | ToolCallError | None:
    """Parse one model turn.

    No ``<tool_call>`` tag → None (a final answer). A tag → a validated ``ToolCall`` or a
    ``ToolCallError`` saying what was wrong. Never raises on any text.
    """
    if not isinstance(text, str):
        return ToolCallError(f"answer must be text, got {type(text).__name__}")
    if not has_tool_call(text):
        return None
    body = _extract_body(text)
    if isinstance(body, ToolCallError):
        return body
    payload = _decode_xml(body, tools) if body.startswith(_XML_FUNCTION) else _decode_json(body)
    if isinstance(payload, ToolCallError):
        return payload
    if not isinstance(payload, dict):
        return ToolCallError('tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = payload.get("name")
    if name is None:
        return ToolCallError('tool call needs "name"')
    if not isinstance(name, str):
        return ToolCallError("name must be a string")
    by_name = {tool.name: tool for tool in tools}
    tool = by_name.get(name)
    if tool is None:
        return ToolCallError(f"unknown tool {_short(name)!r} (tools: {', '.join(by_name)})")
    if "arguments" not in payload:
        return ToolCallError('tool call needs "arguments" (an object)', tool_name=name)
    arguments = payload["arguments"]
    if not isinstance(arguments, dict):
        return ToolCallError("arguments must be an object", tool_name=name)
    problem = validate_arguments(tool, arguments)
    if problem is not None:
        return ToolCallError(problem, tool_name=name)
    return ToolCall(name=name, arguments=arguments)


def run_tool(call: ToolCall, tools: Sequence[Tool]) -> tuple[str, bool]:
    """Run a parsed call; return (observation, is_error). A ``ToolError`` becomes ``error: <message>``."""
    tool = {t.name: t for t in tools}[call.name]
    try:
        return tool.fn(**call.arguments), False
    except ToolError as exc:
        return ERROR_PREFIX + str(exc), True


# ---------------------------------------------------------------------------------------------------
# calc: a recursive-descent evaluator for + - * / ( ), unary minus, integers and decimals. Never eval.
# ---------------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = Fraction(10) ** 15
MAX_NESTING = 32


class CalcError(ToolError):
    """The expression could not be evaluated; the message says why."""


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := ('-'|'+')* primary ; primary := number | '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def parse(self) -> Fraction:
        value = self.expr()
        self.skip_spaces()
        if self.pos < len(self.text):
            raise CalcError(f"unexpected {self.text[self.pos]!r} at position {self.pos}")
        return value

    def skip_spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\n":
            self.pos += 1

    def peek(self) -> str:
        self.skip_spaces()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            rhs = self.term()
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op = self.text[self.pos]
            self.pos += 1
            rhs = self.unary()
            if op == "*":
                value = _checked(value * rhs)
            elif rhs == 0:
                raise CalcError("division by zero")
            else:
                value = _checked(value / rhs)
        return value

    def unary(self) -> Fraction:
        negative = False
        while self.peek() in ("-", "+"):
            negative ^= self.text[self.pos] == "-"
            self.pos += 1
        value = self.primary()
        return -value if negative else value

    def primary(self) -> Fraction:
        char = self.peek()
        if char == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise CalcError(f"too many nested parentheses (max {MAX_NESTING})")
            self.pos += 1
            value = self.expr()
            if self.peek() != ")":
                raise CalcError(f"missing ')' at position {self.pos}")
            self.pos += 1
            self.depth -= 1
            return value
        if char.isascii() and (char.isdigit() or char == "."):
            return self.number()
        if not char:
            raise CalcError("unexpected end of expression")
        raise CalcError(f"unexpected {char!r} at position {self.pos}")

    def number(self) -> Fraction:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isascii() and self.text[self.pos].isdigit():
            self.pos += 1
        if self.pos < len(self.text) and self.text[self.pos] == ".":
            self.pos += 1
            while self.pos < len(self.text) and self.text[self.pos].isascii() and self.text[self.pos].isdigit():
                self.pos += 1
        literal = self.text[start : self.pos]
        if literal == ".":
            raise CalcError(f"bad number {literal!r} at position {start}")
        return _checked(Fraction(literal))


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("number too large (limit 1e15)")
    return value


def format_number(value: Fraction) -> str:
    """``19`` for integral values, otherwise up to 10 significant digits (``2.5``, ``0.3333333333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".10g")


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raise ``CalcError`` saying what was wrong."""
    if not isinstance(expression, str):
        raise CalcError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression too long ({len(expression)} chars, max {MAX_EXPRESSION_CHARS})")
    if not expression.strip():
        raise CalcError("empty expression")
    return _Parser(expression).parse()


def calc_tool_fn(expression: str) -> str:
    """The ``calc`` tool's callable: the formatted result, or ``CalcError``."""
    return format_number(evaluate(expression))


def calc(expression: str) -> str:
    """Evaluate ``expression``; return the result text (``"19"``, ``"2.5"``) or ``"error: <why>"``."""
    try:
        return calc_tool_fn(expression)
    except CalcError as exc:
        return ERROR_PREFIX + str(exc)


CALC_TOOL = one_arg_tool("calc", "Evaluate arithmetic with + - * / and parentheses.", "expression", "e.g. 7 + 12",
                         calc_tool_fn)
