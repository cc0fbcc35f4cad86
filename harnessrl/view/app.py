"""The trace viewer's Starlette app: routes, query validation, error pages, the token gate.

In: a `ViewConfig` and a read-only trace store. Out: server-rendered HTML pages (Jinja2 with
autoescape, a strict Content-Security-Policy: no inline script can run, whatever a trace holds).
"""

from __future__ import annotations

import hmac
import json
import sqlite3
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
import psycopg
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from harnessrl.data.pipeline import DataConfig
from harnessrl.http.types import Receive, Scope, Send
from harnessrl.report import read_metrics
from harnessrl.traces import open_store
from harnessrl.traces.schema import RolloutState, UnknownRollout
from harnessrl.traces.sql import SQLStoreBase
from harnessrl.view.calls import call_pages, prompt_messages, turn_of
from harnessrl.view.config import ViewConfig
from harnessrl.view.queries import Filters, TraceReader, UnknownCall, UnknownGroup, step_of
from harnessrl.view.sequences import HEAT_CLASSES, merged_view
from harnessrl.view.svg import charts
from harnessrl.view.tokens import Decode, cached_decode, decoder_for

HERE = Path(__file__).parent
COOKIE = "harnessrl_view"
MAX_TEXT_PARAM = 256
HEADERS = {
    # Only our own stylesheet and script; inline script and handlers never run.
    "content-security-policy": "default-src 'none'; style-src 'self'; script-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


class BadParam(ValueError):
    """A query parameter the page cannot use (answered with 400)."""


def open_reader(cfg: ViewConfig) -> TraceReader:
    """The store read-only; a missing, corrupt or unreachable store is a ValueError saying so."""
    try:
        store = open_store(cfg.store_url, read_only=True)
    except (sqlite3.Error, psycopg.Error) as err:
        raise ValueError(f"cannot open the trace store {cfg.store_url!r}: {err}") from err
    assert isinstance(store, SQLStoreBase)
    return TraceReader(store)


def data_config(runs: str) -> DataConfig:
    """The run's own data config (config.json in its out_dir), else the defaults."""
    path = Path(runs) / "config.json" if runs else None
    if path is None or not path.is_file():
        return DataConfig()
    try:
        data = dict(json.loads(path.read_text()).get("data") or {})
        data["buckets"] = tuple(tuple(b) for b in data.get("buckets", DataConfig().buckets))
        return DataConfig(**data)
    except (ValueError, TypeError):
        return DataConfig()


# ---- query parameters ----------------------------------------------------------------------


def _int(low: int, high: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise BadParam(f"{name} must be an integer, got {raw!r:.60}") from None
        if not low <= value <= high:
            raise BadParam(f"{name} must be in [{low}, {high}], got {value}")
        return value

    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        if raw not in choices:
            raise BadParam(f"{name} must be one of {', '.join(choices)}, got {raw!r:.60}")
        return raw

    return parse


def _text(name: str, raw: str) -> str:
    if len(raw) > MAX_TEXT_PARAM:
        raise BadParam(f"{name} is longer than {MAX_TEXT_PARAM} characters")
    return raw


LIST_PARAMS: dict[str, Callable[[str, str], Any]] = {
    "step": _int(0, 10**9),
    "phase": _choice(("train", "eval")),
    "task": _text,
    "group": _text,
    "state": _choice(tuple(s.value for s in RolloutState)),
    "page": _int(1, 10**6),
}


def parse_query(request: Request, spec: Mapping[str, Callable[[str, str], Any]]) -> dict[str, Any]:
    """Known parameters, parsed; empty ones are unset; anything else is a BadParam."""
    out: dict[str, Any] = {}
    for name, raw in request.query_params.multi_items():
        if name not in spec:
            allowed = ", ".join(spec) or "none"
            raise BadParam(f"unknown query parameter {name!r:.60}; this page takes: {allowed}")
        if name in out:
            raise BadParam(f"query parameter {name!r} is given twice")
        if raw != "":
            out[name] = spec[name](name, raw)
    return out


# ---- pages ---------------------------------------------------------------------------------


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["q"] = lambda v: quote(str(v), safe="")
    env.filters["num"] = lambda v, f="{:.3f}": "—" if v is None else f.format(v)
    env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    env.filters["pretty"] = lambda v: json.dumps(v, indent=1, ensure_ascii=False, default=str)
    env.globals["step_of"] = step_of
    env.globals["zip"] = zip
    return env


class Pages:
    """The page handlers over one reader; each renders one template."""

    def __init__(
        self, cfg: ViewConfig, reader: TraceReader, decode: Decode | None, note: str
    ) -> None:
        self.cfg, self.reader = cfg, reader
        self.env = _env()
        self.data = data_config(cfg.runs)
        self.decode, self.token_note = decode, note

    def render(self, name: str, code: int = 200, **values: Any) -> HTMLResponse:
        body = self.env.get_template(name).render(**values)
        return HTMLResponse(body, status_code=code)

    def rollouts(self, request: Request) -> Response:
        q = parse_query(request, LIST_PARAMS)
        page = q.pop("page", 1)
        filters = Filters(**q)
        found = self.reader.page(filters, page, self.cfg.page_size)
        query = {k: v for k, v in q.items()}
        return self.render(
            "rollouts.html",
            page=found,
            filters=filters,
            query=query,
            states=[s.value for s in RolloutState],
        )

    def rollout(self, request: Request) -> Response:
        parse_query(request, {})
        rid = request.path_params["rollout_id"]
        detail = self.reader.detail(rid)
        return self.render("rollout.html", rollout=detail.rollout, calls=call_pages(detail.calls))

    def call_tokens(self, request: Request) -> Response:
        parse_query(request, {})
        call = self.reader.call(request.path_params["rollout_id"], request.path_params["seq"])
        return self.render("tokens.html", call=call)

    def call_prompt(self, request: Request) -> Response:
        parse_query(request, {})
        call = self.reader.call(request.path_params["rollout_id"], request.path_params["seq"])
        turns = [turn_of(m, limit=10**9) for m in prompt_messages(call.request or {})]
        return self.render("prompt.html", call=call, turns=turns)

    def sequences(self, request: Request) -> Response:
        parse_query(request, {})
        rid = request.path_params["rollout_id"]
        calls = self.reader.calls(rid)
        rollout = self.reader.rollout(rid)
        group = [row.rollout for row in self.reader.group(rollout.group_id)]
        merged = merged_view(rollout, calls, group, self.data, self.decode)
        return self.render(
            "sequences.html",
            rollout=rollout,
            merged=merged,
            heat=range(HEAT_CLASSES),
            text=self.decode is not None,
            note=self.token_note,
        )

    def group(self, request: Request) -> Response:
        parse_query(request, {})
        gid = request.path_params["group_id"]
        rows = self.reader.group(gid)
        adv = merged_advantages(rows, self.data)
        return self.render("group.html", group_id=gid, rows=rows, adv=adv)

    def curves(self, request: Request) -> Response:
        parse_query(request, {})
        metrics = Path(self.cfg.runs) / "metrics.jsonl" if self.cfg.runs else None
        if metrics is None or not metrics.is_file():
            why = (
                "start the viewer with --runs OUT_DIR to see a run's training curves"
                if metrics is None
                else f"{metrics} does not exist (yet): the run writes it after its first eval"
            )
            return self.render("curves.html", charts=[], why=why)
        return self.render("curves.html", charts=charts(read_metrics(metrics)), why="")


def merged_advantages(rows: list[Any], cfg: DataConfig) -> dict[str, Any]:
    from harnessrl.data.advantages import compute_advantages

    adv = compute_advantages(
        [r.rollout for r in rows],
        estimator=cfg.estimator,
        std_normalize=cfg.std_normalize,
        eps=cfg.adv_eps,
        drop_zero_variance=cfg.drop_zero_variance,
        include_failed=cfg.include_failed,
        failed_reward=cfg.failed_reward,
    )
    return {"values": adv.advantages, "excluded": adv.excluded}


# ---- errors and the gate -------------------------------------------------------------------


def _error_page(pages: Pages, status: int, title: str, message: str) -> HTMLResponse:
    return pages.render("error.html", status, status=status, title=title, message=message)


def _handlers(pages: Pages) -> dict[Any, Callable[..., Any]]:
    def not_found(request: Request, exc: Exception) -> Response:
        return _error_page(pages, 404, "not found", str(exc))

    def bad(request: Request, exc: Exception) -> Response:
        return _error_page(pages, 400, "bad request", str(exc))

    def store_down(request: Request, exc: Exception) -> Response:
        return _error_page(
            pages, 503, "trace store unavailable", f"the trace store cannot be read: {exc}"
        )

    def http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = f"no page at {request.url.path}" if exc.status_code == 404 else exc.detail
        return _error_page(pages, exc.status_code, "error", message)

    return {
        UnknownRollout: not_found,
        UnknownCall: not_found,
        UnknownGroup: not_found,
        BadParam: bad,
        sqlite3.Error: store_down,
        psycopg.Error: store_down,
        HTTPException: http,
    }


class Gate:
    """Security headers on every response; with a token, nothing is served without it."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.encode(), v.encode()) for k, v in HEADERS.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        if not self.token or await self._allowed(scope, receive, with_headers):
            await self.app(scope, receive, with_headers)

    async def _allowed(self, scope: Scope, receive: Receive, send: Send) -> bool:
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None and self._ok(given):  # once from a link; then the cookie
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (
                "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in rest) if rest else ""
            )
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, given, httponly=True, samesite="strict")
            await response(scope, receive, send)
            return False
        header = request.headers.get("authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        for candidate in (bearer, request.cookies.get(COOKIE)):
            if candidate is not None and self._ok(candidate):
                return True
        response = HTMLResponse(
            "<!doctype html><title>token required</title><h1>401: token required</h1>"
            "<p>open the address the viewer printed (it carries ?token=...), or send "
            "Authorization: Bearer TOKEN</p>",
            status_code=401,
        )
        await response(scope, receive, send)
        return False

    def _ok(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode(), self.token)


def build_app(cfg: ViewConfig, reader: TraceReader | None = None, tokenizer: Any = None) -> Any:
    """The viewer's ASGI app: the store is opened read-only here unless `reader` is given, and
    `cfg.tokenizer` is loaded unless a loaded `tokenizer` is given (the train loop's own)."""
    if tokenizer is not None:
        decode: Decode | None = cached_decode(tokenizer)
        note = "token text (the run's tokenizer)"
    else:
        decode, note = decoder_for(cfg.tokenizer, cfg.runs)
    reader = reader or open_reader(cfg)
    pages = Pages(cfg, reader, decode, note)
    routes = [
        Route("/", pages.rollouts),
        Route("/rollouts/{rollout_id}", pages.rollout),
        Route("/rollouts/{rollout_id}/sequences", pages.sequences),
        Route("/rollouts/{rollout_id}/calls/{seq:int}/tokens", pages.call_tokens),
        Route("/rollouts/{rollout_id}/calls/{seq:int}/prompt", pages.call_prompt),
        Route("/groups/{group_id}", pages.group),
        Route("/curves", pages.curves),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers=_handlers(pages))
    app.state.reader = reader
    return Gate(app, cfg.token)
