"""Who may call ``mmspec serve`` and how much they may send, checked before a handler reads a byte.

Owns :class:`Guard`, an ASGI middleware in front of every route, and :func:`redact_paths`. In
order, for each HTTP request:

* the ``Host`` header must name an allowed host (``allowed_hosts``; None: any), so a web page
  that re-binds its own DNS name to 127.0.0.1 cannot read the answers (DNS rebinding): 400;
* on ``/v1/`` routes, with an ``api_key``, ``Authorization: Bearer <key>`` must carry it
  (compared in constant time): 401. ``/health`` and ``/metrics`` answer without it;
* a ``POST`` body must be ``Content-Type: application/json`` (a form or ``text/plain`` is what a
  web page can send cross-origin without asking): 415;
* a body past ``max_body`` bytes is refused from its ``Content-Length``, or, sent without one
  (chunked), as soon as the bytes received pass the limit: 413. Nothing is buffered past it.

Every refusal is OpenAI's error body, counted by ``on_refusal``; ``on_response`` is told how long
each request took, from its arrival to its response's last byte sent (both: the server's metrics).
This module knows nothing about models or the decoder.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time

from mmspec.errors import MMSpecError
from mmspec.serve.schema import RequestError

JSON_TYPE = "application/json"


class Guard:
    """ASGI middleware: host, API key, content type and body size (module docstring)."""

    def __init__(self, app, *, max_body: int, api_key: str | None = None, allowed_hosts: list[str] | None = None,
                 on_refusal=None, on_response=None):
        self.app = app
        self.max_body = max_body
        self._key = api_key.encode() if api_key else None
        self.allowed_hosts = None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}
        self.on_refusal = on_refusal  # called with the HTTP status of each refusal (metrics)
        self.on_response = on_response  # called with (path, status, seconds from arrival to the last byte sent)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check(scope, headers)
        except RequestError as e:
            return await self._refuse(send, e)
        sent, status, t0 = False, None, time.perf_counter()

        async def tracked_send(message):
            nonlocal sent, status
            if message["type"] == "http.response.start":
                sent, status = True, message["status"]
            await send(message)
            if self.on_response is not None and message["type"] == "http.response.body" \
                    and not message.get("more_body", False):
                self.on_response(scope.get("path", ""), status, time.perf_counter() - t0)

        try:
            await self.app(scope, self._bounded(receive), tracked_send)
        except RequestError as e:  # the body passed the limit while a handler read it (counted there)
            if sent:
                raise
            await self._refuse(send, e, count=False)

    def _check(self, scope, headers: dict) -> None:
        if self.allowed_hosts is not None:
            host = _hostname(headers.get("host", ""))
            if host not in self.allowed_hosts:
                raise RequestError(f"the Host header {headers.get('host', '')[:100]!r} is not a name this server "
                                   f"answers to ({', '.join(sorted(self.allowed_hosts))}); call it by one of those, "
                                   "or start it with --allowed-hosts NAME", code="invalid_host")
        path = scope.get("path", "")
        if self._key is not None and path.startswith("/v1/"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if not token:
                raise RequestError("no API key: this server needs one; send it as the header "
                                   "'Authorization: Bearer <key>' (the openai client's api_key=)", status=401,
                                   code="invalid_api_key")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                raise RequestError("the API key is wrong; send the server's key (its --api-key or MMSPEC_API_KEY) "
                                   "as 'Authorization: Bearer <key>'", status=401, code="invalid_api_key")
        if scope.get("method") == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != JSON_TYPE:
                raise RequestError(f"Content-Type {kind or '(none)'!r} is not {JSON_TYPE}; send the body as JSON "
                                   f"with the header 'Content-Type: {JSON_TYPE}'", status=415,
                                   code="unsupported_media_type")
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                raise self._too_large(int(length))

    def _bounded(self, receive):
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    e = self._too_large(seen, partial=True)
                    self._count(e)  # whoever answers it (the app's handler or this middleware), counted once, here
                    raise e
            return message

        return bounded

    def _too_large(self, n: int, partial: bool = False) -> RequestError:
        mb = self.max_body / 2**20
        what = f"more than {n:,} bytes (refused while it arrived)" if partial else f"{n:,} bytes"
        return RequestError(f"the request body is {what}, past this server's limit of {mb:.3g} MiB (--max-request-mb); "
                            "send smaller or fewer images, or a shorter text", status=413,
                            code="request_too_large")

    def _count(self, e: RequestError) -> None:
        if self.on_refusal is not None:
            self.on_refusal(e.status)

    async def _refuse(self, send, e: RequestError, count: bool = True) -> None:
        if count:
            self._count(e)
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _hostname(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def default_hosts(bound: str) -> list[str] | None:
    """The Host names a server bound to ``bound`` answers to without --allowed-hosts: loopback's
    names for a loopback address, the address itself otherwise; None (any) for 0.0.0.0 / ::."""
    if bound in ("0.0.0.0", "::", ""):
        return None
    if bound in ("127.0.0.1", "localhost", "::1") or bound.startswith("127."):
        return sorted({bound, "127.0.0.1", "localhost", "::1"})
    return [bound]


_ORIGIN = re.compile(r"(https?)://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._~%-]+)(:\d{1,5})?")


def check_origins(origins: list[str]) -> list[str]:
    """``--cors-origins``: each ``*`` or an origin as a browser sends it, ``scheme://host[:port]``
    (http or https, no path, no trailing slash: the header is compared as written)."""
    for o in origins:
        if o == "*":
            continue
        if _ORIGIN.fullmatch(o):
            continue
        parts = o.split("/", 3)  # ["https:", "", "host", "path"]
        base = "/".join(parts[:3]) if len(parts) == 4 else ""
        fix = f"; without the path: {base}" if _ORIGIN.fullmatch(base) else ""
        raise MMSpecError(f"--cors-origins {o!r} is not an origin; give one as a browser sends it, "
                          f"scheme://host[:port] such as https://app.example.com or http://localhost:3000 (or '*' "
                          f"for any){fix}")
    return list(origins)


_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s'\"/(),]+/)+[^\s'\"(),]*")


def redact_paths(message: str) -> str:
    """``message`` with every absolute path of this machine (one that exists, or whose folder
    does) replaced by ``<path>``: an error body never shows the server's own folders."""
    def hide(m: re.Match) -> str:
        p = m.group(0).rstrip(".:;")
        if os.path.exists(p) or os.path.isdir(os.path.dirname(p)):
            return "<path>" + m.group(0)[len(p):]
        return m.group(0)

    return _PATH.sub(hide, message) if "/" in message else message
