"""Tool calling, shared by chat completions and Messages: the tools a request offers become a
section of the prompt and a grammar; the generated text becomes tool calls again.

A call is spelled ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes / Qwen
convention). The grammar makes the spelling exact, so parsing never guesses:

* ``auto``: free text, but once the model writes ``<tool_call>`` it must finish a call to one of
  the tools with arguments matching that tool's JSON schema (a structural tag);
* ``required`` / a named tool: the whole output is one call, as bare JSON
  ``{"name": ..., "arguments": ...}`` constrained by the schema(s).

A model whose chat template renders ``tools`` itself gets them as the ``tools`` variable; any other
template gets a system-prompt section that describes them, and the conversation's earlier calls and
results spelled in the same convention.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from services.common.errors import invalid
from services.common.sampling_params import StructuredOutput
from services.router.api.body_checks import parse_json_text

BEGIN, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    """The arguments' JSON schema."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def check_tool(name, description, parameters, param: str) -> Tool:
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "_-" for c in name):
        raise invalid(f"{param}.name {name!r} is invalid: 1 to 64 letters, digits, _ or -", f"{param}.name")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"{param}: the parameters must be a JSON schema object", param)
    return Tool(name, description or "", parameters)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: str
    """``auto``, ``required``, or the name of the tool that must be called."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise invalid(f"tool names must be unique, got {names}", "tools")
        if self.choice not in ("auto", "required") and self.choice not in names:
            raise invalid(f"tool_choice names {self.choice!r}, which is not one of the tools {names}", "tool_choice")

    @property
    def is_forced(self) -> bool:
        """The output is one call and nothing else."""
        return self.choice != "auto"

    def _call_schema(self, tool: Tool) -> dict:
        return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    def structured(self) -> StructuredOutput:
        if self.is_forced:
            tools = [t for t in self.tools if self.choice in ("required", t.name)]
            schema = self._call_schema(tools[0]) if len(tools) == 1 else {
                "anyOf": [self._call_schema(t) for t in tools]}
            return StructuredOutput("json_schema", json.dumps(schema))
        tags = [{"begin": f'{BEGIN}{{"name": {json.dumps(t.name)}, "arguments": ', "schema": t.parameters,
                 "end": f"}}{END}"} for t in self.tools]
        return StructuredOutput("structural_tag", json.dumps({"triggers": [BEGIN], "tags": tags}))

    def system_text(self) -> str:
        described = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in self.tools]
        must = ("You must call exactly one tool now."
                if self.is_forced else "Call a tool only when it helps; otherwise answer normally.")
        return (f"You can call these tools:\n<tools>\n{json.dumps(described, ensure_ascii=False)}\n</tools>\n"
                f"To call a tool, reply with {BEGIN}{{\"name\": <tool name>, \"arguments\": <arguments as JSON>}}{END}. "
                f"{must}")

    def template_tools(self) -> list[dict]:
        """The tools as chat templates that render them expect (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]

    def parse(self, text: str, id_prefix: str) -> tuple[str, list[ToolCall]]:
        """(the text outside calls, the calls). A call the output did not finish (cut by
        max_tokens) stays text."""
        if self.is_forced:
            try:
                call = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                return text, []
            return "", [ToolCall(new_call_id(id_prefix), call["name"], call["arguments"])]
        calls: list[ToolCall] = []
        content, rest = text.partition(BEGIN)[0], text
        while (start := rest.find(BEGIN)) >= 0 and (end := rest.find(END, start)) >= 0:
            try:
                call = json.loads(rest[start + len(BEGIN):end])
                calls.append(ToolCall(new_call_id(id_prefix), call["name"], call["arguments"]))
            except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
                return text, []
            rest = rest[end + len(END):]
        if not calls:
            return text, []
        return content, calls

    def stream(self, id_prefix: str) -> ToolStream:
        return ToolStream(self, id_prefix)


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str
    """The next piece of the call's arguments, as JSON text."""


StreamEvent = TextPiece | CallStart | ArgumentsPiece
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class ToolStream:
    """One choice's output with tools, as it streams: text and calls as they become certain.

    The grammar spells every call ``{"name": "<name>", "arguments": <JSON>}`` (JSON laid out like
    ``json.dumps``), so a call is announced as soon as its name is complete and its arguments then
    stream as they come, holding back only what may still turn out to be the call's closing
    ``}`` (and, with ``auto``, ``</tool_call>``) or the start of a ``<tool_call>``. Text after the
    first call is dropped, as :meth:`ToolPlan.parse` drops it. Should the output not look like
    that, everything is held to the end and :meth:`ToolPlan.parse` decides.
    """

    def __init__(self, plan: ToolPlan, id_prefix: str) -> None:
        self.plan, self.id_prefix = plan, id_prefix
        self.buffer = ""
        self.num_calls = 0
        self.in_call = False
        self.is_held = False
        """The output went off the expected shape: held to the end."""
        self.has_calls = False
        self.num_text_chars = 0
        """Text handed out so far."""

    @property
    def _end(self) -> str:
        return "}" if self.plan.is_forced else "}" + END

    def add(self, text: str) -> list[StreamEvent]:
        events = self._add(text)
        self.num_text_chars += sum(len(e.text) for e in events if isinstance(e, TextPiece))
        return events

    def _add(self, text: str) -> list[StreamEvent]:
        self.buffer += text
        events: list[StreamEvent] = []
        while not self.is_held:
            if self.in_call:
                end = self.buffer.find(self._end) if not self.plan.is_forced else -1
                if end >= 0:  # auto: the call is complete
                    events.append(ArgumentsPiece(self.num_calls - 1, self.buffer[:end]))
                    self.buffer, self.in_call = self.buffer[end + len(self._end):], False
                    continue
                safe = len(self.buffer) - len(self._end)
                if safe > 0:
                    events.append(ArgumentsPiece(self.num_calls - 1, self.buffer[:safe]))
                    self.buffer = self.buffer[safe:]
                return events
            begin = 0 if self.plan.is_forced else self.buffer.find(BEGIN)
            if begin < 0:  # auto, no call (yet): text, but not what may start a <tool_call>
                keep = next((n for n in range(min(len(BEGIN) - 1, len(self.buffer)), 0, -1)
                             if BEGIN.startswith(self.buffer[-n:])), 0)
                if not self.has_calls and len(self.buffer) > keep:
                    events.append(TextPiece(self.buffer[:len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:] if keep else ""
                return events
            if begin > 0 and not self.has_calls:
                events.append(TextPiece(self.buffer[:begin]))
            head_at = begin + (0 if self.plan.is_forced else len(BEGIN))
            self.buffer = self.buffer[begin:]
            match = _HEAD.match(self.buffer, head_at - begin)
            if match is None:
                if len(self.buffer) - (head_at - begin) >= len('{"name": "'):
                    if not self.buffer[head_at - begin:].startswith('{"name": "'):
                        self.is_held = True
                return events
            name = json.loads(match.group(1))
            if self.num_calls and self.plan.is_forced:
                self.is_held = True
                return events
            events.append(CallStart(self.num_calls, new_call_id(self.id_prefix), name))
            self.num_calls += 1
            self.has_calls = self.in_call = True
            self.buffer = self.buffer[match.end():]
        return events

    def finish(self, full_text: str) -> list[StreamEvent]:
        """What is left once the output is complete (``full_text``: all of it)."""
        if self.is_held:
            content, calls = self.plan.parse(full_text, self.id_prefix)
            content = content[self.num_text_chars:]
            events: list[StreamEvent] = [TextPiece(content)] if content else []
            for i, call in enumerate(calls):
                events += [CallStart(i, call.id, call.name), ArgumentsPiece(i, call.arguments_json)]
            self.has_calls = bool(calls)
            return events
        if self.in_call:  # forced: the closing brace; or a call cut short (it stays cut)
            rest = self.buffer[:-1] if self.plan.is_forced and self.buffer.endswith("}") else self.buffer
            return [ArgumentsPiece(self.num_calls - 1, rest)] if rest else []
        return [TextPiece(self.buffer)] if self.buffer and not self.has_calls else []


def render_call(name: str, arguments: dict | str) -> str:
    """An earlier call of the conversation, as the model would have written it."""
    if isinstance(arguments, str):
        arguments = parse_json_text(arguments or "{}", "messages",
                                    f"the arguments text of the earlier call to {name!r}")
    return f"{BEGIN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{END}"


def render_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _openai_style_plan(checked: list[Tool], tool_choice, named: str | None) -> ToolPlan:
    """``tool_choice`` ``auto`` (or omitted), ``required``, or a named function (``named``: its
    name, None when the choice does not have the named shape)."""
    if tool_choice in (None, "auto", "required"):
        return ToolPlan(tuple(checked), tool_choice or "auto")
    if named is not None:
        return ToolPlan(tuple(checked), named)
    raise invalid(f"tool_choice {tool_choice!r} is invalid: use \"none\", \"auto\", \"required\" or "
                  f"a named function", "tool_choice")


def _has_tools(tools, tool_choice) -> bool:
    """Whether OpenAI-style ``tools`` / ``tool_choice`` put tools in play."""
    if tool_choice == "none":
        return False
    if not tools and tool_choice not in (None, "auto"):
        raise invalid("tool_choice needs tools", "tool_choice")
    return bool(tools)


def openai_plan(tools, tool_choice) -> ToolPlan | None:
    """Chat completions' ``tools`` / ``tool_choice`` (named: ``{"type": "function", "function":
    {"name"}}``); None: no tools in play."""
    if not _has_tools(tools, tool_choice):
        return None
    checked = [check_tool(t.function.name, t.function.description, t.function.parameters, f"tools[{i}].function")
               for i, t in enumerate(tools)]
    is_named = (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
                and isinstance(tool_choice.get("function"), dict))
    return _openai_style_plan(checked, tool_choice, str(tool_choice["function"].get("name")) if is_named else None)


def anthropic_plan(tools: list[dict] | None, tool_choice: dict | None) -> ToolPlan | None:
    """Messages' ``tools`` / ``tool_choice`` (``auto``, ``any``, ``tool`` + name, ``none``)."""
    choice_type = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice or "auto"
    if choice_type not in ("auto", "any", "tool", "none"):
        raise invalid(f"tool_choice {tool_choice!r} is invalid: type must be auto, any, tool or none", "tool_choice")
    if not tools or choice_type == "none":
        if choice_type in ("any", "tool"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    checked = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise invalid(f"tools[{i}]: {kind!r} tools are not supported (only client tools with an "
                          f"input_schema)", f"tools[{i}]")
        checked.append(check_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), f"tools[{i}]"))
    name = {"auto": "auto", "any": "required"}.get(choice_type) or str(tool_choice.get("name"))
    return ToolPlan(tuple(checked), name)


def responses_plan(tools: list[dict] | None, tool_choice) -> ToolPlan | None:
    """The Responses API's flat function tools (``{"type": "function", "name", "parameters"}``)
    and ``tool_choice`` (named: ``{"type": "function", "name"}``); None: no tools in play."""
    if not _has_tools(tools, tool_choice):
        return None
    checked = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid(f"tools[{i}]: {tool.get('type')!r} tools are not supported (only function tools)",
                          f"tools[{i}].type")
        checked.append(check_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), f"tools[{i}]"))
    is_named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    return _openai_style_plan(checked, tool_choice, str(tool_choice.get("name")) if is_named else None)
