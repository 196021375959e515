"""The HTTP side of `kvexport serve`: an ASGI app (Starlette) that parses
OpenAI requests, renders prompts, queues them on the engine and streams
what it sends back. Nothing here waits on a step: each request waits on its
own queue, which the engine thread fills."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvexport.contract.errors import KvexportError
from kvexport.contract.trust import manifest_digest
from kvexport.runtime.server import openai_api as api
from kvexport.runtime.server.engine import (Delta, Done, Engine, Failed, Finished, GenerationRequest, QueueFull, RequestError,
                                            ShuttingDown)
from kvexport.runtime.server.metrics import Metrics
from kvexport.runtime.text import Text

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the app serves; engine and text are set once the package is loaded and verified."""

    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    text: Text | None = None
    status: str = "loading"  # "loading", "ready", "failed"
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def ready(self, engine: Engine, text: Text | None) -> None:
        self.engine, self.text, self.status = engine, text, "ready"
        m = self.metrics
        m.watch("kvexport_queue_depth", "Requests waiting to start", lambda: engine.queue_depth)
        m.watch("kvexport_running_requests", "Requests prefilling or decoding", lambda: engine.running)
        m.watch("kvexport_cells_in_use", "Cells of the pool owned by any session", engine.cells_in_use)
        m.watch("kvexport_cells_total", "Cells the pool may grow to (the scratch cell excluded)",
                lambda: engine.manager.cache.max_cells - 1)
        m.watch("kvexport_cells_allocated", "Cells the pool holds memory for now (it doubles as needed, never shrinks)",
                lambda: engine.manager.cache.capacity)
        m.watch("kvexport_requests_cancelled", "Requests cancelled before they finished (the client left)",
                lambda: engine.cancelled)
        m.watch("kvexport_prefix_cache_queries", "Prompts looked up in the prefix cache", lambda: engine.prefix.queries)
        m.watch("kvexport_prefix_cache_hits", "Prompts that reused cached cells", lambda: engine.prefix.hits)
        m.watch("kvexport_prefix_cache_entries", "Sessions kept by the prefix cache", lambda: engine.cached_entries)
        m.watch("kvexport_prefix_cache_cells", "Cells only the prefix cache holds (freed when they are needed)",
                lambda: engine.cached_cells)


class _ClientGone(Exception):
    pass


def create_app(state: ServerState, on_startup: Callable[[], None] | None = None) -> Starlette:
    async def health(request: Request) -> Response:
        body = {"status": state.status} if state.error is None else {"status": state.status, "error": state.error}
        return JSONResponse(body, status_code=200 if state.status == "ready" else 503)

    async def metrics(request: Request) -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    async def models(request: Request) -> Response:
        _authorize(state, request)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "kvexport"}]})

    async def chat(request: Request) -> Response:
        _authorize(state, request)
        parsed = api.parse_chat(await _read_json(state, request))
        engine, text = _ready(state)
        if text is None or not text.has_chat_template:
            raise api.ApiError(400, "this package has no chat template: use /v1/completions", param="messages")
        prompt = await run_in_threadpool(_encode_chat, text, parsed.messages)
        return await _generate(state, engine, request, parsed, prompt, "chat")

    async def completions(request: Request) -> Response:
        _authorize(state, request)
        parsed = api.parse_completion(await _read_json(state, request))
        engine, text = _ready(state)
        if isinstance(parsed.prompt, str):
            if text is None:
                raise api.ApiError(400, "this package carries no tokenizer: send the prompt as token ids", param="prompt")
            prompt = await run_in_threadpool(text.encode, parsed.prompt, False)
        else:
            prompt = list(parsed.prompt)
        return await _generate(state, engine, request, parsed, prompt, "completion")

    async def api_error(request: Request, error: api.ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def http_error(request: Request, error: HTTPException) -> Response:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.ApiError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind).body(),
                            status_code=error.status_code)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_startup is not None:
            on_startup()
        yield

    app = Starlette(routes=routes, exception_handlers={api.ApiError: api_error, HTTPException: http_error}, lifespan=lifespan)
    return _CountRequests(app, state.metrics)


class _CountRequests:
    """ASGI middleware: counts every answered HTTP request by path and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


# ------------------------------------------------------------------ helpers
def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), state.api_key.encode()):
        raise api.ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY' (the server's --api-key)",
                           type="invalid_request_error", code="invalid_api_key")


def _ready(state: ServerState) -> tuple[Engine, Text | None]:
    if state.engine is None:
        raise api.ApiError(503, f"the model is {state.status}; retry when GET /health answers 200",
                           type="server_error", code="model_not_ready", headers={"Retry-After": "1"})
    return state.engine, state.text


async def _read_json(state: ServerState, request: Request) -> Any:
    limit = state.max_body_bytes
    declared = request.headers.get("content-length")
    too_large = api.ApiError(413, f"the request body is larger than this server's limit of {limit} bytes",
                             code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise api.ApiError(400, f"the request body is not valid JSON: {e}") from None


def _encode_chat(text: Text, messages: list[dict]) -> list[int]:
    try:
        return text.encode_chat(messages)
    except KvexportError as e:
        raise api.ApiError(400, f"the chat template could not render these messages: {e}", param="messages") from None


def _grammar(state: ServerState, engine: Engine, response_format: tuple):
    """The grammar a response_format asks for; a schema the engine refuses is a 400 naming why."""
    from kvexport.runtime.grammar import Grammar, GrammarError

    kind, schema = response_format
    if kind == "text":
        return None
    manager = engine.manager
    try:
        if kind == "json_object":
            return Grammar.json_object(state.text, manager.vocab_size, manager.eos_ids)
        return Grammar.json_schema(state.text, schema, manager.vocab_size, manager.eos_ids)
    except GrammarError as e:
        raise api.ApiError(400, str(e), param="response_format") from None


async def _generate(state: ServerState, engine: Engine, request: Request, parsed: api.ParsedRequest, prompt: list[int],
                    kind: str) -> Response:
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else max(engine.context - len(prompt), 1)
    grammar = await asyncio.to_thread(_grammar, state, engine, parsed.response_format)
    generation = GenerationRequest(prompt, max_tokens, parsed.sampling, parsed.seed, parsed.n, parsed.stop, parsed.logprobs,
                                   parsed.ignore_eos, grammar)
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink(event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    try:
        handle = engine.submit(generation, sink)
    except RequestError as e:
        raise api.ApiError(400, str(e), param="messages" if kind == "chat" else "prompt", code="context_length_exceeded"
                           if "context" in str(e) else None) from None
    except ShuttingDown as e:
        raise api.ApiError(503, str(e), type="server_error", code="shutting_down") from None
    except QueueFull as e:
        raise api.ApiError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    state.metrics.prompt_tokens.inc(len(prompt))
    reply = _Reply(state, parsed, kind, prompt)
    events = _events(queue, request, engine, handle)
    if parsed.stream:
        return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        async for event in events:
            reply.add(event)
    except _ClientGone:
        return Response(status_code=499)
    return reply.response()


async def _events(queue: asyncio.Queue, request: Request, engine: Engine, handle) -> AsyncIterator:
    """The request's events until Done or Failed; a client that goes away
    cancels the request (its cells return to the pool at the next step)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    finished = False
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                raise _ClientGone()
            event = getter.result()
            if isinstance(event, (Done, Failed)):
                finished = True
            yield event
            if finished:
                return
    finally:
        watcher.cancel()
        if not finished:
            engine.cancel(handle)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Reply:
    """Builds the response (or the SSE stream) of one request from its events."""

    def __init__(self, state: ServerState, parsed: api.ParsedRequest, kind: str, prompt: list[int]):
        self.state, self.parsed, self.kind = state, parsed, kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.texts = [""] * parsed.n
        self.logprobs: list[list] = [[] for _ in range(parsed.n)]
        self.reasons: list[str | None] = [None] * parsed.n
        self.usage: dict | None = None
        self.error: str | None = None

    def _spell(self, token: int) -> str:
        text = self.state.text
        return text.decode([token]) if text is not None else ""

    def _logprobs(self, entries: list, offset: int = 0) -> dict | None:
        if self.parsed.logprobs is None or not entries:
            return None
        if self.kind == "chat":
            return api.chat_logprobs(entries, self._spell)
        return api.completion_logprobs(entries, self._spell, offset)

    def add(self, event) -> None:
        if isinstance(event, Delta):
            self.texts[event.choice] += event.text
            self.logprobs[event.choice] += event.logprobs or []
        elif isinstance(event, Finished):
            self.reasons[event.choice] = event.reason
        elif isinstance(event, Done):
            self.usage = api.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        elif isinstance(event, Failed):
            self.error = event.message

    def _head(self) -> dict:
        return {"id": self.id, "created": int(time.time()), "model": self.state.model_id}

    def response(self) -> Response:
        if self.error is not None:
            status = 503 if "shutting down" in self.error else 500
            return JSONResponse(api.ApiError(status, self.error, type="server_error").body(), status_code=status)
        choices = []
        for i in range(self.parsed.n):
            logprobs = self._logprobs(self.logprobs[i]) if self.parsed.logprobs is not None else None
            if self.kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": self.texts[i]},
                                "logprobs": logprobs, "finish_reason": self.reasons[i]})
            else:
                choices.append({"index": i, "text": self.texts[i], "logprobs": logprobs, "finish_reason": self.reasons[i]})
        return JSONResponse({**self._head(), "object": self.object, "choices": choices, "usage": self.usage})

    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> str:
        body = {**self._head(), "object": self.object + (".chunk" if self.kind == "chat" else ""), "choices": choices}
        if self.parsed.include_usage or with_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def stream(self, events: AsyncIterator) -> AsyncIterator[str]:
        chat = self.kind == "chat"
        if chat:
            yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(self.parsed.n)])
        offsets = [0] * self.parsed.n
        try:
            async for event in events:
                if isinstance(event, Delta):
                    if not event.text and not (self.parsed.logprobs is not None and event.logprobs):
                        continue
                    logprobs = self._logprobs(event.logprobs or [], offsets[event.choice])
                    offsets[event.choice] += len(event.text)
                    if chat:
                        choice = {"index": event.choice, "delta": {"content": event.text}, "logprobs": logprobs, "finish_reason": None}
                    else:
                        choice = {"index": event.choice, "text": event.text, "logprobs": logprobs, "finish_reason": None}
                    yield self._chunk([choice])
                elif isinstance(event, Finished):
                    if chat:
                        choice = {"index": event.choice, "delta": {}, "logprobs": None, "finish_reason": event.reason}
                    else:
                        choice = {"index": event.choice, "text": "", "logprobs": None, "finish_reason": event.reason}
                    yield self._chunk([choice])
                elif isinstance(event, Done):
                    if self.parsed.include_usage:
                        yield self._chunk([], api.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens))
                    yield "data: [DONE]\n\n"
                elif isinstance(event, Failed):
                    yield f"data: {json.dumps(api.ApiError(500, event.message, type='server_error').body())}\n\n"
        except _ClientGone:
            return


# ------------------------------------------------------------------ loading
def load_engine(state: ServerState, package, *, trust_native_code: bool, expect_digest: str | None, max_cells: int | None,
                verify: bool, engine_options: dict, state_dir=None, speculative: str = "off", draft=None,
                max_draft: int = 8, weights: str = "auto") -> None:
    """Loads and verifies the package, then starts the engine (in a thread of
    its own while the server already answers /health with 503)."""
    from kvexport.runtime import load
    from kvexport.runtime.verify import check_reference

    options = {"max_cells": max_cells} if max_cells is not None else {}
    runtime = load(package, trust_native_code=trust_native_code, expect_digest=expect_digest, weights=weights, **options)
    if not runtime.batches_sessions:
        name = runtime.package.manifest["contract"]["name"]
        raise KvexportError(f"{package}: a {name} package runs one sequence at a time; kvexport serve batches sessions "
                            "over a cell pool: export with --use-offgraph-kv-cache")
    if verify:
        result = check_reference(runtime)
        if not result.ok:
            raise KvexportError(f"{package}: {result.summary}; refusing to serve it (--no-verify serves it unchecked)")
        log.info("%s", result.summary)
    speculation, draft_runtime = None, None
    if speculative != "off":
        from kvexport.runtime.speculative import Speculation

        draft_runtime = load(draft, trust_native_code=trust_native_code, weights=weights) if draft is not None else None
        speculation = Speculation(speculative, draft=draft_runtime, max_draft=max_draft)  # the Engine checks it
        stats = speculation.stats
        state.metrics.watch("kvexport_speculative_drafted_tokens", "Tokens drafted (prompt lookup or the draft package)",
                            lambda: stats.drafted)
        state.metrics.watch("kvexport_speculative_accepted_tokens", "Drafted tokens the model kept", lambda: stats.accepted)
    # every method built here, not at its first request: no request waits for one, and no program is
    # rebuilt on the engine's thread (torch 2.11 crashed doing that, in FakeTensorMode.__enter__)
    for rt in filter(None, (runtime, draft_runtime)):
        rt.package.build_methods()
    text = runtime.package.tokenizer() if runtime.package.manifest.get("tokenizer") else None
    metrics = state.metrics
    digest = manifest_digest(runtime.package.reader.manifest_bytes)
    engine = Engine(runtime, text, on_step=metrics.step, on_token_times=metrics.token_times, state_dir=state_dir,
                    package_digest=digest, speculation=speculation, **engine_options)
    state.ready(engine, text)


def start_loading(state: ServerState, on_failure: Callable[[], None], **kwargs) -> threading.Thread:
    def run() -> None:
        try:
            load_engine(state, **kwargs)
        except KvexportError as e:
            state.status, state.error = "failed", str(e)
            on_failure()
        except Exception as e:  # noqa: BLE001  (reported, and the server stops)
            log.exception("loading failed")
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"
            on_failure()

    thread = threading.Thread(target=run, name="kvexport-load", daemon=True)
    thread.start()
    return thread
