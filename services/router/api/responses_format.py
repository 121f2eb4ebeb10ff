"""The Responses API's answer: a Response object, and its stream as numbered, named events.

Output items are a ``message`` (its one ``output_text`` part) and, when the request offered
tools, one ``function_call`` item per call. A stream opens each item when its first piece is
certain (tools.ToolStream: text as it comes, a call once its name is complete) and closes it
when the next begins or the output ends::

    response.created, response.in_progress
    message:        output_item.added, content_part.added, output_text.delta ...,
                    output_text.done, content_part.done, output_item.done
    function_call:  output_item.added (arguments ""), function_call_arguments.delta ...,
                    function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens)

Every event carries ``type`` and the next ``sequence_number``; there is no terminator. A failure
after the start is an ``error`` event ``{"type": "error", "code", "message", "param"}``.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar

from services.router.api.output import OutputText
from services.router.api.responses_models import ResponsesRequest
from services.router.api.tools import CallStart, StreamEvent, TextPiece, ToolPlan, ToolStream

Event = tuple[str | None, dict]


class ResponsesFormat:
    """Not frozen like the other formats: every event takes the next ``sequence_number``, and a
    stream's items are made as they come."""

    terminator: ClassVar[bytes] = b""
    n: ClassVar[int] = 1

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, tools: ToolPlan | None = None) -> None:
        self.id = response_id
        self.model = model
        self.body = body
        self.tools = tools
        self.created_at = int(time.time())
        self.num_events = 0
        self.items: list[dict] = []
        """A stream's output items so far; the last one may still be open."""
        self.is_open = False
        self.tool_stream: ToolStream | None = None if tools is None else tools.stream("call_")

    def _event(self, name: str, **data) -> Event:
        event = (name, {"type": name, **data, "sequence_number": self.num_events})
        self.num_events += 1
        return event

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _message(status: str, text: str | None) -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [] if text is None else [ResponsesFormat._part(text)]}

    @staticmethod
    def _call(status: str, call_id: str, name: str, arguments: str) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def _response(self, status: str, output: list[dict], out: OutputText | None = None) -> dict:
        usage = None if out is None else {
            "input_tokens": out.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": out.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens}
        body, tools = self.body, self.tools
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": self.model, "output": output, "parallel_tool_calls": False,
                "temperature": body.temperature, "top_p": body.top_p,
                "tool_choice": "none" if tools is None else body.tool_choice or "auto",
                "tools": [] if tools is None else [{"type": "function", "name": t.name, "description": t.description,
                                                    "parameters": t.parameters, "strict": True} for t in tools.tools],
                "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
                "metadata": body.metadata or {}, "usage": usage}

    @staticmethod
    def _status(out: OutputText, has_calls: bool) -> str:
        return "incomplete" if out.finish_reason == "length" and not has_calls else "completed"

    def response(self, outs: list[OutputText]) -> dict:
        out, = outs
        if self.tools is None:
            text, calls = out.text, []
        else:
            text, calls = self.tools.parse(out.text, "call_")
        status = self._status(out, bool(calls))
        output = [self._message(status, text)] if text or not calls else []
        output += [self._call("completed", c.id, c.name, c.arguments_json) for c in calls]
        return self._response(status, output, out)

    # ----- the stream --------------------------------------------------------------------------
    def start_events(self, outs: list[OutputText]) -> list[Event]:
        in_progress = self._response("in_progress", [])
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]

    def text_events(self, out: OutputText, text: str) -> list[Event]:
        pieces = [TextPiece(text)] if self.tool_stream is None else self.tool_stream.add(text)
        return self._piece_events(pieces)

    def _piece_events(self, pieces: list[StreamEvent]) -> list[Event]:
        events = []
        for piece in pieces:
            if isinstance(piece, CallStart):
                events += self._close_item()
                events += self._open_item(self._call("in_progress", piece.id, piece.name, ""))
            elif not piece.text:
                continue
            elif isinstance(piece, TextPiece):
                if not (self.is_open and self.items[-1]["type"] == "message"):
                    events += self._close_item()
                    events += self._open_message()
                self.items[-1]["content"][0]["text"] += piece.text
                events.append(self._event("response.output_text.delta", **self._at(), delta=piece.text, logprobs=[]))
            else:
                self.items[-1]["arguments"] += piece.text
                events.append(self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                          output_index=len(self.items) - 1, delta=piece.text))
        return events

    def _at(self) -> dict:
        """Where a text event belongs: the open message, its one part."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _open_message(self) -> list[Event]:
        events = self._open_item(self._message("in_progress", None))
        events.append(self._event("response.content_part.added", **self._at(), part=self._part("")))
        self.items[-1]["content"].append(self._part(""))
        return events

    def _open_item(self, item: dict) -> list[Event]:
        self.items.append(item)
        self.is_open = True
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close_item(self, status: str = "completed") -> list[Event]:
        if not self.is_open:
            return []
        self.is_open = False
        item = self.items[-1]
        item["status"] = status
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                       self._event("response.content_part.done", **self._at(), part=self._part(text))]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=len(self.items) - 1, arguments=item["arguments"]))
        return [*events, self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)]

    def choice_end_events(self, out: OutputText) -> list[Event]:
        return []

    def end_events(self, outs: list[OutputText]) -> list[Event]:
        out, = outs
        events = [] if self.tool_stream is None else self._piece_events(self.tool_stream.finish(out.text))
        has_calls = self.tool_stream is not None and self.tool_stream.has_calls
        status = self._status(out, has_calls)
        if not self.items:  # no output at all: still one (empty) message
            events += self._open_message()
        events += self._close_item("incomplete" if status == "incomplete" else "completed")
        final = self._response(status, self.items, out)
        return [*events, self._event(f"response.{status}", response=final)]

    def error_event(self, body: dict) -> Event:
        error = body["error"]
        return self._event("error", code=error["code"] or error["type"], message=error["message"],
                           param=error["param"])
