"""The requests an audit sends: the embedded world's samples, or a JSONL file of chat requests.

Owns :class:`AuditRequest` (an id and an OpenAI chat request body) and the two sources:

* :func:`world_requests`: the embedded world's multimodal samples (test split, every family
  interleaved, so any prefix is balanced), each one user message in the world's own prompt
  wording with its images as PNG data URLs where the prompt's ``<image>`` markers stand (the
  ``USER: ... ASSISTANT:`` frame left to the server, which frames it as ``mmspec generate`` does);
* :func:`read_jsonl`: one chat request per line (``{"messages": [...], "max_tokens": ...}``, an
  optional ``"id"``), each bad line refused by number with the fix.

Every request is sent greedy (``temperature`` 0): sampled answers are not expected to match.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path

from mmspec.audit.client import AuditError

DEFAULT_MAX_TOKENS = 128
# request fields the audit sets itself (greedy, one answer, no stream) or that change the answer
SET_BY_AUDIT = ("temperature", "stream", "n", "logprobs", "top_logprobs", "model")


@dataclass
class AuditRequest:
    """One request: ``id`` (unique in a run: the resume key) and the chat ``body``."""

    id: str
    body: dict  # messages, max_tokens, and any other field the endpoints take


def data_url(image) -> str:
    """A PIL image -> ``data:image/png;base64,...``."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def world_message(prompt: str, images: list) -> dict:
    """A world prompt (``USER: ... <image> ... ASSISTANT:``) -> one user message whose content puts
    an ``image_url`` part where each ``<image>`` marker stands, the frame left out."""
    from mmspec.prompt import IMAGE_MARKER

    text = prompt.strip()
    text = text.removeprefix("USER:").removesuffix("ASSISTANT:").strip()
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(images):
        raise AuditError(f"the world prompt has {len(pieces) - 1} <image> marker(s) but {len(images)} image(s)")
    content: list[dict] = []
    for k, piece in enumerate(pieces):
        if k:
            content.append({"type": "image_url", "image_url": {"url": data_url(images[k - 1])}})
        if piece.strip():
            content.append({"type": "text", "text": piece.strip()})
    return {"role": "user", "content": content}


def world_requests(n: int, max_tokens: int = DEFAULT_MAX_TOKENS, split: str = "test") -> list[AuditRequest]:
    """``n`` requests from the embedded world's image families, interleaved (index-major)."""
    from mmspec.world import FAMILIES, iter_all

    per_family = -(-n // len(FAMILIES))
    samples = list(iter_all(split, per_family))[:n]
    return [AuditRequest(s.uid, {"messages": [world_message(s.prompt, s.images)], "max_tokens": max_tokens})
            for s in samples]


def read_jsonl(path: str | Path, max_tokens: int = DEFAULT_MAX_TOKENS, limit: int | None = None) -> list[AuditRequest]:
    """Chat requests, one JSON object per line (blank lines skipped); ``max_tokens`` where a line
    gives none. A bad line is an AuditError naming its number and the fix."""
    p = Path(path)
    if not p.is_file():
        raise AuditError(f"--requests file {str(path)!r} not found; pass a JSONL file of chat requests, one "
                         'per line: {"messages": [{"role": "user", "content": "..."}], "max_tokens": 64}')
    out, seen = [], set()
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p.name} line {n}"
        try:
            body = json.loads(line)
        except json.JSONDecodeError as e:
            raise AuditError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); write one chat request "
                             'object per line, like {"messages": [{"role": "user", "content": "Hi"}]}') from None
        if not isinstance(body, dict):
            raise AuditError(f"{where}: a JSON {type(body).__name__}, not an object; write one chat request "
                             'object per line, like {"messages": [{"role": "user", "content": "Hi"}]}')
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise AuditError(f"{where}: no 'messages' list of {{'role', 'content'}} objects; a chat request "
                             'needs one, like "messages": [{"role": "user", "content": "Hi"}]')
        if body.get("stream") or body.get("n", 1) != 1 or (body.get("temperature") or 0) != 0:
            raise AuditError(f"{where}: the audit sends greedy, single, unstreamed requests; drop 'stream', "
                             "'n' and a non-zero 'temperature' (sampled answers are not expected to match)")
        rid = str(body.pop("id", None) or f"line-{n}")
        if rid in seen:
            raise AuditError(f"{where}: the id {rid!r} is used twice; give every request its own id "
                             "(a resumed run finds its finished requests by id)")
        seen.add(rid)
        body = {k: v for k, v in body.items() if k not in SET_BY_AUDIT}
        body.setdefault("max_tokens", body.pop("max_completion_tokens", None) or max_tokens)
        out.append(AuditRequest(rid, body))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise AuditError(f"--requests file {str(path)!r} holds no requests; write one chat request per line")
    return out
