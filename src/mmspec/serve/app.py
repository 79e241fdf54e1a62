"""The HTTP side of ``mmspec serve``: a FastAPI app with OpenAI's completions endpoints.

Owns the routes (``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``) and the OpenAI-style error bodies (every refusal is
``{"error": {"message", "type", "param", "code"}}``, 400 for a bad request, server paths
redacted). In front of every route, the :class:`~mmspec.serve.guard.Guard` (host, API key,
content type, body size) and, with ``cors_origins``, CORS. A handler parses and prepares its
request on a thread of its own (:class:`~mmspec.serve.service.Service`), then
:class:`~mmspec.serve.choices.Run` hands its choices to the worker and answers whole or as
server-sent events; a handler never touches the decoder.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmspec.serve import responses as R
from mmspec.serve.choices import Run
from mmspec.serve.guard import Guard, redact_paths
from mmspec.serve.protocol import parse_request
from mmspec.serve.schema import RequestError
from mmspec.serve.service import Service

log = logging.getLogger("mmspec.serve")


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(R.error_body(redact_paths(message), type, param, code), status_code=status)


def refusal(e: RequestError) -> JSONResponse:
    return error_response(e.status, str(e), e.type, e.param, e.code)


def _failure_type(status: int) -> str:
    return R.failure_type(status)


def create_app(service: Service) -> FastAPI:
    """The app serving ``service``; its lifespan starts and stops the worker thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        yield
        service.worker.stop("the server is shutting down")

    app = FastAPI(title="mmspec serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    name = service.config.model_name
    cfg = service.config
    metrics = service.metrics
    app.add_middleware(Guard, max_body=int(cfg.max_request_mb * 2**20), api_key=cfg.api_key,
                       allowed_hosts=cfg.allowed_hosts, on_refusal=metrics.refused if metrics else None,
                       on_response=metrics.responded if metrics else None)
    if cfg.cors_origins:  # outermost: a browser's preflight (OPTIONS, no key) is answered here
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cfg.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError):
        return refusal(exc)

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus():
            data, kind = metrics.render()
            return Response(data, media_type=kind)

    routes = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"] + \
        (["GET /metrics"] if metrics is not None else [])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        if exc.status_code == 405:
            allowed = [r.split()[0] for r in routes if r.split()[1] == path]
            hint = f" ({path} takes {' or '.join(allowed)})" if allowed else ""
        else:
            hint = f" (mmspec serve has {', '.join(routes)})"
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {path}{hint}",
                              type=_failure_type(exc.status_code))

    @app.get("/health")
    async def health():
        w = service.worker
        cache = getattr(service.decoder, "prefix_cache", None)
        return {"status": "ok" if w.running else "stopped", "model": name, "active": w.active,
                "queued": w.pending, "steps": w.steps,
                "prefix_cache_mb": round(cache.nbytes / 2**20, 1) if cache is not None else 0.0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(service.started),
                                            "owned_by": "mmspec", "max_model_len": service.context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(service, request, completion=False)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(service, request, completion=True)

    return app


def _count(service: Service, status: int) -> None:
    if service.metrics is not None:
        service.metrics.refused(status)


async def _complete(service: Service, request: Request, completion: bool):
    """One chat or text completion: parse and prepare it (a thread of its own), hand its choices
    to the worker, then answer whole or as a stream."""
    t0 = time.perf_counter()
    body = await request.body()  # (bounded by the Guard while it arrives)
    try:
        req = parse_request(body, service.config.model_name, completion, service.config.tool_call_parser)
        parse_s = time.perf_counter() - t0
        prepared = await run_in_threadpool(service.prepare, req)
        prepared.timings["parse"] = parse_s
    except RequestError as e:
        _count(service, e.status)
        return refusal(e)
    run = Run(service, req, prepared, t0)
    failure = await run.submit()
    if failure is None and req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if failure is None:
        failure = await run.collect(request)
    if failure is not None:
        _count(service, failure.status)
        return error_response(failure.status, failure.message, _failure_type(failure.status))
    return JSONResponse(await run.body())  # plain JSON types: FastAPI's jsonable_encoder would walk every logprob again
