"""The HTTP side of ``mmspec serve``: a FastAPI app with OpenAI's chat-completions endpoints.

Owns the routes (``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``), the
OpenAI-style error bodies (every refusal is ``{"error": {"message", "type", "param", "code"}}``,
400 for a bad request), server-sent events for ``stream=true`` (chunks in OpenAI's form, then
``data: [DONE]``), and noticing a client that went away (its rows are freed). A handler parses
and prepares its request on a thread of its own (:class:`~mmspec.serve.service.Service`), hands
it to the worker and waits for the worker's updates; it never touches the decoder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmspec.serve import responses as R
from mmspec.serve.guard import Guard, redact_paths
from mmspec.serve.schema import RequestError, parse_request
from mmspec.serve.service import Prepared, Service
from mmspec.serve.worker import Job, Update

log = logging.getLogger("mmspec.serve")
POLL_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there


class Ticket:
    """A job's updates, carried from the worker thread into the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()

    def put(self, update: Update) -> None:  # worker thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    async def get(self, timeout: float | None = None) -> Update:
        return await asyncio.wait_for(self.queue.get(), timeout)


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(R.error_body(redact_paths(message), type, param, code), status_code=status)


def refusal(e: RequestError) -> JSONResponse:
    return error_response(e.status, str(e), e.type, e.param, e.code)


def _failure_type(status: int) -> str:
    return {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}.get(status, "server_error")


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
                       allowed_hosts=cfg.allowed_hosts, on_refusal=metrics.refused if metrics else None)
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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        hint = " (mmspec serve has POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics)"
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}{hint}",
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
        t0 = time.perf_counter()
        body = await request.body()  # (bounded by the Guard while it arrives)
        try:
            req = parse_request(body, name)
            prepared = await run_in_threadpool(service.prepare, req)
        except RequestError as e:
            _count(service, e.status)
            return refusal(e)
        ticket = Ticket(asyncio.get_running_loop())
        job = Job(request=prepared.request, sink=ticket.put)
        service.worker.submit(job)
        first = await ticket.get()
        if first.kind != "admitted":
            _count(service, first.status)
            return error_response(first.status, first.message, _failure_type(first.status))
        answer = R.Answer(stops=req.stop, eos_ids=frozenset(service.decoder.eos_ids))
        cid = R.new_id()
        if req.stream:
            return StreamingResponse(_stream(service, job, ticket, answer, prepared, req.include_usage, cid, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        failure = await _collect(service, job, ticket, answer, request)
        if failure is not None:
            _count(service, failure.status)
            return error_response(failure.status, failure.message, _failure_type(failure.status))
        _answered(service, answer, prepared, t0)
        stats = R.mmspec_stats(answer, prepared.seed, time.perf_counter() - t0)
        return R.completion(cid, name, answer, prepared.prompt_tokens, stats)

    return app


def _count(service: Service, status: int) -> None:
    if service.metrics is not None:
        service.metrics.refused(status)


def _answered(service: Service, answer: R.Answer, prepared: Prepared, t0: float) -> None:
    if service.metrics is not None:
        service.metrics.answered(answer.finish_reason, prepared.prompt_tokens, len(answer.token_ids), t0,
                                 answer.first_token_at, answer.result)


async def _collect(service: Service, job: Job, ticket: Ticket, answer: R.Answer, request: Request) -> Update | None:
    """Wait for the whole answer (None), or the update that ended it; a client gone is cancelled."""
    checked = time.perf_counter()
    try:
        while True:
            try:
                up = await ticket.get(POLL_S)
            except TimeoutError:
                up = None
            if time.perf_counter() - checked >= POLL_S:
                checked = time.perf_counter()
                if await request.is_disconnected():
                    service.worker.cancel(job)
                    return Update("failed", message="the client disconnected", status=499)
            if up is None:
                continue
            if up.kind != "event":
                return up
            answer.add(up.event.new_token_ids, up.event.text)
            if up.event.finished:
                answer.finish(up.event.result)
                return None
            if answer.stopped:  # a stop string: the rest is not wanted
                service.worker.cancel(job)
                return None
    except asyncio.CancelledError:
        service.worker.cancel(job)
        raise


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(service: Service, job: Job, ticket: Ticket, answer: R.Answer, prepared: Prepared,
                  include_usage: bool, cid: str, t0: float):
    """The server-sent events of one streamed answer; a client that goes away cancels the job."""
    name = service.config.model_name
    done = False
    try:
        yield _sse(R.chunk(cid, name, {"role": "assistant", "content": ""}))
        while True:
            up = await ticket.get()
            if up.kind != "event":  # it failed after admission: say why, inside the stream
                done = True
                _count(service, up.status)
                yield _sse(R.error_body(redact_paths(up.message), _failure_type(up.status)))
                break
            ev = up.event
            piece = answer.add(ev.new_token_ids, ev.text)
            if ev.finished:
                piece += answer.finish(ev.result)
            if piece:
                yield _sse(R.chunk(cid, name, {"content": piece}))
            if ev.finished or answer.stopped:
                if not ev.finished:
                    service.worker.cancel(job)  # cut at a stop string: free the rows
                done = True
                _answered(service, answer, prepared, t0)
                stats = R.mmspec_stats(answer, prepared.seed, time.perf_counter() - t0)
                yield _sse(R.chunk(cid, name, {}, answer.finish_reason, mmspec=stats))
                if include_usage:
                    yield _sse(R.usage_chunk(cid, name, R.usage(prepared.prompt_tokens, answer), stats))
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away mid-stream (the generator was closed or cancelled)
            _count(service, 499)
            service.worker.cancel(job)
