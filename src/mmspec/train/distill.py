"""Target answers for draft distillation: what the target itself says, as token ids.

Owns: generating ``target.generate(do_sample=False)`` answers for world samples (images, or the
video clips on a Video-LLaVA target), batched over
prompts of the same token length (no padding, so every row is computed at the positions a
one-row call uses), one JSONL row per sample, appended and fsynced after each batch in the
resumable format of :mod:`mmspec.bench.store`, so an interrupted run resumes where it stopped; reading such a file back, refusing rows made for another target,
vocabulary, seed, length or version of a sample; and putting the answers on training examples
(``Example.answer_ids``).

Why: speculative decoding accepts a drafted token when it is the target's choice, not the
world's reference answer. A draft trained on the reference answers learns the spread of their
phrasings; a draft trained on the target's own greedy answers learns the phrasing the target
picks. Does not train anything (``mmspec train stage --answers FILE`` does).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mmspec.errors import MMSpecError


@dataclass(frozen=True)
class AnswerSource:
    """What an answers file was made with; every row carries it, and a resume must match it."""

    target: str  # fingerprint of the target's weights (:func:`target_fingerprint`)
    tokenizer: str  # fingerprint of its vocabulary (:func:`tokenizer_fingerprint`): ids mean tokens of it
    seed: int  # the world seed of the samples (uids name different samples under another seed)
    max_new_tokens: int


# Why a field may not differ, and the fix, for the refusals of :func:`read_answers`.
_MISMATCH_FIX = {
    "target": "these answers are another target's; write this target's to another --out file",
    "tokenizer": "the ids are tokens of another vocabulary; a draft must share its target's tokenizer "
                 "(start it with --init from a draft of that target)",
    "seed": "the uids name other world samples; train with --world-seed set to the seed the answers "
            "were made with, or make answers for this seed",
    "max_new_tokens": "the answers were cut at another length; write these to another --out file",
}


def target_fingerprint(model_dir: str | Path) -> str:
    """sha256 (16 hex digits) of the target's safetensors files: answers belong to these weights."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise MMSpecError(f"{model_dir} holds no *.safetensors weights; answers are tied to a target's "
                          "safetensors files (save it with save_pretrained, whose default they are)")
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:  # in chunks: a 7B target's shards are gigabytes
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex digits) of a tokenizer's vocabulary (token -> id)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def answer_source(path: str | Path) -> AnswerSource:
    """The source recorded in an answers file's first row."""
    with Path(path).open() as f:
        row = json.loads(f.readline())
    return AnswerSource(**{f.name: row.get(f.name) for f in fields(AnswerSource)})


def prompt_hash(prompt: str) -> str:
    """12 hex digits of sha256 of a sample's prompt: a row answers this version of the sample
    (the world's templates and questions may change under the same uid; images are not hashed)."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:12]


def read_answers(path: str | Path, source: AnswerSource | None = None, prompts: dict[str, str] | None = None,
                 **expect) -> dict[str, tuple[int, ...]]:
    """uid -> answer ids (eos included where the target stopped) of an answers file.

    Every row must have been made with ``source`` (default: the first row's, so a file that mixes
    two targets, vocabularies, seeds or lengths is refused); ``expect`` also checks single fields
    (``seed=61``, ``tokenizer=...``); ``prompts`` (uid -> prompt) checks that each row answered
    this version of its sample. A refusal names the row, the field, both values and the fix:
    training on such a row would teach answers that are not this target's, ids of another
    vocabulary, or the answer to another prompt. The file is the append-only JSONL of
    :mod:`mmspec.bench.store`: a torn last line (a run killed mid-write) is skipped.
    """
    from mmspec.bench.store import read_rows

    return _checked(read_rows(Path(path))[0], path, source, prompts, expect)


def _checked(rows: list[dict], path, source: AnswerSource | None, prompts: dict[str, str] | None,
             expect: dict) -> dict[str, tuple[int, ...]]:
    """:func:`read_answers` on rows already read."""
    out: dict[str, tuple[int, ...]] = {}
    want: dict | None = None  # the first row's source, then what the caller asks for, checked on every row
    for n, row in enumerate(rows, 1):
        missing = [k for k in ("uid", "answer_ids", "prompt", *_MISMATCH_FIX) if k not in row]
        if missing:
            raise MMSpecError(f"{path}: row {n} has no {', '.join(missing)}: the file was written by an older "
                              "mmspec or is damaged; make the answers again with `mmspec train answers`")
        if want is None:
            want = {**{k: row[k] for k in _MISMATCH_FIX}, **(source.__dict__ if source else {}), **expect}
        for field, value in want.items():
            if row[field] != value:
                raise MMSpecError(f"{path}: row {n} was made with {field} {row[field]!r}, not {value!r}: "
                                  f"{_MISMATCH_FIX[field]}")
        uid = row["uid"]
        if uid in out:
            raise MMSpecError(f"{path}: row {n} answers {uid} a second time; the file was joined from two runs, "
                              "make it again")
        if prompts is not None and uid in prompts and row["prompt"] != prompt_hash(prompts[uid]):
            raise MMSpecError(f"{path}: row {n} answered another version of {uid} (its prompt changed since): "
                              "the world changed under the file; make the answers again")
        out[uid] = tuple(row["answer_ids"])
    return out


def cut_at_eos(ids: Sequence[int], eos: int | Sequence[int] | None) -> list[int]:
    """``ids`` up to and including the first eos (what ``generate`` returns for a lone row)."""
    stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[: i + 1])
    return list(ids)


@torch.inference_mode()
def generate_answers(target, processor, samples: Sequence, path: str | Path, source: AnswerSource,
                     batch_size: int = 32, device: str | torch.device = "cpu",
                     progress: bool = True) -> dict[str, int]:
    """Append to ``path`` the target's greedy answer to every sample not in it yet; returns counts.

    Prompts are grouped by token length and each group is generated ``batch_size`` rows at a
    time; rows that stop early are cut at their first eos, so a row equals the lone-row
    ``target.generate`` output (up to the kernels' batch-size-dependent rounding).
    """
    def key(s) -> tuple[int, int]:
        # one key per expanded prompt length, found without preprocessing any image (the processor
        # expands each <image> to the same token count)
        return len(processor.tokenizer(s.prompt)["input_ids"]), len(s.images)

    def encode(batch: Sequence) -> dict:
        images = [img for s in batch for img in s.images]
        return processor(text=[s.prompt for s in batch], images=images or None, return_tensors="pt")

    return _answer(target, processor.tokenizer, samples, path, source, key, encode, batch_size, device, progress)


@torch.inference_mode()
def generate_clip_answers(target, processor, clips: Sequence, path: str | Path, source: AnswerSource,
                          batch_size: int = 8, device: str | torch.device = "cpu",
                          progress: bool = True) -> dict[str, int]:
    """:func:`generate_answers` for the world's video clips (:func:`mmspec.world.make_video_sample`)
    on a Video-LLaVA target such as ``mmspec train video``'s: each clip encoded as the pair trains
    and decodes it (:func:`mmspec.world.processor.clip_inputs`, the frame count read off the
    target's ``video_seq_length``), the same resumable rows."""
    from mmspec.world.processor import clip_inputs, clip_layout

    vid, n_frames, per_frame = clip_layout(target)
    tok, ip = processor.tokenizer, processor.image_processor

    def key(s) -> int:  # every clip's one <video> expands to the same slots
        return len(tok(s.prompt)["input_ids"])

    def encode(batch: Sequence) -> dict:
        xs = [clip_inputs(s, tok, ip, vid, n_frames, per_frame) for s in batch]
        ids = torch.stack([x["input_ids"] for x in xs])  # [B, L]: one length per group
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values_videos": torch.cat([x["pixel_values_videos"] for x in xs])}  # [B, T, 3, H, W]

    return _answer(target, tok, clips, path, source, key, encode, batch_size, device, progress)


def _answer(target, tokenizer, samples: Sequence, path: str | Path, source: AnswerSource,
            key: Callable, encode: Callable, batch_size: int, device, progress: bool) -> dict[str, int]:
    """The loop of :func:`generate_answers`: samples grouped by ``key`` (one prompt length a group,
    no padding), ``encode(batch)`` -> the target's inputs, rows appended after each batch."""
    if batch_size < 1:
        raise MMSpecError(f"batch size must be at least 1; got {batch_size}")
    from mmspec.bench.store import RowWriter

    path = Path(path)
    gen = target.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else tokenizer.pad_token_id
    dtype = next(target.parameters()).dtype
    # opening cuts a torn last line (a run killed mid-write), so that sample is generated again
    with RowWriter(path, key=lambda row: row["uid"]) as out:
        _checked(out.rows, path, source, {s.uid: s.prompt for s in samples}, {})
        todo = [s for s in samples if s.uid not in out]
        groups: dict[object, list] = defaultdict(list)
        for s in todo:
            groups[key(s)].append(s)
        batches = [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
        with tqdm(total=len(todo), desc="target answers", unit="sample", disable=not progress,
                  mininterval=2.0) as bar:
            for batch in batches:
                inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
                          for k, v in encode(batch).items() if isinstance(v, torch.Tensor)}
                n_in = inputs["input_ids"].shape[1]
                new = target.generate(**inputs, do_sample=False, max_new_tokens=source.max_new_tokens,
                                      pad_token_id=pad)[:, n_in:]  # [B, n_new]
                out.extend({"uid": s.uid, "answer_ids": cut_at_eos(row, gen.eos_token_id),
                            "prompt": prompt_hash(s.prompt), **source.__dict__}
                           for s, row in zip(batch, new.tolist()))
                bar.update(len(batch))
    return {"samples": len(samples), "already_there": len(samples) - len(todo), "written": len(todo)}


def with_answers(examples: Sequence, samples: Sequence, answers: dict[str, tuple[int, ...]]) -> list:
    """``examples[i]`` (made from ``samples[i]``) answering with the target's ids instead of the
    reference text; every sample must have an answer (a partial file would mix two teachers)."""
    missing = [s.uid for s in samples if s.uid not in answers]
    if missing:
        raise MMSpecError(f"the answers file lacks {len(missing)} of the {len(samples)} training samples (e.g. "
                          f"{missing[0]}); run `mmspec train answers` with the same world seed and sample counts first")
    return [replace(ex, answer_ids=answers[s.uid]) for ex, s in zip(examples, samples, strict=True)]
