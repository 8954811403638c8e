"""A chat choice's output read for tool calls, in OpenAI's shapes: the whole message
(`message.tool_calls`, `content` null or the text outside the calls) and the streamed deltas
(a call goes out whole once its markup closes: index, id, type, name and arguments in one
delta; text before it streams as content; the markup never does).

A call is sent only once it is complete and has parsed, so a streamed response joins to exactly
the non-streamed one, and a malformed call is content in both; a call the output's end cut
("length", "abort") is in neither. `finish_reason` is "tool_calls" when the output ended by
itself ("stop") having called a tool; a cut output keeps "length".
"""

from __future__ import annotations

from typing import Any

from aieng.server.generation import Delta
from aieng.server.tool_calls import call_id
from aieng.server.tool_parsers import ParsedCall, ParsedOutput, ToolCallStream, ToolParser


def assistant_message(
    text: str, finish_reason: str | None, parser: ToolParser | None
) -> tuple[dict[str, Any], str | None]:
    """The message of a whole choice, and its finish_reason."""
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parser.parse(text, cut=_cut(finish_reason))
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, finish_reason
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [_call(call) for call in parsed.calls],
    }
    return message, _finish_reason(finish_reason, called=True)


class ToolCallDeltas:
    """Each streamed choice's text read for calls as it arrives (one reader per choice)."""

    def __init__(self, parser: ToolParser | None):
        self.parser = parser
        self.streams: dict[int, ToolCallStream] = {}
        self.calls_sent: dict[int, int] = {}

    def delta(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        """The delta of what `d` adds that can be sent now, and the finish_reason."""
        if self.parser is None:
            return {"content": d.text}, d.finish_reason
        stream = self.streams.setdefault(d.index, self.parser.stream())
        out = stream.feed(d.text)
        if d.finish_reason is not None:
            tail = stream.finish(cut=_cut(d.finish_reason))
            out = ParsedOutput(out.content + tail.content, out.calls + tail.calls)
        delta: dict[str, Any] = {}
        if out.content:
            delta["content"] = out.content
        if out.calls:
            first = self.calls_sent.get(d.index, 0)
            self.calls_sent[d.index] = first + len(out.calls)
            delta["tool_calls"] = [
                {"index": first + n, **_call(call)} for n, call in enumerate(out.calls)
            ]
        called = self.calls_sent.get(d.index, 0) > 0
        return delta, _finish_reason(d.finish_reason, called)


def _call(call: ParsedCall) -> dict[str, Any]:
    return {
        "id": call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _cut(reason: str | None) -> bool:
    """The output did not end by itself (an EOS or a stop string)."""
    return reason is not None and reason != "stop"


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason
