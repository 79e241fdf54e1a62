"""Chat messages (the typed :class:`~mmspec.serve.protocol.ChatMessage` s of a validated request)
-> the target's prompt text and its images.

Owns reading ``image_url`` parts (``data:image/...;base64,...`` URLs; local files, as a path or a
``file://`` URL, under the directories the server allows) with errors that name the part and
the fix, and framing a conversation:

* one user message (the common case) is framed exactly as ``mmspec generate`` frames its
  ``--prompt`` (:func:`mmspec.inputs.chat_prompt`): the processor's chat template where it has
  one, else LLaVA-1.5's ``USER: ... ASSISTANT:``;
* a conversation (system, earlier user and assistant turns) goes through the chat template with
  every turn; without one, each user turn is framed as above and each assistant answer follows
  its turn, closed by the tokenizer's EOS (Vicuna v1's ``USER: q ASSISTANT: a</s>USER: ...``);
  a system message goes in front.

Tools (``tools`` of a request that may call them, :mod:`mmspec.serve.structured`) are presented
to the model through the chat template's ``tools=`` argument where the template reads it (Qwen's
do), else as a system text in front that lists them in Hermes' form (``<tools>...</tools>``, and
how to call one: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). An assistant turn's
earlier ``tool_calls`` are written back as those tags, and a ``tool`` turn's result goes in as a
user turn ``<tool_response>...</tool_response>``, as Qwen's template writes them.

Images go where their parts are: each ``image_url`` part becomes an ``<image>`` marker at its
place in the text. A text that writes ``<image>`` markers itself places the images there (in
order), and then their number must match the markers.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from mmspec.inputs import chat_prompt, frame_prompt, with_markers
from mmspec.prompt import IMAGE_MARKER
from mmspec.serve.protocol import ChatMessage, marked_text
from mmspec.serve.schema import RequestError


@dataclass
class ImageRef:
    """One image_url part: where it is in the request and its url."""

    where: str  # messages[i].content[j]
    url: str


def image_refs(messages: list[ChatMessage]) -> list[ImageRef]:
    """The image_url parts of ``messages``, in order."""
    return [ImageRef(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if part.type == "image_url"]


def texts(messages: list[ChatMessage]):
    """Every text of ``messages``: string contents and text parts."""
    for m in messages:
        if isinstance(m.content, str):
            yield m.content
        elif isinstance(m.content, list):
            yield from (p.text for p in m.content if p.type == "text")


@dataclass
class PixelBudget:
    """Pixels a request's images may have: each (``per_image``) and together (``per_request``),
    checked from each image's header before it is decoded (None: no limit)."""

    per_image: int | None = None
    per_request: int | None = None
    used: int = 0

    def take(self, ref: ImageRef, width: int, height: int) -> None:
        n = width * height
        if self.per_image is not None and n > self.per_image:
            raise RequestError(f"{ref.where}: the image is {width}x{height} = {_mp(n)} pixels, past this server's "
                               f"limit of {_mp(self.per_image)} per image (--max-image-pixels); resize it first "
                               "(the model sees it at its own resolution anyway)", param=ref.where)
        if self.per_request is not None and self.used + n > self.per_request:
            raise RequestError(f"{ref.where}: the images so far come to {_mp(self.used + n)} pixels, past this "
                               f"server's limit of {_mp(self.per_request)} per request (--max-request-pixels); send "
                               "fewer or smaller images", param=ref.where)
        self.used += n


def _mp(n: int) -> str:
    return f"{n / 1e6:.1f} M"


def load_image(ref: ImageRef, allowed_dirs: list[Path], budget: PixelBudget | None = None):
    """An image_url -> an RGB PIL image, or RequestError naming the part and the fix. Its size is
    read from the header and checked against ``budget`` before any pixel is decoded."""
    url = ref.url
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise RequestError(f"{ref.where}: a data URL must be base64, like data:image/png;base64,<data>",
                               param=ref.where)
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{ref.where}: the data URL is not valid base64; encode the image file's bytes "
                               "with base64 (data:image/png;base64,<data>)", param=ref.where) from None
        return _open(io.BytesIO(raw), ref, "the base64 data is not an image", budget)
    if urlparse(url).scheme in ("http", "https"):
        raise RequestError(f"{ref.where}: mmspec serve does not fetch remote images ({url[:60]}); send the image "
                           "as a data URL (data:image/png;base64,...) or a local file path", param=ref.where)
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url)
    return _open(_local(path, ref, allowed_dirs), ref, "the file is not an image", budget)


def _local(path: Path, ref: ImageRef, allowed_dirs: list[Path]) -> Path:
    if not allowed_dirs:
        raise RequestError(f"{ref.where}: this server reads no local image files; send the image as a data URL "
                           "(data:image/png;base64,...), or start the server with --allowed-local-media-path DIR",
                           param=ref.where)
    try:
        real = path.resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop, a name too long
        raise RequestError(f"{ref.where}: {str(path)[:200]!r} is no valid file path; send the image as a data URL",
                           param=ref.where) from None
    if not any(real.is_relative_to(d) for d in allowed_dirs):  # (the directories are not named: server paths)
        raise RequestError(f"{ref.where}: {str(path)[:200]!r} is outside the directories this server reads images "
                           "from (its --allowed-local-media-path); send it as a data URL or move it there",
                           param=ref.where)
    if not real.is_file():
        raise RequestError(f"{ref.where}: image file not found: {str(path)!r}; check the path", param=ref.where)
    return real


def _open(source, ref: ImageRef, what: str, budget: PixelBudget | None):
    from PIL import Image

    try:
        with Image.open(source) as im:  # reads the header only
            if budget is not None:
                budget.take(ref, *im.size)
            return im.convert("RGB")
    except RequestError:
        raise
    except Image.DecompressionBombError:  # Pillow's own limit, past twice its MAX_IMAGE_PIXELS
        raise RequestError(f"{ref.where}: the image has more pixels than Pillow will decode (a decompression "
                           "bomb); send a smaller image", param=ref.where) from None
    except Exception as e:  # noqa: BLE001 - Pillow raises many kinds (unidentified, truncated)
        raise RequestError(f"{ref.where}: {what} ({e.__class__.__name__}); send a PNG or JPEG image that "
                           "Pillow can open", param=ref.where) from None


def build_prompt(processor, tokenizer, messages: list[ChatMessage], tools=None) -> str:
    """The prompt text for ``messages`` (images as markers where their parts are); ``tools``
    (OpenAI's function dicts) presented to the model (module docstring)."""
    turns = [(_role(m), _turn_text(m)) for m in messages]
    n_images = [_image_count(m) for m in messages]
    template = _template_text(processor)
    native = bool(tools) and "tools" in template  # the template renders them itself
    if tools and not native:
        turns, n_images = _with_tools_text(turns, n_images, tools)
    try:
        if len(turns) == 1 and not native:
            return chat_prompt(processor, turns[0][1], n_images[0])
        if template:
            return _templated(processor, turns, n_images, tools=list(tools) if native else None)
        return _framed(tokenizer, turns, n_images)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - an MMSpecError of the prompt helpers, or a template's own
        raise RequestError(str(e).replace("--image", "image_url part").replace("--prompt", "the text")) from None


def _template_text(processor) -> str:
    t = getattr(processor, "chat_template", None)
    return " ".join(map(str, t.values())) if isinstance(t, dict) else (t or "")


def _role(m: ChatMessage) -> str:
    return "user" if m.role == "tool" else m.role


def _turn_text(m: ChatMessage) -> str:
    """A turn's text; an assistant's tool calls and a tool's result in Hermes' tags."""
    if m.role == "tool":
        return f"<tool_response>\n{m.content}\n</tool_response>"
    text = marked_text(m) if m.content else ""
    for call in m.tool_calls or []:
        f = call["function"]
        try:
            args = json.loads(f.get("arguments") or "{}")
        except ValueError:
            args = f.get("arguments")
        text += ("\n" if text else "") + "<tool_call>\n" + json.dumps({"name": f["name"], "arguments": args},
                                                                      ensure_ascii=False) + "\n</tool_call>"
    return text


def tools_text(tools) -> str:
    """The system text that lists ``tools`` (Hermes' form) for a template that does not take them."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to answer. The functions, one JSON signature a line, "
            f"within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\nTo call one, write a JSON object with "
            "its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')


def _with_tools_text(turns, n_images, tools):
    """The tools' system text in front (joined to a system message already there)."""
    text = tools_text(tools)
    if turns and turns[0][0] in ("system", "developer"):
        return [("system", turns[0][1].rstrip() + "\n\n" + text), *turns[1:]], n_images
    return [("system", text), *turns], [0, *n_images]


def _image_count(message: ChatMessage) -> int:
    return sum(p.type == "image_url" for p in message.content) if isinstance(message.content, list) else 0


def _templated(processor, turns: list[tuple[str, str]], n_images: list[int], tools=None) -> str:
    messages = []
    for (role, text), n in zip(turns, n_images):
        text = with_markers(text, n) if role == "user" else text
        parts = []
        for k, piece in enumerate(text.split(IMAGE_MARKER)):
            if k:
                parts.append({"type": "image"})
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip()})
        messages.append({"role": "system" if role == "developer" else role, "content": parts})
    extra = {"tools": tools} if tools else {}
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


def _framed(tokenizer, turns: list[tuple[str, str]], n_images: list[int]) -> str:
    eos = getattr(tokenizer, "eos_token", None) or ""
    out = []
    for (role, text), n in zip(turns, n_images):
        if role in ("system", "developer"):
            out.append(text.strip() + " ")
        elif role == "user":
            out.append(frame_prompt(text, n))
        else:
            answer = text if text.startswith(" ") else " " + text
            out.append(answer.rstrip() + eos)
    return "".join(out)
