"""``mmspec serve``: the OpenAI-compatible HTTP server (:mod:`mmspec.serve`) on the command line.

Checks every flag (the model flags as ``mmspec generate`` checks them, the port by binding it)
before any model loads, loads the models as ``generate`` does, and runs uvicorn on the bound
socket. SIGTERM (and Ctrl-C): no new connections, the running requests get ``--shutdown-timeout``
seconds to finish (those left are told why), then the process exits 0.
"""

from __future__ import annotations

import math
import signal
import socket
from dataclasses import replace
from pathlib import Path

import typer

from mmspec.cli import common, options
from mmspec.cli.common import fail
from mmspec.cli.generate import WORLD_WORDING
from mmspec.cli.options import ModelFlags, RuntimeFlags, ShapeFlags, ViewFlags, takes
from mmspec.errors import MMSpecError
from mmspec.serve.config import ServeConfig
from mmspec.serve.guard import check_origins, default_hosts

SERVE = ServeConfig()  # the defaults of serve's flags: ServeConfig's (mmspec.serve.config)

EMBEDDED_NAME = "mmspec-embedded"


@takes
def serve(
    *,
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface; give it an "
                             "--api-key, and --allowed-hosts, before others can reach it)."),
    port: int = typer.Option(8000, help="TCP port."),
    models: ModelFlags,
    views: ViewFlags,
    shape: ShapeFlags,
    runtime: RuntimeFlags,
    max_batch: int = typer.Option(SERVE.max_batch, help="Requests decoded together; more wait for a free row."),
    speculate: str = typer.Option(SERVE.speculate, help="auto: each step's draft depth (plain steps included) for the most "
                                  "tokens per second at the batch (the one policy: shared step costs, each row's "
                                  "acceptance); always: draft every block; never: batched target steps only. All "
                                  "lossless; a seed gives one answer under each."),
    prefix_cache_mb: float | None = typer.Option(None, help="Memory (MiB) for prefix caching: a "
                                                    "conversation's next turn prefills only its new part (default: "
                                                    "SpecDecoder's, 1024; 0: off)."),
    max_tokens: int = typer.Option(SERVE.max_tokens, help="A request's max_tokens when it gives none (capped by the room "
                                   "left in the target's context)."),
    max_images: int | None = typer.Option(SERVE.max_images, help="Images per request (default: as many as the target's "
                                             "context holds)."),
    allowed_local_media_path: list[Path] = typer.Option(
        [], help="A directory whose image files requests may name by path or file:// URL (repeatable; "
        "default: none, images come as data URLs)."),
    served_model_name: str | None = typer.Option(None, help="The model id of /v1/models and the responses "
                                                    f"(default: {EMBEDDED_NAME}, or --target as given)."),
    shutdown_timeout: float = typer.Option(SERVE.shutdown_timeout_s, help="After SIGTERM: seconds the running "
                                           "requests get to finish."),
    max_request_mb: float = typer.Option(SERVE.max_request_mb, help="Request bodies past this many MiB are refused (413) as they "
                                         "arrive."),
    max_image_pixels: int = typer.Option(SERVE.max_image_pixels, help="Pixels per image, read from its header before "
                                         "decoding (larger: 400)."),
    max_request_pixels: int = typer.Option(SERVE.max_request_pixels, help="Pixels of all of a request's images together."),
    api_key: str | None = typer.Option(None, envvar="MMSPEC_API_KEY", show_default=False,
                                       help="Requests to /v1/ must send 'Authorization: Bearer KEY' (401 "
                                       "otherwise); also read from MMSPEC_API_KEY."),
    allowed_hosts: list[str] = typer.Option([], help="Host header names the server answers to (repeatable; "
                                            "default: the --host address, and localhost's names on loopback; "
                                            "'*': any)."),
    cors_origins: list[str] = typer.Option([], help="Origins browsers may call the server from (repeatable; "
                                           "default: none, CORS off)."),
    metrics: bool = typer.Option(SERVE.metrics, help="GET /metrics in Prometheus' text format."),
    warm_up_context: int = typer.Option(2048, help="With CUDA graphs: before serving, capture every step's graph "
                                        "for up to --max-batch requests of up to this many positions (prompt and "
                                        "answer, images expanded), printing the graphs and seconds; longer "
                                        "requests capture on first use. 0: no warm-up."),
    tool_call_parser: str | None = typer.Option(SERVE.tool_call_parser, help="How the model's own tool calls are read, for "
                                                "tool_choice 'auto' (the default with tools): 'hermes' for "
                                                "checkpoints that write <tool_call>{...}</tool_call> (Qwen2.5-VL). "
                                                "Without it 'auto' is refused; 'required' and a named function "
                                                "need none."),
    check_head: bool = options.CHECK_HEAD,
):
    """Serve the models over HTTP with OpenAI's chat-completions API (docs/serve.md).

    `POST /v1/chat/completions` (text and `image_url` parts, streaming), `GET /v1/models`,
    `GET /health`. Requests that arrive while others decode join them at the next block
    (continuous batching); every answer is exactly what the target alone would give."""
    from mmspec.cli.checks import GenerateOptions, at_least, check_decoder

    try:
        opts = check_decoder(GenerateOptions(check_head=check_head, **models.fields(), **views.fields(),
                                             **shape.fields(), **runtime.fields()))
        at_least("--max-batch", max_batch)
        at_least("--max-tokens", max_tokens)
        if warm_up_context < 0 or warm_up_context == 1:
            raise MMSpecError(f"--warm-up-context must be 0 (no warm-up) or a number of positions >= 2, got "
                              f"{warm_up_context}")
        at_least("--max-images", max_images)
        if prefix_cache_mb is not None and not (math.isfinite(prefix_cache_mb) and prefix_cache_mb >= 0):
            raise MMSpecError(f"--prefix-cache-mb must be a number of MiB >= 0 (0: off), got {prefix_cache_mb}")
        if not math.isfinite(shutdown_timeout) or shutdown_timeout < 0:
            raise MMSpecError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout}")
        media = [_media_dir(p) for p in allowed_local_media_path]
        if not (math.isfinite(max_request_mb) and max_request_mb > 0):
            raise MMSpecError(f"--max-request-mb must be a number of MiB > 0, got {max_request_mb}")
        at_least("--max-image-pixels", max_image_pixels)
        at_least("--max-request-pixels", max_request_pixels)
        if api_key is not None and not api_key.strip():
            raise MMSpecError("--api-key (or MMSPEC_API_KEY) is empty; give a key, or leave it unset for no key")
        hosts = None if "*" in allowed_hosts else (list(allowed_hosts) or default_hosts(host))
        check_origins(cors_origins)
        config = ServeConfig(  # the flags onto the server's settings (speculate and the parser checked there)
            model_name=served_model_name or "", max_batch=max_batch, speculate=speculate, max_tokens=max_tokens,
            max_images=max_images, allowed_media=media, shutdown_timeout_s=shutdown_timeout,
            max_request_mb=max_request_mb, max_image_pixels=max_image_pixels, max_request_pixels=max_request_pixels,
            api_key=api_key, allowed_hosts=hosts, cors_origins=list(cors_origins), metrics=metrics,
            tool_call_parser=tool_call_parser)
        _check_extra(metrics)
        sock = _bind(host, port)  # the port is ours before minutes of loading, or refused now
    except MMSpecError as e:
        fail(e)
    _run(opts, sock, host, port, config, prefix_cache_mb=prefix_cache_mb, warm_up_context=warm_up_context)


def _media_dir(path: Path) -> Path:
    if not path.is_dir():
        raise MMSpecError(f"--allowed-local-media-path {str(path)!r} is not a directory; pass a directory whose "
                          "image files requests may name")
    return path.resolve()


def _check_extra(metrics: bool = False) -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        if metrics:
            import prometheus_client  # noqa: F401
    except ImportError as e:
        raise MMSpecError(f"mmspec serve needs {e.name}: pip install 'mmspec[serve]'") from None


def _bind(host: str, port: int) -> socket.socket:
    if not 1 <= port <= 65535:
        raise MMSpecError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MMSpecError(f"--host {host!r} is not an address of this machine ({e.strerror}); use 127.0.0.1 or "
                          "0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    # proto IPPROTO_TCP (not 0): asyncio sets TCP_NODELAY on the connections it accepts only then;
    # without it a response's header and body segments meet Nagle and the client's delayed ACK, and
    # every request after the first on a kept-alive connection waited 40 ms more (perf/serve_speed.py)
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise MMSpecError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, or stop what "
                          "uses it") from None
    return sock


def _run(o, sock: socket.socket, host: str, port: int, config: ServeConfig, *, prefix_cache_mb: float | None,
         warm_up_context: int = 0) -> None:
    import uvicorn

    from mmspec.cli.generate import EMBEDDED_NOTE, build_decoder, check_loaded_head, load_models
    from mmspec.serve.app import create_app
    from mmspec.serve.service import Service

    common.set_threads(o.threads)
    t, d, tok, proc, cap, embedded = load_models(o.target, o.draft, o.captioner, o.captioner_prompt, o.dtype,
                                                 o.device, head=o.head)
    if embedded:
        common.console.print(EMBEDDED_NOTE)
    dec = build_decoder(o, t, d, tok, proc, cap,
                        **({} if prefix_cache_mb is None else {"prefix_cache_mb": prefix_cache_mb}))
    check_loaded_head(o, dec)
    if warm_up_context and dec.graph_mode != "eager":  # every graph before the first request (docs/serve.md)
        w = dec.warm_up(max_batch=config.max_batch, speculate=config.speculate, max_context=warm_up_context)
        common.console.print(f"mmspec serve: {w.line()}", highlight=False, soft_wrap=True)
    config = replace(config, model_name=config.model_name or (EMBEDDED_NAME if embedded else o.target))
    service = Service(dec, proc, config)
    server = _server(uvicorn.Config(create_app(service), timeout_graceful_shutdown=config.shutdown_timeout_s + 1,
                                    log_level="info"), service)
    common.console.print(f"mmspec serve: {config.model_name!r} ({dec.method}, {dec.tree_label}) on "
                         f"http://{host}:{port}/v1 (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, "
                         "GET /health, GET /metrics)",
                         highlight=False, soft_wrap=True)
    if embedded:
        common.console.print(WORLD_WORDING, highlight=False, soft_wrap=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # uvicorn re-raises the signal it handled once it has stopped: ignore it
    server.run(sockets=[sock])
    # the process ends now: the thread pool's idle threads (not daemons) would hold the exit up to 10 s
    # past --shutdown-timeout, and a handler still reading a body has been cancelled already
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _server(config, service):
    """uvicorn's server, its exit signal (SIGTERM, Ctrl-C) also starting the worker's drain."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            timeout = service.config.shutdown_timeout_s
            service.worker.drain(timeout, f"the server is shutting down (signal {signal.Signals(sig).name}) and "
                                          f"this request did not finish within {timeout:g} s; send it again")
            super().handle_exit(sig, frame)

    return Server(config)
