"""Tool-call parsers: a model's text output read back into OpenAI tool calls, chosen by name with
`aieng serve --tool-call-parser NAME` (vLLM's flag and names).

A parser knows one model family's markup both ways: it reads calls out of free text (whole or
streamed piece by piece, with the same result), and it writes the Lark grammar that makes a
constrained output (`tool_choice` "required" or a named function) consist of calls in that same
markup, so the constrained model writes what it was trained to write.

One mechanism reads both ways: `parse(text)` is `ToolCallStream.feed(text)` then `finish()`, so a
streamed response always joins to the non-streamed one. A call whose JSON is malformed stays in
the content as the model wrote it (never an error); a call still open (or a start tag begun) when
the output was cut (its length limit, an abort) is dropped, neither a call nor content;
whitespace next to a call is dropped.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

# JSON in the layout of Python's json.dumps (", " and ": "), the one chat templates render
# with `tojson`: a constrained call then looks like the calls in the prompt.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
NAME_KEY, ARGUMENTS_KEY = '\n{"name": ', ', "arguments": '


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)


@dataclass
class ParsedOutput:
    """What the text of one choice holds: the text outside the calls, and the calls."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class FunctionSpec:
    """One offered function: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


class ToolCallStream(ABC):
    """Reads one choice's text as it streams; each call gives what can be sent now."""

    @abstractmethod
    def feed(self, text: str) -> ParsedOutput: ...

    @abstractmethod
    def finish(self, cut: bool = False) -> ParsedOutput:
        """What was held back, once the output has ended; `cut`: it did not end by itself
        (its length limit, an abort), so a call left open is unfinished."""


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    @abstractmethod
    def grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of one call, or of one or more calls when
        `parallel`, to one of `functions` with arguments valid against its schema."""

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        stream = self.stream()
        head, tail = stream.feed(text), stream.finish(cut)
        return ParsedOutput(head.content + tail.content, head.calls + tail.calls)


class HermesToolParser(ToolParser):
    """Hermes, Qwen2.5 and Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    blocks, several in a row for parallel calls."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def stream(self) -> ToolCallStream:
        return _MarkupStream(self.START, self.END, _hermes_call)

    def grammar(self, functions: list[FunctionSpec], parallel: bool) -> str:
        if not functions:
            raise ValueError("a tool-call grammar needs at least one function")
        rules = [
            f"fn_{i}: {_lark_string(json.dumps(f.name) + ARGUMENTS_KEY)} "
            f"%json {json.dumps(_with_layout(f.parameters))}"
            for i, f in enumerate(functions)
        ]
        alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        opening, closing = _lark_string(self.START + NAME_KEY), _lark_string("}\n" + self.END)
        call = f"call: {opening} ({alternatives}) {closing}"
        return "\n".join([start, call, *rules]) + "\n"


def _hermes_call(body: str) -> ParsedCall | None:
    """`{"name": str, "arguments": object}` (arguments may be absent: no arguments)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict) or set(call) - {"name", "arguments"}:
        return None
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class _MarkupStream(ToolCallStream):
    """Calls between a start and an end tag, text around them. Holds back what may yet turn
    out to be a tag (a partial start tag, a call not yet closed) and trailing whitespace (it is
    dropped if a call follows)."""

    def __init__(self, start: str, end: str, read_call: Callable[[str], ParsedCall | None]):
        self.start, self.end, self.read_call = start, end, read_call
        self.buffer = ""  # text not yet handed out
        self.inside = False  # within an open call
        self.scanned = 0  # of an open call's buffer, the part searched for the end tag
        self.held_space = ""  # trailing whitespace of the content, not yet handed out
        self.after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str) -> ParsedOutput:
        out = ParsedOutput("")
        self.buffer += text
        while True:
            if self.inside:
                end = self.buffer.find(self.end, max(0, self.scanned - len(self.end) + 1))
                if end < 0:  # a long call fed token by token is searched once, not each time
                    self.scanned = len(self.buffer)
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(self.end) :]
                self.inside = False
                self._close(body, self.end, out)
                continue
            start = self.buffer.find(self.start)
            if start < 0:
                keep = _partial_tag_length(self.buffer, self.start)
                cut = len(self.buffer) - keep
                self._content(self.buffer[:cut], out)
                self.buffer = self.buffer[cut:]
                return out
            self._content(self.buffer[:start], out)  # its trailing space waits for the call
            self.buffer = self.buffer[start + len(self.start) :]
            self.inside, self.scanned = True, 0

    def finish(self, cut: bool = False) -> ParsedOutput:
        out = ParsedOutput("")
        rest, self.buffer = self.buffer, ""
        if self.inside:  # never closed: a call if it is whole (the model stopped at its end)
            self.inside = False
            self._close(rest, "", out, drop_malformed=cut)
        elif not cut:  # held back: the beginning of a start tag, which a cut output never ended
            self._content(rest, out)
        out.content += self.held_space
        self.held_space = ""
        return out

    def _close(
        self, body: str, end_tag: str, out: ParsedOutput, drop_malformed: bool = False
    ) -> None:
        call = self.read_call(body.strip())
        if call is None:  # malformed: the content, as written (cut short: nothing)
            if not drop_malformed:
                self._content(self.start + body + end_tag, out)
            return
        self.held_space = ""
        self.after_call = True
        out.calls.append(call)

    def _content(self, text: str, out: ParsedOutput) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.held_space + text
        shown = text.rstrip()
        self.held_space = text[len(shown) :]
        out.content += shown


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (without being all of it)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _lark_string(text: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(text)


def _with_layout(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's layout options, unless it sets its own."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": JSON_LAYOUT}


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}


def tool_parser(name: str) -> ToolParser:
    """The parser registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})") from None
