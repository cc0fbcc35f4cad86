"""Capture: the SSE tee and the call record built from what the upstream returned.

In: upstream response bytes (whole, or SSE chunks as they arrive). Out: bytes to forward to the
client unchanged, the `data: [DONE]` event held back until the record is durable, and a
`CallRecord` whose token ids and logprobs come from `harnessrl.traces.parse`.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from harnessrl.http.listener import error_body
from harnessrl.traces.parse import CaptureError, StreamAssembler, parse_response
from harnessrl.traces.schema import CallRecord, Choice, EndpointKind


class SSETee:
    """Forwards complete SSE events and folds their payloads into an assembled response."""

    def __init__(self, endpoint: EndpointKind) -> None:
        self.assembler = StreamAssembler(endpoint)
        self.capture_error: str | None = None
        self._tail = b""
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes of `chunk` that may go to the client now (whole events, never `[DONE]`)."""
        if self._held:  # nothing follows [DONE] in a well-formed stream; keep order anyway
            self._held += chunk
            return b""
        buf = self._tail + chunk if self._tail else chunk
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0:
            self._tail = buf
            return b""
        complete, self._tail = buf[:end], buf[end:]
        self._parse(complete)
        if self.assembler.done:
            done = complete.rfind(b"[DONE]")
            start = complete.rfind(b"\n", 0, done) + 1
            self._held = complete[start:] + self._tail
            self._tail = b""
            return complete[:start]
        return complete

    def finish(self) -> bytes:
        """Everything still held: the final event(s), released once the record is stored."""
        out, self._held, self._tail = self._held + self._tail, b"", b""
        return out

    def _parse(self, complete: bytes) -> None:
        if self.capture_error is not None:
            return
        try:
            for line in complete.split(b"\n"):
                if line.startswith(b"data:"):
                    self.assembler.feed(line[5:].strip())
        except CaptureError as err:
            self.capture_error = f"capture: {err}"


def error_message(body: Any) -> str:
    """The message of an upstream error body, or a short description of it."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))[:500]
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])[:500]
    return "non-JSON error body"


def decode_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def build_record(
    *,
    endpoint: EndpointKind,
    rollout_id: str,
    started: float,
    request: dict[str, Any],
    status: int,
    body: Any,
    upstream: str,
    policy_version: int | None,
    error: str | None = None,
) -> CallRecord:
    """The call record; capture problems become the record's error, never an exception."""
    prompt: tuple[int, ...] = ()
    choices: tuple[Choice, ...] = ()
    if error is None and status == 200:
        try:
            prompt, choices = parse_response(endpoint, body)
        except CaptureError as err:
            error = f"capture: {err}"
    elif error is None:
        error = f"upstream HTTP {status}: {error_message(body)}"
    finished = time.time()
    return CallRecord(
        rollout_id=rollout_id,
        seq=-1,
        started_at=started,
        finished_at=finished,
        endpoint=endpoint,
        request=request,
        response=body if isinstance(body, dict) else None,
        prompt_token_ids=prompt,
        choices=choices,
        policy_version=policy_version,
        upstream=upstream,
        latency_ms=(finished - started) * 1000.0,
        status=status,
        error=error,
    )


def sse_error_event(message: str, status: int = 502) -> bytes:
    """An in-stream error in vLLM's shape; OpenAI clients raise on it instead of truncating."""
    return b"data: " + orjson.dumps(error_body(status, message, "upstream_error")) + b"\n\n"
