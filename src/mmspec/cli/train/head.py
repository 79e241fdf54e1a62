"""``mmspec train head``: flags onto :class:`~mmspec.heads.train.HeadTrainConfig`; the training
sequences come from :func:`~mmspec.heads.train.world_sequences` or
:func:`~mmspec.heads.train.llava_instruct_sequences`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mmspec.cli.common import fail, set_threads
from mmspec.errors import MMSpecError
from mmspec.heads.train import HeadTrainConfig, llava_instruct_sequences, train_head, world_sequences


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

    from transformers import AutoProcessor

    from mmspec.models.loading import load_model
    from mmspec.provenance import command_line

    try:
        set_threads(threads)
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
        fail(e)
