"""One OpenAI-compatible endpoint, as the audit talks to it (httpx, standard OpenAI only).

Owns :class:`Endpoint`: the base URL (``http://host:8000`` or ``.../v1``), the model, the API key
(sent as ``Authorization: Bearer``), a timeout; :meth:`Endpoint.check` (``GET /v1/models``: is it
there, is it OpenAI-compatible, which model) and :meth:`Endpoint.chat` (one greedy chat
completion -> :class:`Reply`). It asks for ``logprobs`` (and ``top_logprobs`` where the caller
needs them); an endpoint that refuses them (a 400 that names ``logprobs``) is asked again without,
and remembered: its answers are then compared as text (:mod:`mmspec.audit.compare`). A token's id
is read where the endpoint gives it: mmspec's (and SGLang's) ``token_id`` field, or vLLM's
``return_tokens_as_token_ids`` form ``"token_id:N"`` as the token's text.

Every failure is an :class:`AuditError` with one line that names the endpoint and the fix. This
module knows nothing about models, tokenizers or the report.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field

from mmspec.errors import MMSpecError

TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids form of a logprobs token


class AuditError(MMSpecError):
    """A bad input or an endpoint the audit cannot use (one line: the problem and the fix)."""


class RequestFailed(Exception):
    """One request failed at an endpoint (HTTP error, timeout, a malformed answer); the run goes on."""


def _httpx():
    try:
        import httpx
    except ImportError:
        raise AuditError("mmspec audit needs httpx: pip install 'mmspec[audit]' (or httpx)") from None
    return httpx


def token_id(text: str, given=None) -> int | None:
    """A token's id: ``given`` (an entry's ``token_id`` field) when it is one, else the id of
    vLLM's ``"token_id:N"`` text, else None."""
    if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
        return given
    if text.startswith(TOKEN_ID_PREFIX) and text[len(TOKEN_ID_PREFIX):].isdigit():
        return int(text[len(TOKEN_ID_PREFIX):])
    return None


@dataclass
class Token:
    """One position of an answer as the endpoint's ``logprobs.content`` gives it."""

    text: str  # the token as the endpoint writes it (vLLM with return_tokens_as_token_ids: "token_id:N")
    logprob: float | None
    top: dict[str, float] = field(default_factory=dict)  # the alternatives' token text -> logprob
    token_id: int | None = None  # its id, where the endpoint gave one (a token_id field, or "token_id:N")
    top_ids: dict[int, float] = field(default_factory=dict)  # the alternatives' ids -> logprob, where given

    @property
    def id(self) -> int | None:
        """The token id where the endpoint gave it, else None."""
        return self.token_id if self.token_id is not None else token_id(self.text)

    def alternative(self, token: int | str | None) -> float | None:
        """The log-probability the endpoint listed here for ``token`` (an id or a token text), or None."""
        if isinstance(token, int):
            return self.top_ids.get(token)
        return None if token is None else self.top.get(token)


@dataclass
class Reply:
    """One chat completion: its text, why it ended, and its tokens when the endpoint gave logprobs."""

    text: str
    finish_reason: str | None
    tokens: list[Token] | None = None  # None: no logprobs (the text is all there is)
    seconds: float = 0.0


class Endpoint:
    """An OpenAI-compatible server: ``url`` (with or without ``/v1``), ``model`` (None: the first
    of ``/v1/models``), ``api_key`` (Bearer), ``timeout`` seconds per request."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 300.0,
                 extra: dict | None = None):
        httpx = _httpx()
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise AuditError(f"endpoint {url!r} is no http(s) URL; pass the server's base URL, like "
                             "http://127.0.0.1:8000/v1")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.model, self.timeout, self.extra = model, timeout, dict(extra or {})
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.Client(headers=headers, timeout=timeout)
        self.logprobs: bool | None = None  # None: not yet known; False: refused once, not asked again
        self._lock = threading.Lock()

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ the first contact
    def check(self) -> str:
        """``GET /v1/models``: the model to audit (``--model``, else the first served), or AuditError."""
        data = self._get_json("/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
            raise AuditError(f"{self.base}/models answered JSON without OpenAI's model list ({_short(data)}); "
                             "is it an OpenAI-compatible server? pass its base URL, like http://host:8000/v1")
        ids = [m["id"] for m in models]
        if self.model is None:
            if not ids:
                raise AuditError(f"{self.base}/models lists no model; pass --model NAME")
            self.model = ids[0]
        elif ids and self.model not in ids:
            raise AuditError(f"{self.base} does not serve the model {self.model!r}; it serves "
                             f"{', '.join(map(repr, ids))}: pass one of them as --model")
        return self.model

    def _get_json(self, path: str):
        httpx = _httpx()
        try:
            r = self._client.get(self.base + path)
        except httpx.TimeoutException:
            raise AuditError(f"{self.base}{path} did not answer within {self.timeout:g} s; is the server up "
                             "(and not still loading)? raise --timeout or check the URL") from None
        except httpx.HTTPError as e:
            raise AuditError(f"cannot reach the endpoint {self.base} ({_reason(e)}); is the server running? "
                             "check the URL and port") from None
        if r.status_code in (401, 403):
            raise AuditError(f"{self.base}{path} refused the request (HTTP {r.status_code}: {_message(r)}); "
                             "pass the server's key as --api-key (sent as Authorization: Bearer)")
        if r.status_code != 200:
            raise AuditError(f"{self.base}{path} answered HTTP {r.status_code} ({_message(r)}); is it an "
                             "OpenAI-compatible server? pass its base URL, like http://host:8000/v1")
        try:
            return r.json()
        except ValueError:
            raise AuditError(f"{self.base}{path} answered something that is not JSON ({one_line(r.text, 80)}); is it an "
                             "OpenAI-compatible server? pass its base URL, like http://host:8000/v1") from None

    # ------------------------------------------------------------------ one completion
    def chat(self, request: dict, top_logprobs: int = 0) -> Reply:
        """One greedy chat completion of ``request`` (messages, max_tokens, ...). Asks for logprobs
        (``top_logprobs`` alternatives per position) unless this endpoint refused them before."""
        body = {**request, **self.extra, "model": self.model, "temperature": 0, "stream": False}
        if self.logprobs is not False:
            with_lp = {**body, "logprobs": True, **({"top_logprobs": top_logprobs} if top_logprobs else {})}
            r = self._post(with_lp)
            if r.status_code == 400 and "logprob" in _message(r).lower():
                with self._lock:
                    self.logprobs = False
            else:
                return self._reply(r)
        return self._reply(self._post(body))

    def _post(self, body: dict):
        httpx = _httpx()
        try:
            return self._client.post(self.base + "/chat/completions", content=json.dumps(body))
        except httpx.TimeoutException:
            raise RequestFailed(f"no answer from {self.base} within {self.timeout:g} s (--timeout)") from None
        except httpx.HTTPError as e:
            raise RequestFailed(f"{self.base}: {_reason(e)}") from None

    def _reply(self, r) -> Reply:
        if r.status_code != 200:
            raise RequestFailed(f"{self.base}/chat/completions answered HTTP {r.status_code}: {_message(r)}")
        try:
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"]
            if text is None:
                text = _calls_text(choice["message"].get("tool_calls") or [], choice.get("logprobs"))
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestFailed(f"{self.base}/chat/completions answered without OpenAI's choices[0].message."
                                f"content ({one_line(r.text, 80)}); not an OpenAI-compatible chat completion") from None
        tokens = _tokens(choice.get("logprobs"))
        with self._lock:
            if tokens is not None:
                self.logprobs = True
        return Reply(text, choice.get("finish_reason"), tokens, r.elapsed.total_seconds())


def _calls_text(calls: list, logprobs) -> str:
    """The text of an answer given as tool calls: one call's arguments (a named function's answer is
    exactly that); several ("required": the array the model wrote, re-written by the server) the
    tokens' own strings joined, where logprobs came, else the calls as JSON."""
    if len(calls) == 1 and isinstance(calls[0].get("function", {}).get("arguments"), str):
        return calls[0]["function"]["arguments"]
    entries = (logprobs or {}).get("content") if isinstance(logprobs, dict) else None
    if entries:
        return "".join(str(e.get("token", "")) for e in entries)
    return json.dumps(calls) if calls else ""


def _tokens(logprobs) -> list[Token] | None:
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    out = []
    for c in content:
        if not isinstance(c, dict):
            return None
        top, top_ids = {}, {}
        for t in c.get("top_logprobs") or []:
            if isinstance(t, dict) and "token" in t and t.get("logprob") is not None:
                top[str(t["token"])] = float(t["logprob"])
                i = token_id(str(t["token"]), t.get("token_id"))
                if i is not None:
                    top_ids[i] = float(t["logprob"])
        lp, text = c.get("logprob"), str(c.get("token", ""))
        out.append(Token(text, None if lp is None else float(lp), top, token_id(text, c.get("token_id")), top_ids))
    return out


def _message(r) -> str:
    """The error an endpoint answered, in one line: OpenAI's ``error.message`` (FastAPI's
    ``detail``), else the body's text (an HTML page by its title)."""
    try:
        data = r.json()
        err = data.get("error")
        msg = err.get("message") if isinstance(err, dict) else (err or data.get("detail"))
        return one_line(str(msg)) if msg else one_line(r.text)
    except (ValueError, AttributeError):
        return one_line(r.text)


def one_line(text: str, limit: int = 160) -> str:
    """A body shown in an error: one line of at most ``limit`` characters; an HTML page becomes
    "an HTML page" and its title, never its markup."""
    text = text.strip()
    if text[:1] == "<" and re.search(r"<(!doctype html|html|head|body|title|h1|p)\b", text[:2000], re.I):
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S) or re.search(r"<h1[^>]*>(.*?)</h1>", text,
                                                                                        re.I | re.S)
        words = " ".join(re.sub(r"<[^>]+>", " ", title.group(1)).split()) if title else ""
        return f"an HTML page ({words[:limit]!r})" if words else "an HTML page"
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _reason(e: Exception) -> str:
    text = str(e) or e.__class__.__name__
    return "connection refused" if "refused" in text.lower() else text.splitlines()[0][:160]


def _short(data) -> str:
    return json.dumps(data)[:80]
