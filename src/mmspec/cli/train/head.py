"""``mmspec train head``: flags onto :class:`~mmspec.train.head.HeadTrainConfig`; the training
sequences come from :func:`~mmspec.train.head.world_sequences` or
:func:`~mmspec.train.head.llava_instruct_sequences`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.cli.common import set_threads
from mmspec.cli.train.common import (
    check_device,
    check_model_dir,
    check_model_type,
    check_out,
    check_processor,
    check_threads,
    training_errors,
)
from mmspec.errors import MMSpecError
from mmspec.train.head import (
    HeadTrainConfig,
    llava_instruct_sequences,
    train_head,
    world_sequences,
)


def head(
    target: Path = typer.Option(..., help="The target model directory (its processor is read from it too)."),
    variant: str = typer.Option("eagle", help="eagle (EAGLE-1/2), eagle3 (low/mid/high features, training-time "
                                "test) or msd (decoupled modality, text-first)."),
    out: Path = typer.Option(..., help="Where the head is saved (and its checkpoint: a rerun resumes)."),
    data: str = typer.Option("world", help="world, or llava-instruct:FILE.json (with --image-dir)."),
    image_dir: Path | None = typer.Option(None, help="Images of a llava-instruct JSON."),
    answers: Path | None = typer.Option(None, help="The target's own greedy answers (mmspec train answers) "
                                           "to the world's training prompts."),
    families: str = typer.Option("chartqa,textvqa,vqav2,hallusionbench,spot_the_diff,iedit,pororosv,vist",
                                 help="World families to train on."),
    samples: int = typer.Option(200, help="Training samples per world family (or conversations of the JSON)."),
    world_seed: int = typer.Option(0, help="World seed of the samples (must match the answers file's)."),
    layers: int = typer.Option(1, help="Decoder layers of the head."),
    steps: int = typer.Option(1000, help="Optimizer steps in all (a resume may raise it, never lower it)."),
    minutes: float | None = typer.Option(None, help="Time budget: stop and save when it is spent."),
    batch_size: int = typer.Option(16, help="Global batch (split over torchrun's processes)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW: warm-up over the first 50 steps, then a cosine to a tenth of it)."),
    ttt_steps: int = typer.Option(3, help="eagle3: unrolled training-time-test passes."),
    text_steps: int | None = typer.Option(None, help="msd: text-only steps first (default: a third of --steps; "
                                             "with --minutes, that share of the time budget if it ends training "
                                             "first)."),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)."),
    threads: int | None = typer.Option(None, help="CPU threads per process."),
    fresh: bool = typer.Option(False, help="Start over instead of resuming the checkpoint in --out."),
) -> None:
    """Train a feature-level draft head (EAGLE / EAGLE-3 / MSD) on the frozen target's features.

    Scales out with `torchrun --nproc_per_node=N -m mmspec train head ...` (DDP). Ctrl-C keeps the
    finished steps (OUT/checkpoints/head.pt and the head itself); the same command resumes them."""
    import os

    from mmspec.provenance import command_line

    with training_errors():
        local = os.environ.get("LOCAL_RANK")
        if device == "cuda" and local is not None:
            device = f"cuda:{local}"
        cfg = HeadTrainConfig(variant=variant, out=str(out), num_layers=layers, steps=steps, minutes=minutes,
                              batch_size=batch_size, lr=lr, ttt_steps=ttt_steps, text_steps=text_steps, seed=seed,
                              resume=not fresh, device=device,
                              notes={"command": command_line(), "data": data, "samples": samples, "families": families,
                                     "answers": str(answers) if answers else None, "world_seed": world_seed})
        check_head_options(cfg, target, data, image_dir, answers, families, samples, threads)
        set_threads(threads)
        from transformers import AutoProcessor

        from mmspec.models.loading import load_model

        model = load_model(str(target), dtype="float32" if device == "cpu" else "auto")
        try:
            processor = AutoProcessor.from_pretrained(str(target))
        except (OSError, ValueError, TypeError) as e:
            raise MMSpecError(f"--target {target} has no processor to read ({type(e).__name__}); it needs the "
                              "tokenizer and image processor files next to config.json") from None
        img = getattr(model.config, "image_token_id", None)
        if data == "world":
            seqs = world_sequences(processor, names(families), samples, world_seed, answers, img)
        else:
            seqs = llava_instruct_sequences(processor, Path(data.split(":", 1)[1]), image_dir, samples, img)
        train_head(model, seqs, cfg)


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_head_options(cfg: HeadTrainConfig, target: Path, data: str, image_dir: Path | None,
                       answers: Path | None, families: str, samples: int, threads: int | None) -> None:
    """Every `train head` option, before anything is loaded or written (the numbers of the
    config itself are checked by :class:`HeadTrainConfig`)."""
    from mmspec.train.head import CHECKPOINT, head_settings
    from mmspec.train.loop import read_checkpoint
    from mmspec.world import FAMILIES

    check_threads(threads)
    if isinstance(samples, bool) or samples < 1:
        raise MMSpecError(f"--samples must be >= 1, got {samples}")
    check_device(cfg.device)
    check_model_dir(target, "--target", "a target model")
    check_model_type(target, "--target", "llava", "`train head` builds its training sequences in LLaVA-1.5's prompt "
                     "and image format (the world's data and llava-instruct both): give a LLaVA-1.5 target")
    check_processor(target, "--target")
    if data == "world":
        unknown = [f for f in names(families) if f not in FAMILIES]
        if unknown or not names(families):
            raise MMSpecError(f"--families {families!r}: unknown world family {unknown[0] if unknown else '(none)'!r}; "
                              f"use some of {', '.join(FAMILIES)}")
        if answers is not None and not answers.is_file():
            raise MMSpecError(f"answers file {answers} not found; make it with `mmspec train answers --out {answers}` "
                              "for the same families, counts and world seed, or leave --answers out")
        if image_dir is not None:
            raise MMSpecError("--image-dir holds a llava-instruct JSON's images; the world makes its own: drop it or "
                              "use --data llava-instruct:FILE.json")
    elif data.startswith("llava-instruct:"):
        path = Path(data.split(":", 1)[1])
        if not path.is_file():
            raise MMSpecError(f"--data {data}: {path} not found; give a LLaVA-Instruct JSON file")
        if image_dir is None or not image_dir.is_dir():
            raise MMSpecError("--data llava-instruct:FILE needs --image-dir, the folder of the JSON's images"
                              + (f"; {image_dir} is not a folder" if image_dir is not None else ""))
        if answers is not None:
            raise MMSpecError("--answers holds the target's answers to the world's prompts; with --data llava-instruct "
                              "drop it")
    else:
        raise MMSpecError(f"unknown --data {data!r}; use world or llava-instruct:FILE.json")
    out = Path(cfg.out)
    check_out(out)
    if cfg.resume:
        if (out / "checkpoint" / "train_state.pt").is_file() and not (out / CHECKPOINT).is_file():
            raise MMSpecError(f"{out / 'checkpoint'} is a checkpoint of an older mmspec, which this one cannot resume; "
                              "add --fresh to start over (the head saved in --out stays usable meanwhile)")
        read_checkpoint(out / CHECKPOINT, head_settings(cfg), cfg.steps, cfg.minutes, "head training")  # the
        # checkpoint's variant may be another than --variant: its own is named among the settings that differ
