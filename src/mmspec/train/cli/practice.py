"""``mmspec train read | copy``: practice stages that prepare one part of a model.

``read`` pre-trains the vision tower to read the world's images (:mod:`mmspec.train.reading`);
``copy`` teaches the LM to copy from its context (:func:`mmspec.train.data.copy_examples`).
Both are followed by a world stage (``mmspec train stage``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mmspec.train.cli.app import (_BF16, _HALF, _MINUTES, _STEPS, _default_steps, _parse_family_samples,
                                  _require_model_dir, train_app)


@train_app.command("read")
def read_cmd(
    init: Path = typer.Option(..., help="the HF LLaVA dir whose vision tower learns to read"),
    out: Path = typer.Option(..., help="where to save the model with the new tower (HF dir)"),
    lr: float = typer.Option(3e-4),
    steps: Optional[int] = _STEPS,
    batch_size: int = typer.Option(64, help="images per step"),
    n_train_per_family: int = typer.Option(1500, help="training samples per family, all their images read"),
    family_samples: list[str] = typer.Option([], help="FAMILY=N: read the images of N samples of this family "
                                             "(repeatable; 0 drops the family)"),
    minutes: Optional[float] = _MINUTES,
    eval_images: int = typer.Option(512, help="val-split images for the held-out recall, split evenly over the "
                                    "8 families (0: skip)"),
    bf16: bool = _BF16,
    half: bool = _HALF,
    device: str = typer.Option("cpu"),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None),
    objective: str = typer.Option("bag", help="bag: predict the caption's tokens from single patches; contrastive: "
                                  "pick each image's caption out of the batch (CLIP's objective)"),
    workers: int = typer.Option(0, help="render and preprocess images in this many worker processes (0: in this one)"),
) -> None:
    """Reading pre-training of the vision tower (`mmspec.train.reading`).

    Learn to predict the tokens of each image's caption from single patch features (--objective bag), or to match each image
    with its caption against the rest of the batch (--objective contrastive). Only the tower
    changes; the projector and LM of the result were trained on the old tower, so train a stage
    on it before using it."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.errors import MMSpecError
    from mmspec.train.checkpoint import read_sidecar, save_checkpoint
    from mmspec.train.reading import (ContrastiveHead, ReadingConfig, ReadingHead, caption_retrieval,
                                      image_caption_stream, train_reading, val_images, word_recall)

    try:
        cfg = ReadingConfig(lr=lr, steps=_default_steps(steps, minutes),
                            batch_size=batch_size,
                            max_seconds=None if minutes is None else 60.0 * minutes)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if eval_images < 0:
        raise typer.BadParameter(f"--eval-images must be >= 0; got {eval_images}")
    if n_train_per_family < 0:
        raise typer.BadParameter(f"--n-train-per-family must be >= 0; got {n_train_per_family}")
    heads = {"bag": ReadingHead, "contrastive": ContrastiveHead}
    if objective not in heads:
        raise typer.BadParameter(f"unknown objective {objective!r}; use bag or contrastive", param_hint="--objective")
    if workers < 0:
        raise typer.BadParameter(f"--workers must be >= 0 (0 renders in this process); got {workers}")
    if objective == "contrastive" and batch_size < 2:
        raise typer.BadParameter("--objective contrastive picks each image's caption out of the batch: it needs "
                                 f"--batch-size >= 2 (got {batch_size}); CLIP-style training wants hundreds")
    per_family = _parse_family_samples(family_samples, n_train_per_family)
    _require_model_dir(init, "--init")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(init)  # the init's own tokenizer: only the tower changes
    tokenizer = processor.tokenizer
    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    head = heads[objective].for_model(model, len(tokenizer))
    stream = image_caption_stream("train", per_family, cfg.batch_size, seed, workers=workers,
                                  image_processor=processor.image_processor)
    res = train_reading(model, head, tokenizer, processor.image_processor, stream, cfg, device, autocast_bf16=bf16)
    record = {**res.summary(), "lr": lr, "trainable": "vision",
              "objective": {"bag": "caption bag of words", "contrastive": "image-caption contrastive"}[objective],
              "workers": workers, "n_train_per_family": n_train_per_family,
              **({"family_samples": per_family} if family_samples else {})}
    if eval_images:
        images, captions, families = val_images(eval_images, seed)
        if objective == "bag":
            rec = word_recall(model, head, tokenizer, processor.image_processor, images, captions, families, device)
            record["val_word_recall"] = rec
            what = "held-out caption tokens read (recall at k"
        else:
            rec = caption_retrieval(model, head, tokenizer, processor.image_processor, images, captions, families,
                                    device)
            record["val_caption_retrieval"] = rec
            what = "held-out images matched to their own caption among their family's (top 1"
        typer.echo(f"{what}; {rec['images']} val images, {rec['images'] // len(rec['by_group'])} per family): "
                   f"{rec['recall']:.1%}; " + ", ".join(f"{f} {r:.0%}" for f, r in rec["by_group"].items()))
    meta = read_sidecar(init)
    meta["stages"] = [*meta.get("stages", []), record]
    meta.pop("eval", None)  # the LM's figures were measured on the old tower
    save_checkpoint(model, out, processor=processor, half=half, meta=meta)
    typer.echo(f"{res.summary()} -> {out}\nThe projector and LM were trained on the old tower: train a stage "
               f"on {out} (`mmspec train stage --init {out}`) before using it.")


@train_app.command("copy")
def copy_cmd(
    init: Path = typer.Option(..., help="the HF LLaVA dir whose LM practises copying"),
    out: Path = typer.Option(..., help="where to save the result (HF dir)"),
    lr: float = typer.Option(5e-4),
    steps: Optional[int] = _STEPS,
    batch_size: int = typer.Option(32),
    n_examples: int = typer.Option(50000, help="distinct practice examples (the stream cycles through them)"),
    lookup_share: float = typer.Option(0.5, help="share of lookup examples (the shares not given to lookups, lists, "
                                       "membership questions or readings repeat their words)"),
    list_share: float = typer.Option(0.0, help="share of list examples (key-value pairs with a filler word "
                                     "between, listed in order: a chart caption's layout)"),
    member_share: float = typer.Option(0.0, help="share of membership questions (is this pair of words in the "
                                       "list? half are near misses: a hallucination question's decision); the "
                                       "shares are absolute: lower --lookup-share to make room"),
    reading_share: float = typer.Option(0.0, help="share of world lookup questions with the image taken away, in "
                                        "the world's answer form: the reading stands only in the answer and the "
                                        "last value is looked up in it (it was learned with --schedule constant)"),
    reading_scenes: float = typer.Option(0.5, help="share of the reading examples that are vqav2 scene lookups "
                                         "(the rest look a chart's value up)"),
    reading_scene_kind: Optional[list[str]] = typer.Option(None, help="only these vqav2 lookup kinds in the "
                                                           "scene readings (repeat; colour_of, position, "
                                                           "shape_at; default all three)"),
    schedule: str = typer.Option("cosine", help="learning rate after the warm-up: cosine (decay to 0) or constant"),
    minutes: Optional[float] = _MINUTES,
    bf16: bool = _BF16,
    half: bool = _HALF,
    device: str = typer.Option("cpu"),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None),
) -> None:
    """Copy practice for the LM (`mmspec.train.data.copy_examples`).

    Text-only examples that repeat, look up, list, or check the presence of, random vocabulary
    words from the prompt, or look a value up in a world answer's own reading (--reading-share). Only the LM
    changes (no image is seen, so the projector gets no gradient). Prints the held-out share of
    weighted answer tokens predicted right, overall and by kind (member: the verdict; reading:
    the looked-up value, all its tokens); follow
    with a world stage, which can keep mixing the practice in (`stage --copy-mix`)."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.errors import MMSpecError
    from mmspec.train.checkpoint import read_sidecar, save_checkpoint
    from mmspec.train.config import StageConfig
    from mmspec.train.data import (Encoder, batch_stream, copy_examples, fixed_batches, scene_kinds_checked,
                                   word_pool)
    from mmspec.train.recipe import final_value_accuracy, token_accuracy, train_stage

    try:
        cfg = StageConfig("copy-practice", "projector+lm", lr=lr, steps=_default_steps(steps, minutes),
                          batch_size=batch_size, max_seconds=None if minutes is None else 60.0 * minutes,
                          schedule=schedule)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if n_examples < 1:
        raise typer.BadParameter(f"--n-examples must be >= 1; got {n_examples}")
    shares = (lookup_share, list_share, member_share, reading_share)
    if not (min(shares) >= 0 and sum(shares) <= 1):
        raise typer.BadParameter(f"--lookup-share, --list-share, --member-share and --reading-share must be >= 0 "
                                 f"with a sum <= 1; got {lookup_share}, {list_share}, {member_share} and "
                                 f"{reading_share}")
    if not 0 <= reading_scenes <= 1:
        raise typer.BadParameter(f"--reading-scenes is a share of the reading examples, 0 to 1; got {reading_scenes}")
    scene_kinds: list[str] = []
    if reading_scene_kind:
        try:
            scene_kinds = list(scene_kinds_checked(reading_scene_kind))  # repeats dropped, order kept
        except MMSpecError as exc:
            raise typer.BadParameter(str(exc), param_hint="--reading-scene-kind") from exc
        if not (reading_share > 0 and reading_scenes > 0):
            raise typer.BadParameter("narrows the scene readings, so it needs --reading-share > 0 and "
                                     "--reading-scenes > 0", param_hint="--reading-scene-kind")
    _require_model_dir(init, "--init")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(init)
    tokenizer = processor.tokenizer
    try:
        pool = word_pool(tokenizer)
        train_ex = copy_examples(tokenizer, n_examples, seed, lookup_share=lookup_share, pool=pool,
                                 list_share=list_share, member_share=member_share, reading_share=reading_share,
                                 reading_scenes=reading_scenes, scene_kinds=scene_kinds or None)
        held_out = copy_examples(tokenizer, 128, seed + 1, lookup_share=lookup_share, pool=pool,
                                 list_share=list_share, member_share=member_share, reading_share=reading_share,
                                 reading_scenes=reading_scenes, scene_kinds=scene_kinds or None)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32).to(device)
    stream = batch_stream(train_ex, Encoder(tokenizer), processor.image_processor, batch_size,
                          torch.Generator().manual_seed(seed))
    scorer = Encoder(tokenizer, fact_weight=2.0)  # weights mark the copied words (each example's facts)
    # the overall figure leaves reading out: its value also stands, at random, in the reading
    copying = [ex for ex in held_out if ex.family != "reading"]
    val = fixed_batches(copying, scorer, processor.image_processor, batch_size=32)
    kinds = sorted({ex.family for ex in held_out})
    # a reading's value also stands, at random, in the reading before it: the lookup alone is scored
    # (final_value_accuracy), so the reading kind needs no token batches
    by_kind = {k: fixed_batches([ex for ex in held_out if ex.family == k], scorer, processor.image_processor,
                                batch_size=32) for k in kinds if k != "reading"}
    reading = [ex for ex in held_out if ex.family == "reading"]

    def by_kind_accuracy() -> dict[str, float]:
        return {k: (final_value_accuracy(model, scorer, processor.image_processor, reading, device)
                    if k == "reading" else token_accuracy(model, by_kind[k], device, facts_only=True))
                for k in kinds}

    before = token_accuracy(model, val, device, facts_only=True) if copying else None
    before_kind = by_kind_accuracy()
    res = train_stage(model, cfg, stream, device, autocast_bf16=bf16)
    after = token_accuracy(model, val, device, facts_only=True) if copying else None
    after_kind = by_kind_accuracy()
    meta = read_sidecar(init)
    meta["stages"] = [*meta.get("stages", []), {**res.summary(), "lr": lr, "schedule": schedule,
                                                 "trainable": cfg.trainable,
                                                 "objective": "copy practice", "n_examples": n_examples,
                                                 "lookup_share": lookup_share, "list_share": list_share,
                                                 "member_share": member_share, "reading_share": reading_share,
                                                 **({"reading_scenes": reading_scenes} if reading_share else {}),
                                                 **({"reading_scene_kinds": scene_kinds} if scene_kinds else {}),
                                                 "seed": seed,
                                                 **({"held_out_copy_accuracy": {"before": before, "after": after}}
                                                    if copying else {}),
                                                 "held_out_accuracy_by_kind": {
                                                     k: {"before": before_kind[k], "after": after_kind[k]}
                                                     for k in kinds}}]
    meta.pop("eval", None)  # world figures are measured after the next world stage
    save_checkpoint(model, out, processor=processor, half=half, meta=meta)
    if copying:
        typer.echo(f"held-out copy accuracy (weighted answer tokens right, teacher-forced, {len(copying)} examples "
                   f"besides reading): {before:.1%} -> {after:.1%}")
    typer.echo(f"by kind ({len(held_out)} held-out examples):")
    for k in kinds:  # member: the verdict (chance 50%); reading: the looked-up value; copy / lookup / list: the words
        typer.echo(f"  {k}: {before_kind[k]:.1%} -> {after_kind[k]:.1%}")
    typer.echo(f"{res.summary()} -> {out}")
