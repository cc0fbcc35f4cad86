"""SSE framing both ways: the upstream's completion stream in, a dialect's named events out.

In: raw chunks of the upstream's `/v1/completions` stream. Out: their `data:` payloads, and the
completion text split as it grows into what may be shown now: reasoning, and content that can no
longer turn into a `<tool_call>` block (which is sent whole, once the completion is done).
"""

from __future__ import annotations

from typing import Any

import orjson

from harnessrl.model.tool_calls import TOOL_CALL_OPEN
from proxy_sidecar.dialects.call import THINK_CLOSE, THINK_OPEN


def event(name: str, data: dict[str, Any]) -> bytes:
    """One named SSE event, as the Responses and Messages APIs frame them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class SSEReader:
    """Splits an SSE byte stream into the payloads of its `data:` lines, event by event."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._tail + chunk
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        complete, self._tail = buf[:end], buf[end:]
        return [
            line[5:].strip()
            for line in complete.replace(b"\r\n", b"\n").split(b"\n")
            if line.startswith(b"data:")
        ]


def _holdback(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class TextSplitter:
    """The completion text as it grows → new reasoning and content that are safe to show.

    What is shown is always a prefix of what `split_output` makes of the final text, so a stream
    never has to take anything back; the rest is sent once the completion is done.
    """

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.text = ""
        self.reasoning_sent = ""
        self.content_sent = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """New (reasoning, content) that may be shown now."""
        self.text += delta
        reasoning, content = self._safe()
        new_r = new_c = ""
        if reasoning.startswith(self.reasoning_sent):
            new_r, self.reasoning_sent = reasoning[len(self.reasoning_sent) :], reasoning
        if content.startswith(self.content_sent):
            new_c, self.content_sent = content[len(self.content_sent) :], content
        return new_r, new_c

    def _safe(self) -> tuple[str, str]:
        text = self.text
        stripped = text.lstrip()
        if THINK_OPEN.startswith(stripped):
            return "", ""  # may still open a reasoning block
        reasoning = ""
        if stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN) :]
            end = body.find(THINK_CLOSE)
            if end < 0:
                return body[: len(body) - _holdback(body, THINK_CLOSE)], ""
            reasoning, text = body[:end], body[end + len(THINK_CLOSE) :].lstrip()
        if self.tools:
            at = text.find(TOOL_CALL_OPEN)
            text = text[:at] if at >= 0 else text[: len(text) - _holdback(text, TOOL_CALL_OPEN)]
            if not text.strip():  # blank text before a tool call is no content at all
                text = ""
        return reasoning, text
