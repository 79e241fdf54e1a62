"""The user's own conversations as head-training sequences, for any family the library decodes.

Owns: reading conversation files (LLaVA-Instruct JSON and ShareGPT-style JSON / JSONL, with
``image`` / ``images`` / ``video`` / ``videos`` fields naming files of a media folder; several
turns, several images); building each one's training sequence with the TARGET's own processor
and chat template (LLaVA-1.5's ``USER: ... ASSISTANT: ...</s>`` frame where the processor has no
template), the loss mask over the assistant turns; counting and skipping bad records (a missing
or unreadable image or video, no assistant turn, markers that do not match the media, a
conversation past the context) with a summary, refusing a file with none usable; and the
EAGLE-3 draft vocabulary chosen from the training tokens' frequencies.

Does not train (:mod:`mmspec.train.head` does) and knows nothing of a family's internals: the
processor expands the markers, whatever the family.

Records (one JSON object each; a ``.jsonl`` file holds one per line, a ``.json`` file a list)::

    {"id": "7", "image": "a.jpg",                      # or "images": [...], "video": "clip/" ...
     "conversations": [{"from": "human", "value": "<image>\\nWhat is it?"},
                       {"from": "gpt", "value": "A cat."}, ...]}
    {"images": ["a.jpg", "b.jpg"],
     "messages": [{"role": "user", "content": "<image> <image> Compare."},
                  {"role": "assistant", "content": "..."}]}

Roles: human / user, gpt / assistant / model, system. ``<image>`` / ``<video>`` mark where each
medium goes (in order); a record whose text has no marker gets one per medium in front of its
first user turn. A video is a directory of frames or a video file (:func:`mmspec.inputs.load_video`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmspec.errors import MMSpecError
from mmspec.inputs import load_video, processor_markers
from mmspec.prompt import IMAGE_MARKER, VIDEO_MARKER

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "bot": "assistant", "system": "system"}


@dataclass
class Conversation:
    """One record: its turns (role, text with ``<image>`` / ``<video>`` markers) and media files."""

    uid: str
    turns: list[tuple[str, str]]
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)


class Skipped(Exception):
    """A record that cannot be used; its message is the reason it is counted under."""


@dataclass
class DataReport:
    """What became of a file's records: how many were read, used, and skipped (reason -> count)."""

    path: str
    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> the first record skipped for it

    def summary(self) -> str:
        why = "; ".join(f"{reason}: {n} (e.g. record {self.examples[reason]})"
                        for reason, n in self.skipped.most_common())
        return (f"{self.path}: {self.read} conversation(s) read, {self.used} used"
                + (f", {sum(self.skipped.values())} skipped ({why})" if self.skipped else ""))


# --------------------------------------------------------------------------- reading
def read_conversations(path: str | Path, limit: int | None = None) -> tuple[list[Conversation | None], list[str]]:
    """The records of a LLaVA-Instruct / ShareGPT JSON or JSONL file, in order (at most ``limit``);
    a record that is no conversation at all is None, with its reason in the second list."""
    path = Path(path)
    if not path.is_file():
        raise MMSpecError(f"conversation file {str(path)!r} not found; give a JSON or JSONL file of conversations")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".jsonl":
        raw = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    raw.append(json.loads(line))
                except ValueError:
                    raw.append(f"line {n} is not JSON")
    else:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise MMSpecError(f"{path} is not JSON ({e}); give a JSON list of conversations, or a .jsonl file with "
                              "one conversation per line") from None
        if isinstance(raw, dict) and isinstance(raw.get("data"), list):
            raw = raw["data"]
        if not isinstance(raw, list):
            raise MMSpecError(f"{path} holds a JSON {type(raw).__name__}, not a list of conversations")
    out, reasons = [], []
    for i, rec in enumerate(raw[:limit] if limit else raw):
        try:
            out.append(_conversation(rec, i))
            reasons.append("")
        except Skipped as e:
            out.append(None)
            reasons.append(str(e))
    return out, reasons


def _media(rec: dict, *keys: str) -> list[str]:
    files = []
    for k in keys:
        v = rec.get(k)
        if isinstance(v, str) and v:
            files.append(v)
        elif isinstance(v, list):
            files.extend(str(x) for x in v if x)
    return files


def _text(content) -> str:
    """A turn's text: a string, or OpenAI-style content parts (text, image, video) in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for c in content:
            kind = c.get("type") if isinstance(c, dict) else None
            if kind == "text":
                parts.append(str(c.get("text", "")))
            elif kind in ("image", "image_url"):
                parts.append(IMAGE_MARKER)
            elif kind in ("video", "video_url"):
                parts.append(VIDEO_MARKER)
        return " ".join(parts)
    raise Skipped("a turn without text")


def _conversation(rec, i: int) -> Conversation:
    if isinstance(rec, str):
        raise Skipped(rec)
    if not isinstance(rec, dict):
        raise Skipped("not a JSON object")
    raw_turns = rec.get("conversations") or rec.get("messages") or rec.get("conversation")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise Skipped("no turns (conversations / messages)")
    turns = []
    for t in raw_turns:
        if not isinstance(t, dict):
            raise Skipped("a turn that is not a JSON object")
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        if role is None:
            raise Skipped(f"a turn of unknown role {t.get('from', t.get('role'))!r}")
        turns.append((role, _text(t.get("value", t.get("content")))))
    return Conversation(str(rec.get("id", i)), turns, _media(rec, "image", "images"), _media(rec, "video", "videos"))


# --------------------------------------------------------------------------- building
def _with_markers(conv: Conversation) -> list[tuple[str, str]]:
    """The turns with one marker per medium: the record's own, or all in front of the first user turn."""
    turns = list(conv.turns)
    text = " ".join(t for _, t in turns)
    n_img, n_vid = text.count(IMAGE_MARKER), text.count(VIDEO_MARKER)
    if n_img == 0 and n_vid == 0 and (conv.images or conv.videos):
        k = next((j for j, (r, _) in enumerate(turns) if r == "user"), None)
        if k is None:
            raise Skipped("no user turn")
        front = " ".join([IMAGE_MARKER] * len(conv.images) + [VIDEO_MARKER] * len(conv.videos))
        turns[k] = ("user", f"{front}\n{turns[k][1]}")
    elif n_img != len(conv.images) or n_vid != len(conv.videos):
        raise Skipped("markers do not match its media")
    return turns


def _parts(text: str) -> list[dict]:
    import re

    out = []
    for piece in re.split(f"({IMAGE_MARKER}|{VIDEO_MARKER})", text):
        if piece == IMAGE_MARKER:
            out.append({"type": "image"})
        elif piece == VIDEO_MARKER:
            out.append({"type": "video"})
        elif piece.strip():
            out.append({"type": "text", "text": piece.strip()})
    return out


def render(processor, turns: Sequence[tuple[str, str]], generation_prompt: bool) -> str:
    """``turns`` as the target's text: its processor's chat template (image / video content parts
    where the markers are), else LLaVA-1.5's ``USER: ... ASSISTANT: ...</s>`` frame; the
    processor's own markers where they differ (Qwen's pads)."""
    if getattr(processor, "chat_template", None):
        msgs = [{"role": r, "content": _parts(t)} for r, t in turns]
        return processor.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)
    eos = processor.tokenizer.eos_token or ""
    text = ""
    for role, t in turns:
        if role == "system":
            text += t.strip() + " "
        elif role == "user":
            text += f"USER: {t.strip()} "
        else:
            text += f"ASSISTANT: {t.strip()}{eos}"
    if generation_prompt:
        text += "ASSISTANT:"
    return processor_markers(processor, text.rstrip(" ") if generation_prompt else text)


def _count(processor, text: str, images, videos) -> int:
    """Tokens of ``text`` as the processor expands it, given the media its markers use (in order)."""
    img = getattr(processor, "image_token", None) or IMAGE_MARKER
    vid = getattr(processor, "video_token", None) or VIDEO_MARKER
    n_i, n_v = text.count(img), (text.count(vid) if videos else 0)
    return int(_run(processor, text, images[:n_i], videos[:n_v])["input_ids"].shape[-1])


def _run(processor, text: str, images, videos) -> dict:
    kw = {}
    if images:
        kw["images"] = list(images)
    if videos:
        kw["videos"] = [list(v) for v in videos]
    try:
        out = dict(processor(text=text, return_tensors="pt", **kw))
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise Skipped(f"rejected by the processor ({type(e).__name__})") from e
    # A processor that takes no videos (or images) may accept the argument and ignore it: the
    # marker then stays one token and the media are dropped without a word. Refuse, whatever the record.
    if videos and "pixel_values_videos" not in out:
        raise MMSpecError(f"the target's processor ({type(processor).__name__}) made no pixel_values_videos for a "
                          "conversation's video: it does not read videos, and training on it would drop every clip. "
                          "The video families' processors need torchvision: pip install 'mmspec[video]'")
    if images and not any(k.startswith("pixel_values") and k != "pixel_values_videos" for k in out):
        raise MMSpecError(f"the target's processor ({type(processor).__name__}) made no pixel values for a "
                          "conversation's images: it does not read images; save the target's own processor beside it")
    return out


def _load_media(conv: Conversation, media_dir: Path | None, n_frames: int):
    from PIL import Image, UnidentifiedImageError

    def where(name: str) -> Path:
        p = Path(name)
        return p if p.is_absolute() or media_dir is None else Path(media_dir) / p

    images = []
    for name in conv.images:
        f = where(name)
        if not f.is_file():
            raise Skipped("missing image")
        try:
            with Image.open(f) as im:
                images.append(im.convert("RGB"))
        except (UnidentifiedImageError, OSError):
            raise Skipped("unreadable image") from None
    videos = []
    for name in conv.videos:
        f = where(name)
        if not f.exists():
            raise Skipped("missing video")
        try:
            videos.append(load_video(f, n_frames))
        except MMSpecError:
            raise Skipped("unreadable video") from None
    return images, videos


def conversation_sequence(processor, conv: Conversation, media_dir: Path | None, *, max_length: int | None,
                          n_frames: int = 8, mm_token_types: tuple[int, int] | None = None):
    """One conversation -> its training sequence (:class:`mmspec.train.head.Sequence_`): the whole
    conversation through the processor, ``loss_mask`` over each assistant turn's tokens (its
    end-of-turn token included). Raises :class:`Skipped` with the reason a record is unusable.
    ``mm_token_types``: (image id, video id) of a family that reads ``mm_token_type_ids``."""
    from mmspec.train.head import Sequence_

    turns = _with_markers(conv)
    if not any(r == "assistant" and t.strip() for r, t in turns):
        raise Skipped("no assistant turn")
    images, videos = _load_media(conv, media_dir, n_frames)
    full = _run(processor, render(processor, turns, False), images, videos)
    ids = full.pop("input_ids")[0]
    full.pop("attention_mask", None)
    if max_length is not None and ids.shape[0] > max_length:
        raise Skipped("past the context")
    mask = torch.zeros(ids.shape[0], dtype=torch.bool)
    for k, (role, _) in enumerate(turns):
        if role != "assistant":
            continue
        start = _count(processor, render(processor, turns[:k], True), images, videos) if k else 0
        end = _count(processor, render(processor, turns[:k + 1], False), images, videos)
        mask[start:min(end, ids.shape[0])] = True
    if not mask.any():
        raise Skipped("no assistant turn")
    pv = full.pop("pixel_values", None)
    if mm_token_types is not None and "mm_token_type_ids" not in full:
        full["mm_token_type_ids"] = ((ids == mm_token_types[0]).int() + 2 * (ids == mm_token_types[1]).int())[None]
    return Sequence_(ids, pv, mm={k: v for k, v in full.items() if isinstance(v, torch.Tensor)}, loss_mask=mask)


def conversation_sequences(processor, path: str | Path, media_dir: str | Path | None, *, limit: int | None = None,
                           max_length: int | None = None, n_frames: int = 8,
                           mm_token_types: tuple[int, int] | None = None, log=print):
    """Every usable conversation of ``path`` as a training sequence, and the :class:`DataReport`
    (logged in one line). Refuses a file with none usable, saying why each kind was skipped."""
    convs, reasons = read_conversations(path, limit)
    report = DataReport(str(path), read=len(convs))
    seqs = []
    for i, (conv, why) in enumerate(zip(convs, reasons)):
        try:
            if conv is None:
                raise Skipped(why)
            seqs.append(conversation_sequence(processor, conv, None if media_dir is None else Path(media_dir),
                                              max_length=max_length, n_frames=n_frames, mm_token_types=mm_token_types))
        except Skipped as e:
            reason = str(e)
            report.skipped[reason] += 1
            report.examples.setdefault(reason, conv.uid if conv is not None else i)
    report.used = len(seqs)
    if not seqs:
        raise MMSpecError(f"no usable conversation: {report.summary()}; each needs a user turn, an assistant turn, its "
                          "media under --media-dir and at most --max-length tokens")
    log(report.summary())
    return seqs, report


# --------------------------------------------------------------------------- EAGLE-3's draft vocabulary
def draft_vocabulary(seqs: Sequence, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` target ids the training data's assistant turns use most (ties: the lower id
    first), padded with the lowest unused ids when the data holds fewer, sorted: the draft
    vocabulary of an EAGLE-3 head (``d2t``: draft id -> target id; the exports write it as the
    offsets SGLang and vLLM read, and ``t2d``)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise MMSpecError(f"--draft-vocab must be a whole number from 1 to the target's vocabulary ({vocab_size}), "
                          f"got {size!r}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        ids = s.input_ids if s.loss_mask is None else s.input_ids[s.loss_mask]
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))  # unused ids come last, lowest first
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


# --------------------------------------------------------------------------- self-distillation
@torch.inference_mode()
def regenerate_answers(target, processor, path: str | Path, media_dir: str | Path | None, out: str | Path, *,
                       max_new_tokens: int = 512, limit: int | None = None, n_frames: int = 8,
                       mm_token_types: tuple[int, int] | None = None, log=print) -> dict:
    """The conversations of ``path`` with every assistant turn replaced by the TARGET's own greedy
    answer (each turn generated after the earlier ones, as the target answered them), appended to
    ``out`` as ShareGPT JSONL records (``messages``, the media fields as given, ``source`` naming
    the conversation); ``mmspec train head --data sharegpt:OUT`` trains on them. A rerun skips the
    records already in ``out`` (resumable: one fsynced line per conversation); bad records are
    counted and skipped as in :func:`conversation_sequences`. Returns the counts."""
    from mmspec.bench.store import RowWriter

    convs, reasons = read_conversations(path, limit)
    report = DataReport(str(path), read=len(convs))
    gen = target.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else processor.tokenizer.eos_token_id
    dev, dt = next(target.parameters()).device, next(target.parameters()).dtype
    written = 0
    with RowWriter(Path(out), key=lambda row: row["source"]) as rows:
        for i, (conv, why) in enumerate(zip(convs, reasons)):
            key = f"{Path(path).name}#{i}"
            if key in rows:
                report.used += 1
                continue
            try:
                if conv is None:
                    raise Skipped(why)
                turns = _with_markers(conv)
                if not any(r == "assistant" for r, _ in turns):
                    raise Skipped("no assistant turn")
                images, videos = _load_media(conv, None if media_dir is None else Path(media_dir), n_frames)
                done: list[tuple[str, str]] = []
                for role, text in turns:
                    if role != "assistant":
                        done.append((role, text))
                        continue
                    done.append(("assistant", _answer(target, processor, done, images, videos, max_new_tokens, eos,
                                                      mm_token_types, dev, dt)))
            except Skipped as e:
                report.skipped[str(e)] += 1
                report.examples.setdefault(str(e), conv.uid if conv is not None else i)
                continue
            rec = {"id": conv.uid, "source": key, "messages": [{"role": r, "content": t} for r, t in done]}
            if conv.images:
                rec["images"] = conv.images
            if conv.videos:
                rec["videos"] = conv.videos
            rows.extend([rec])
            report.used += 1
            written += 1
    log(report.summary() + f"; {written} answered now -> {out}")
    return {"read": report.read, "used": report.used, "written": written, "skipped": dict(report.skipped)}


def _answer(target, processor, turns, images, videos, max_new_tokens, eos, mm_token_types, dev, dt) -> str:
    """The target's greedy answer after ``turns`` (decoded text, without the eos)."""
    from mmspec.train.distill import cut_at_eos

    text = render(processor, turns, True)
    img = getattr(processor, "image_token", None) or IMAGE_MARKER
    vid = getattr(processor, "video_token", None) or VIDEO_MARKER
    enc = _run(processor, text, images[:text.count(img)], videos[:text.count(vid)] if videos else [])
    ids = enc["input_ids"]
    if mm_token_types is not None and "mm_token_type_ids" not in enc:
        enc["mm_token_type_ids"] = (ids == mm_token_types[0]).int() + 2 * (ids == mm_token_types[1]).int()
    inputs = {k: (v.to(dev, dt) if v.is_floating_point() else v.to(dev)) for k, v in enc.items()
              if isinstance(v, torch.Tensor)}
    new = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    new = cut_at_eos(new, eos)
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    return processor.tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=True).strip()
