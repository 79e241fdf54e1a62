"""``mmspec train head``: flags onto :class:`~mmspec.heads.train.HeadTrainConfig`, and the
training sequences it reads.

Data (``--data``):
* ``world`` (default): the embedded world's train split, image families; each sequence is the
  prompt (through the target's processor) followed by the TARGET's own greedy answer from an
  answers file made by ``mmspec train answers`` (``--answers``), or, without one, the world's
  reference answer (the loss still follows the target's distribution at every position).
* ``llava-instruct:FILE.json`` with ``--image-dir DIR``: LLaVA-Instruct conversations (a JSON
  list of ``{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}]}``): the first turn in the LLaVA-1.5 format
  (``USER: <image>\\n{question} ASSISTANT:``) followed by the answer, images read from DIR.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from mmspec.errors import MMSpecError
from mmspec.heads.train import HeadTrainConfig, Sequence_, train_head


def _encode(processor, prompt: str, images, continuation_ids, image_token_id) -> Sequence_:
    import torch

    enc = processor(text=prompt, images=list(images) or None, return_tensors="pt")
    cont = torch.as_tensor(list(continuation_ids), dtype=torch.long)
    if image_token_id is not None:
        cont = cont[cont != image_token_id]  # an answer never holds image slots
    ids = torch.cat([enc["input_ids"][0], cont])
    pv = enc.get("pixel_values")
    text_prompt = prompt.replace("<image>\n", "").replace("<image>", "")
    t_enc = processor.tokenizer(text_prompt, return_tensors="pt")
    text_only = Sequence_(torch.cat([t_enc["input_ids"][0], cont]), None)
    return Sequence_(ids, pv, text_only=text_only)


def world_sequences(processor, families: List[str], n: int, seed: int, answers: Optional[Path],
                    image_token_id) -> list[Sequence_]:
    from mmspec.world import FAMILIES, make_sample

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise MMSpecError(f"unknown world family {unknown[0]!r}; use some of {', '.join(FAMILIES)}")
    samples = [make_sample(f, "train", i, seed) for i in range(n) for f in families]
    answer_ids = {}
    if answers is not None:
        from mmspec.train.distill import read_answers

        answer_ids = read_answers(answers, seed=seed, prompts={s.uid: s.prompt for s in samples})
        missing = [s.uid for s in samples if s.uid not in answer_ids]
        if missing:
            raise MMSpecError(f"{answers} lacks {len(missing)} of the {len(samples)} training samples (e.g. "
                              f"{missing[0]}); make them with `mmspec train answers` for the same families, "
                              "counts and world seed")
    tok = processor.tokenizer
    out = []
    for s in samples:
        cont = answer_ids.get(s.uid) or tok(" " + s.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(_encode(processor, s.prompt, s.images, cont, image_token_id))
    return out


def llava_instruct_sequences(processor, path: Path, image_dir: Path, n: int, image_token_id) -> list[Sequence_]:
    from PIL import Image

    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise MMSpecError(f"{path} is not a LLaVA-Instruct JSON list of conversations")
    tok = processor.tokenizer
    out = []
    for row in rows[:n]:
        conv = row.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        question = conv[0]["value"]
        images = []
        if row.get("image"):
            f = Path(image_dir) / row["image"]
            if not f.exists():
                raise MMSpecError(f"image {f} of conversation {row.get('id')} not found; --image-dir must hold "
                                  "the images the JSON names (e.g. COCO train2017 for LLaVA-Instruct-150K)")
            images = [Image.open(f).convert("RGB")]
            if "<image>" not in question:
                question = "<image>\n" + question
        prompt = f"USER: {question} ASSISTANT:"
        cont = tok(" " + conv[1]["value"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(_encode(processor, prompt, images, cont, image_token_id))
    if not out:
        raise MMSpecError(f"{path} has no usable conversations (a human turn followed by a gpt turn)")
    return out


def head(
    target: Path = typer.Option(..., help="The target model directory (its processor is read from it too)."),
    variant: str = typer.Option("eagle", help="eagle (EAGLE-1/2), eagle3 (low/mid/high features, training-time "
                                "test) or msd (decoupled modality, text-first)."),
    out: Path = typer.Option(..., help="Where the head is saved (and its checkpoint: a rerun resumes)."),
    data: str = typer.Option("world", help="world, or llava-instruct:FILE.json (with --image-dir)."),
    image_dir: Optional[Path] = typer.Option(None, help="Images of a llava-instruct JSON."),
    answers: Optional[Path] = typer.Option(None, help="The target's own greedy answers (mmspec train answers) "
                                           "to the world's training prompts."),
    families: str = typer.Option("chartqa,textvqa,vqav2,hallusionbench,spot_the_diff,iedit,pororosv,vist",
                                 help="World families to train on."),
    samples: int = typer.Option(200, help="Training samples per world family (or conversations of the JSON)."),
    world_seed: int = typer.Option(0, help="World seed of the samples (must match the answers file's)."),
    layers: int = typer.Option(1, help="Decoder layers of the head."),
    steps: int = typer.Option(1000),
    minutes: Optional[float] = typer.Option(None, help="Time budget: stop and save when it is spent."),
    batch_size: int = typer.Option(16, help="Global batch (split over torchrun's processes)."),
    lr: float = typer.Option(1e-3),
    ttt_steps: int = typer.Option(3, help="eagle3: unrolled training-time-test passes."),
    text_steps: Optional[int] = typer.Option(None, help="msd: text-only steps first (default: a third of --steps)."),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads per process."),
    fresh: bool = typer.Option(False, help="Start over instead of resuming the checkpoint in --out."),
) -> None:
    """Train a feature-level draft head (EAGLE / EAGLE-3 / MSD) on the frozen target's features.

    Scales out with `torchrun --nproc_per_node=N -m mmspec train head ...` (DDP)."""
    import os

    import torch
    from transformers import AutoProcessor

    from mmspec.cli import _fail
    from mmspec.models.loading import load_model
    from mmspec.provenance import command_line

    try:
        if threads:
            torch.set_num_threads(threads)
        local = os.environ.get("LOCAL_RANK")
        if device == "cuda" and local is not None:
            device = f"cuda:{local}"
        cfg = HeadTrainConfig(variant=variant, out=str(out), num_layers=layers, steps=steps, minutes=minutes,
                              batch_size=batch_size, lr=lr, ttt_steps=ttt_steps, text_steps=text_steps, seed=seed,
                              resume=not fresh, device=device,
                              notes={"command": command_line(), "data": data, "samples": samples, "families": families,
                                     "answers": str(answers) if answers else None, "world_seed": world_seed})
        model = load_model(str(target), dtype="float32" if device == "cpu" else "auto")
        processor = AutoProcessor.from_pretrained(str(target))
        img = getattr(model.config, "image_token_id", None)
        if data == "world":
            seqs = world_sequences(processor, [f for f in families.split(",") if f], samples, world_seed, answers, img)
        elif data.startswith("llava-instruct:"):
            if image_dir is None:
                raise MMSpecError("--data llava-instruct:FILE needs --image-dir (where the JSON's images are)")
            seqs = llava_instruct_sequences(processor, Path(data.split(":", 1)[1]), image_dir, samples, img)
        else:
            raise MMSpecError(f"unknown --data {data!r}; use world or llava-instruct:FILE.json")
        train_head(model, seqs, cfg)
    except MMSpecError as e:
        _fail(e)
