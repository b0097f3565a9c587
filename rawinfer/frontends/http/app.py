"""The FastAPI application: OpenAI's routes (/v1/completions, /v1/chat/completions, /v1/models[/ID]) and the
server's own (/health, /metrics, /version, /tokenize, /detokenize), every error in OpenAI's JSON shape,
and the API key check. One app per worker process, with one EngineLink to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from rawinfer.config import VERSION
from rawinfer.frontends.http import metrics
from rawinfer.frontends.http.admission import Gate, Ticket, check_size, job_size
from rawinfer.frontends.http.bodies import BodyLimit
from rawinfer.frontends.http.body_parsing import BodyParser
from rawinfer.frontends.http.chat_shape import Parsers
from rawinfer.frontends.http.config import HTTPConfig
from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError, from_validation, log_failure, unknown_field
from rawinfer.frontends.http.params import chat_job, check_model, completion_job
from rawinfer.frontends.http.responses import ChunkStream, whole_response
from rawinfer.frontends.http.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                             TokenizeRequest, unknown_fields)
from rawinfer.frontends.http.sse import EventStream
from rawinfer.frontends.http.tokens import detokenize, tokenize

DISCONNECT_POLL_S = 0.25     # how often a non-streaming request checks that its client is still there

OPEN_PATHS = ("/health", "/version")        # answered without the API key (load balancers, probes)

log = logging.getLogger("rawinfer")


class _ApiKey:
    """ASGI middleware: 401 unless the request carries the key (paths in OPEN_PATHS excepted)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "a valid API key is required: send the header `Authorization: Bearer KEY` "
                               "with the key given to `rawinfer serve --api-key`", code="invalid_api_key")
                return await _refused(err, f"{scope['method']} {scope['path']}")(scope, receive, send)
        return await self.app(scope, receive, send)


class _SSEResponse(Response):
    """An EventStream as the Response FastAPI passes through untouched; its job's ticket is given back when
    the stream ends, however it ends."""

    def __init__(self, stream: EventStream, ticket: Ticket):
        self.stream, self.ticket, self.background = stream, ticket, None

    async def __call__(self, scope, receive, send):
        try:
            await self.stream(scope, receive, send)
        finally:
            self.ticket.release()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _route(req: Request) -> str:
    return f"{req.method} {req.url.path}"


def _refused(e: APIError, route: str) -> JSONResponse:
    """The error response of a refused or failed request, logged."""
    log_failure(e, route)
    return _error(e)


def create_app(cfg: HTTPConfig) -> FastAPI:
    """The API of one HTTP worker: its routes over an `_Api` (the engine link, the admission gate, the body
    parser), the error handlers, and the body limit and API key middleware."""
    api = _Api(cfg)
    app = FastAPI(title="rawinfer", version=VERSION, lifespan=api.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    _add_error_handlers(app)
    _add_info_routes(app, api)
    _add_generation_routes(app, api)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, read_timeout_s=cfg.read_timeout_s)
    if cfg.api_key:                     # outermost: a client without the key is refused before its body is read
        app.add_middleware(_ApiKey, key=cfg.api_key)
    return app


class _Api:
    """What the routes share: the config, the engine link (opened for the app's lifetime), the fair
    admission gate and the off-loop body parser."""

    def __init__(self, cfg: HTTPConfig):
        self.cfg = cfg
        self.gate, self.bodies = Gate(cfg.max_in_flight), BodyParser()
        self.link: EngineLink | None = None
        self.started = 0

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        self.link = EngineLink(self.cfg.engine_addr, self.cfg.server_key, self.cfg.timeout_s)
        self.started = int(time.time())
        try:
            yield
        finally:
            self.link.close()
            self.bodies.close()

    async def model_names(self) -> list[str]:
        """The names a request may give as `model`; the first is the one responses report."""
        return self.cfg.served_names or [(await self.link.info()).get("model") or "rawinfer"]

    async def parsers(self) -> Parsers:
        name = self.cfg.tool_call_parser
        if name == "auto":
            name = (await self.link.info()).get("tool_call_parser")
        return Parsers(tool_call=None if name == "none" else name, reasoning=self.cfg.reasoning_parser)

    def card(self, name: str, info: dict) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "rawinfer",
                "max_model_len": info.get("max_model_len"), "vocab_size": info.get("vocab_size")}

    async def body(self, request: Request, schema):
        """The request's body as `schema`, its unknown fields refused by name under --strict-api, else ignored
        and named once in the log (vLLM's warning), and its `model` checked; returns (body, model names)."""
        body = await self.bodies.parse(request, schema)
        names = unknown_fields(body)
        if names and self.cfg.strict_api:
            raise unknown_field(names[0])
        if names:
            log.warning("The following fields were present in the request but ignored: {%s} (%s)",
                        ", ".join(map(repr, names)), _route(request))
        served = await self.model_names()
        check_model(body.model, served)
        return body, served

    async def run(self, job, request: Request):
        """The job, once the gate admits it (a refused or waiting job has nothing in the engine)."""
        check_size(job, self.cfg.max_prompts_per_request)
        if not job.stream:
            return await _unless_gone(_admitted(self.gate, job, request, lambda: whole_response(self.link, job)),
                                      request)
        ticket = await self.gate.enter(_client(request), job_size(job), request.is_disconnected)
        if ticket is None:
            return _gone(request)
        try:
            stream = ChunkStream(self.link, job, _route(request))
            await stream.start()
            response, ticket = _SSEResponse(EventStream(stream.events()), ticket), None
            return response
        finally:
            if ticket is not None:
                ticket.release()


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error body, logged once (errors.log_failure)."""
    @app.exception_handler(APIError)
    async def _api_error(req: Request, e: APIError):
        return _refused(e, _route(req))

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, e: RequestValidationError):
        return _refused(from_validation(list(e.errors())), _route(req))

    @app.exception_handler(HTTPException)
    async def _http(req: Request, e: HTTPException):
        if e.status_code == 400:        # FastAPI could not read the body (not UTF-8, nested too deep, ...)
            err = APIError(400, f"the request body cannot be read ({e.detail}): send a JSON object in UTF-8",
                           code="invalid_json")
        else:
            code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
            err = APIError(e.status_code, f"{e.detail}: see GET /v1/models and the README's Serving section",
                           code=code)
        return _refused(err, _route(req))

    @app.exception_handler(Exception)
    async def _bug(req: Request, e: Exception):
        return _refused(APIError(500, f"internal error in the HTTP front end ({type(e).__name__}); see its log",
                                 code="internal_error"), _route(req))


def _add_info_routes(app: FastAPI, api: _Api) -> None:
    """/health, /version, the model cards and /metrics."""
    @app.get("/health")
    async def health():
        if await api.link.ready():
            return Response(status_code=200)
        # an answer to a probe (polled while the model loads), not a refusal: not logged
        return _error(APIError(503, "the engine is not ready (loading, warming up or shutting down)",
                               code="engine_unavailable"))

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models():
        info = await api.link.info()
        return {"object": "list", "data": [api.card(name, info) for name in await api.model_names()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, await api.model_names())
        return api.card(model_id, await api.link.info())

    @app.get("/metrics")
    async def metrics_page():
        stats = await api.link.stats()
        return Response(metrics.render(stats, (await api.model_names())[0]), media_type=metrics.CONTENT_TYPE)


def _add_generation_routes(app: FastAPI, api: _Api) -> None:
    """The completions and chat completions (through the gate), tokenize and detokenize."""
    @app.post("/v1/completions")
    async def completions(request: Request):
        body, names = await api.body(request, CompletionRequest)
        return await api.run(completion_job(body, names[0], api.cfg.default_max_tokens), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, names = await api.body(request, ChatCompletionRequest)
        return await api.run(chat_job(body, names[0], api.cfg.default_max_tokens, await api.parsers()), request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        body, _ = await api.body(request, TokenizeRequest)
        return await tokenize(api.link, body)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        body, _ = await api.body(request, DetokenizeRequest)
        return await detokenize(api.link, body)


def _client(request: Request) -> str:
    """Who sent a request, for fair admission: the peer's address (a trusted proxy's X-Forwarded-For, as
    uvicorn applies it)."""
    return request.client.host if request.client else "local"


async def _admitted(gate: Gate, job, request: Request, work):
    """work() (a coroutine function) run once the gate admits the job, its ticket given back when it ends."""
    ticket = await gate.enter(_client(request), job_size(job))
    try:
        return await work()
    finally:
        ticket.release()


def _gone(request: Request) -> Response:
    log.info("HTTP 499 %s: the client went away before the answer; its request was aborted", _route(request))
    return Response(status_code=499)         # nginx's "client closed request": nobody reads it


async def _unless_gone(work, request: Request) -> Response:
    """A non-streaming response, whose engine requests are aborted as soon as the client has gone away
    (checked every DISCONNECT_POLL_S) instead of running to the end for nobody: cancelling `work` closes
    the engine iterators, and closing one sends `abort`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return JSONResponse(task.result())
            if await request.is_disconnected():
                return _gone(request)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
