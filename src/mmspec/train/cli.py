"""``mmspec train``: a typer sub-app that only maps flags onto the typed configs.

Commands: ``embedded`` (the whole pack, see :mod:`mmspec.train.pack`), ``stage`` (one stage
of the recipe on one model directory, or on a fresh model of a size preset), ``grow`` (more LM
layers, same function; :mod:`mmspec.train.grow`), ``read`` (reading pre-training of the vision
tower; :mod:`mmspec.train.reading`), ``copy`` (copy practice for the LM,
:func:`mmspec.train.data.copy_examples`), ``evaluate`` (the pack's quality from a benchmark run),
``facts`` (a model's fact recall without one, in the multimodal or caption view), ``probe``
(can the vision tower's features be read linearly; :mod:`mmspec.train.probe`) and ``answers``
(a target's own greedy answers for draft distillation; :mod:`mmspec.train.distill`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mmspec.bench.datasets import SINGLE_IMAGE  # the fact-recall goal's families; `facts` defaults to them

train_app = typer.Typer(help="Train the embedded target / draft / captioner on the synthetic world.",
                        no_args_is_help=True)

# options that several commands share, declared once
_STEPS = typer.Option(None, help="optimiser steps (default: 1000, or as many as --minutes allow when it is given)")
_MINUTES = typer.Option(None, help="wall-clock cap; the schedule then follows time")
_BF16 = typer.Option(True, help="bf16 autocast")
_HALF = typer.Option(False, help="save fp16 safetensors")


def _default_steps(steps: Optional[int], minutes: Optional[float]) -> Optional[int]:
    """--steps as given; unset, 1000 without --minutes and None (the clock decides) with it."""
    return steps if steps is not None or minutes is not None else 1000


def _require_model_dir(path: Path, option: str) -> None:
    if not (path / "config.json").exists():
        raise typer.BadParameter(f"{path} is not an HF LLaVA model directory (no config.json)", param_hint=option)


@train_app.command("embedded")
def embedded(
    out: Path = typer.Option(None, help="output dir (default: the package assets/embedded)"),
    minutes_budget: Optional[float] = typer.Option(None, help="wall-clock budget; stages get shares of it"),
    steps_scale: float = typer.Option(1.0, help="multiply every stage's step count (no budget)"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:1, ..."),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None, help="torch.set_num_threads"),
    n_train_per_family: int = typer.Option(1500, help="training samples per task family"),
    bf16: bool = typer.Option(False, help="bf16 autocast"),
    quiet: bool = typer.Option(False, help="no progress bars"),
) -> None:
    """Reproduce the whole pack: tokenizer -> target 0/1/2 -> draft 1/2 -> pooled draft -> captioner."""
    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError
    from mmspec.train.config import RecipeConfig
    from mmspec.train.pack import run_pack, with_budget

    recipe = RecipeConfig(seed=seed, device=device, threads=threads, autocast_bf16=bf16,
                          n_train_per_family=n_train_per_family).scaled(steps_scale)
    if minutes_budget is not None:
        try:
            with_budget(recipe, minutes_budget)  # the stages' schedules refuse a budget <= 0 here, before any work
        except MMSpecError as exc:
            raise typer.BadParameter(str(exc), param_hint="--minutes-budget") from exc
    run_pack(recipe, out or default_path(), minutes_budget=minutes_budget, progress=not quiet)


@train_app.command("stage")
def stage(
    out: Path = typer.Option(..., help="where to save the trained model (HF dir)"),
    init: Optional[Path] = typer.Option(None, help="start from this HF LLaVA dir"),
    size: str = typer.Option("draft", help="size preset for a fresh model when no --init"),
    vision_from: Optional[Path] = typer.Option(None, help="copy this HF LLaVA dir's vision tower"),
    trainable: str = typer.Option("projector+lm", help="all | projector | projector+lm"),
    lr: float = typer.Option(2e-5),
    steps: Optional[int] = _STEPS,
    batch_size: int = typer.Option(16),
    pooled_tokens: Optional[int] = typer.Option(None, help="train with pooling to N tokens/image"),
    captioner: bool = typer.Option(False, help="train on the caption task instead of the QA task"),
    caption_mix: float = typer.Option(0.0, help="QA training: add this many image->caption examples per QA "
                                      "example (fact-dense supervision for the vision tower)"),
    copy_mix: float = typer.Option(0.0, help="QA training: add this many text-only copy / lookup practice "
                                   "examples per QA example (random words: teaches the LM to copy from its context)"),
    copy_member_share: float = typer.Option(0.0, help="share of the --copy-mix practice that are membership "
                                            "questions (`train copy --member-share`); the rest stay half lookups, "
                                            "half repeats"),
    cue_weight: float = typer.Option(1.0, help="QA training: weigh the loss on the sentence that decides an "
                                     "existence answer (the world's cues: \"Looking for a red star: no, there is "
                                     "none.\") this many times"),
    fact_weight: float = typer.Option(1.0, help="QA training: weigh the loss on answer tokens that state the "
                                      "image's facts this many times more than the other answer tokens"),
    text_view_prob: float = typer.Option(0.0, help="show an example through the text view (images -> newline)"),
    caption_view_prob: float = typer.Option(0.0, help="show an example through the caption view"),
    n_train_per_family: int = typer.Option(400),
    family_samples: list[str] = typer.Option([], help="FAMILY=N: train on N samples of this family instead of "
                                             "--n-train-per-family (repeatable; 0 drops the family)"),
    minutes: Optional[float] = typer.Option(None, help="wall-clock cap; the schedule then follows time"),
    bf16: bool = typer.Option(True, help="bf16 autocast"),
    half: bool = typer.Option(False, help="save fp16 safetensors (the embedded pack's format)"),
    evaluate: bool = typer.Option(False, "--eval", help="held-out loss and fact recall after training"),
    device: str = typer.Option("cpu"),
    seed: int = typer.Option(0, help="training seed: initialisation, batch order, view draws, mixed-in practice"),
    world_seed: Optional[int] = typer.Option(None, help="seed of the world's samples (and of a fresh model's "
                                             "tokenizer); default: --seed. Keep it to train again on the same "
                                             "samples, or the same --answers file, with another --seed"),
    threads: Optional[int] = typer.Option(None),
    workers: int = typer.Option(0, help="build training batches in this many worker processes (0: in this one); "
                                "a GPU step outruns one core's tokenising and image preprocessing"),
    answers: Optional[Path] = typer.Option(None, help="train on a target's own greedy answers (a JSONL file from "
                                           "`mmspec train answers`, same world seed and sample counts) instead of the "
                                           "world's reference answers: draft distillation"),
) -> None:
    """One stage of the LLaVA recipe (stage 1: --trainable projector, stage 2: projector+lm).

    Starting from --init, the new stage is appended to the init dir's mmspec.json history.
    """
    import math

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.errors import MMSpecError
    from mmspec.train.checkpoint import read_sidecar, save_checkpoint
    from mmspec.train.config import RecipeConfig, StageConfig, build_llava, model_size
    from mmspec.train.data import (CAPTIONER_PROMPT, Encoder, batch_stream, caption_examples, copy_examples,
                                   example_from_sample, mix_in_captions)
    from mmspec.train.pack import _samples, world_tokenizer_and_processor
    from mmspec.train.recipe import train_stage

    if not (math.isfinite(copy_mix) and copy_mix >= 0):
        raise typer.BadParameter(f"--copy-mix must be a finite number >= 0; got {copy_mix}")
    if not 0 <= copy_member_share <= 1:
        raise typer.BadParameter(f"--copy-member-share must be in [0, 1]; got {copy_member_share}")
    if copy_member_share > 0 and copy_mix == 0:
        raise typer.BadParameter("--copy-member-share is a share of the --copy-mix practice; give --copy-mix too")
    if workers < 0:
        raise typer.BadParameter(f"--workers must be >= 0 (0 builds batches in this process); got {workers}")
    if init is not None and vision_from is not None:
        raise typer.BadParameter("--vision-from builds a new model on another's tower; --init continues a model "
                                 "with its own tower: give one of them")
    if captioner and copy_mix > 0:
        raise typer.BadParameter("--copy-mix adds QA-style practice and would change the captioner's task; drop one")
    if answers is not None and captioner:
        raise typer.BadParameter("--answers replaces QA answers and would do nothing with --captioner; drop one")
    if answers is not None and not answers.is_file():
        raise typer.BadParameter(f"{answers} is not a file; make it with `mmspec train answers`",
                                 param_hint="--answers")
    if caption_mix < 0 or not (0 <= text_view_prob <= 1 and 0 <= caption_view_prob <= 1) \
            or text_view_prob + caption_view_prob > 1:
        raise typer.BadParameter(
            f"--caption-mix must be >= 0 and the view probabilities in [0, 1] with a sum <= 1; got "
            f"caption_mix={caption_mix}, text_view_prob={text_view_prob}, caption_view_prob={caption_view_prob}")
    for flag, weight in (("--fact-weight", fact_weight), ("--cue-weight", cue_weight)):
        if not (math.isfinite(weight) and weight > 0):
            raise typer.BadParameter(f"{flag} must be a finite number > 0 (1 weighs every answer token alike); "
                                     f"got {weight}")
        if captioner and weight != 1.0:
            raise typer.BadParameter(f"{flag} weighs QA answers and would do nothing with --captioner; drop one")
    try:
        cfg = StageConfig(f"stage-{trainable}", trainable, lr=lr, steps=_default_steps(steps, minutes),
                          batch_size=batch_size, pooled_tokens=pooled_tokens,
                          max_seconds=None if minutes is None else 60.0 * minutes)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    per_family = _parse_family_samples(family_samples, n_train_per_family)
    world_seed = seed if world_seed is None else world_seed
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    # The token ids come from the model this one continues or borrows its tower from (a draft must
    # share its target's vocabulary), whatever the seeds; only a model from nothing gets a fresh tokenizer.
    source = init if init is not None else vision_from
    if source is not None:
        _require_model_dir(source, "--init" if init is not None else "--vision-from")
        processor = AutoProcessor.from_pretrained(source)
        tokenizer = processor.tokenizer
    else:
        tokenizer, processor = world_tokenizer_and_processor(world_seed)
    if init is not None:
        model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    else:
        tower = None
        if vision_from is not None:
            tower = LlavaForConditionalGeneration.from_pretrained(vision_from, dtype=torch.float32).model.vision_tower
        model = build_llava(model_size(size), tokenizer, vision_tower=tower)
    samples = _samples("train", per_family, world_seed)
    examples = ([ex for s in samples for ex in caption_examples(s)] if captioner
                else [example_from_sample(s) for s in samples])
    answers_meta = {}
    if answers is not None:
        from mmspec.train.distill import answer_source, read_answers, tokenizer_fingerprint, with_answers

        try:
            got = read_answers(answers, prompts={s.uid: s.prompt for s in samples}, seed=world_seed,
                               tokenizer=tokenizer_fingerprint(tokenizer))
            examples = with_answers(examples, samples, got)
        except MMSpecError as exc:
            raise typer.BadParameter(str(exc), param_hint="--answers") from exc
        answers_meta = {"answers": {"file": answers.name, "rows": len(got), **answer_source(answers).__dict__}}
    if caption_mix > 0 and not captioner:
        examples += mix_in_captions(samples, caption_mix, seed)
    if copy_mix > 0:
        examples += copy_examples(tokenizer, round(copy_mix * len(samples)), seed,
                                  lookup_share=0.5 * (1 - copy_member_share), member_share=copy_member_share)
    encoder = Encoder(tokenizer, max_answer_tokens=RecipeConfig.max_answer_tokens, fact_weight=fact_weight,
                      cue_weight=cue_weight)
    try:
        stream = batch_stream(examples, encoder, processor.image_processor, batch_size,
                              torch.Generator().manual_seed(seed), tokens_per_image=pooled_tokens or 64,
                              text_view_prob=text_view_prob, caption_view_prob=caption_view_prob, workers=workers)
    except MMSpecError as exc:  # e.g. more workers than examples
        raise typer.BadParameter(str(exc)) from exc
    res = train_stage(model, cfg, stream, device, autocast_bf16=bf16)
    meta = read_sidecar(init) if init is not None else {"role": "captioner" if captioner else "stage"}
    meta["stages"] = [*meta.get("stages", []), {**res.summary(), "lr": lr, "trainable": trainable,
                                                 "caption_mix": caption_mix, "copy_mix": copy_mix,
                                                 "copy_member_share": copy_member_share,
                                                 "fact_weight": fact_weight, "cue_weight": cue_weight,
                                                 "workers": workers,
                                                 "text_view_prob": text_view_prob,
                                                 "caption_view_prob": caption_view_prob,
                                                 "n_train_per_family": n_train_per_family,
                                                 **({"family_samples": per_family} if family_samples else {}),
                                                 "seed": seed, "world_seed": world_seed, **answers_meta}]
    if captioner:
        meta["captioner_prompt"] = CAPTIONER_PROMPT
    if pooled_tokens:
        meta["pooled_tokens"] = pooled_tokens
    if evaluate:
        from mmspec.train.pack import _Run

        run = _Run(RecipeConfig(device=device), out, typer.echo, progress=False)
        run.tokenizer, run.processor, run.encoder = tokenizer, processor, encoder
        val = _samples("val", 4, world_seed)
        val_ex = [ex for s in val for ex in caption_examples(s)][:64] if captioner else [example_from_sample(s) for s in val]
        meta["eval"] = run.evaluate(meta.get("role", "stage"), model, val_ex, [] if captioner else val,
                                    tokens_per_image=pooled_tokens or 64, facts=not captioner)
    save_checkpoint(model, out, processor=processor, half=half, meta=meta)
    typer.echo(f"{res.summary()} -> {out}")


@train_app.command("answers")
def answers_cmd(
    out: Path = typer.Option(..., help="JSONL file to write (appended to: a rerun resumes, skipping samples "
                             "already answered)"),
    target: Optional[Path] = typer.Option(None, help="HF LLaVA dir (default: the shipped target)"),
    n_train_per_family: int = typer.Option(400, help="train-split samples per family"),
    family_samples: list[str] = typer.Option([], help="FAMILY=N: N samples of this family instead of "
                                             "--n-train-per-family (repeatable; as `train stage` takes it)"),
    seed: int = typer.Option(0, help="world seed of the samples: the draft stage's --world-seed (default: its --seed)"),
    max_new_tokens: Optional[int] = typer.Option(None, help="longest answer (default: the answer length the "
                                                 "stages train on, RecipeConfig.max_answer_tokens = 96)"),
    batch_size: int = typer.Option(32, help="prompts per generate call (prompts of one token length each)"),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None),
    quiet: bool = typer.Option(False, help="no progress bar"),
) -> None:
    """The target's own greedy answers to training samples, for training a draft on them
    (`mmspec train stage --answers FILE`): draft distillation."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError
    from mmspec.train.config import RecipeConfig
    from mmspec.train.distill import AnswerSource, generate_answers, target_fingerprint, tokenizer_fingerprint
    from mmspec.train.pack import _samples

    max_new_tokens = RecipeConfig.max_answer_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens < 1:
        raise typer.BadParameter(f"need at least 1 new token; got {max_new_tokens}", param_hint="--max-new-tokens")
    if batch_size < 1:
        raise typer.BadParameter(f"need at least 1 prompt per batch; got {batch_size}", param_hint="--batch-size")
    if not out.parent.is_dir():
        raise typer.BadParameter(f"{out.parent} does not exist; create it or write elsewhere", param_hint="--out")
    path = target or default_path() / "target"
    _require_model_dir(path, "--target")
    per_family = _parse_family_samples(family_samples, n_train_per_family)
    if threads:
        torch.set_num_threads(threads)
    llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().to(device)
    processor = AutoProcessor.from_pretrained(path)
    source = AnswerSource(target_fingerprint(path), tokenizer_fingerprint(processor.tokenizer), seed, max_new_tokens)
    try:
        counts = generate_answers(llava, processor, _samples("train", per_family, seed), out, source,
                                  batch_size=batch_size, device=device, progress=not quiet)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc), param_hint="--out") from exc
    typer.echo(f"{counts['written']} answers written, {counts['already_there']} already there "
               f"(target {source.target}, seed {seed}) -> {out}")


def _parse_family_samples(specs: list[str], default: int) -> dict[str, int]:
    """``["chartqa=4000", ...]`` -> training samples per family (every family; ``default`` unless named)."""
    from mmspec.world import FAMILIES

    counts = {name: default for name in FAMILIES}
    for spec in specs:
        name, sep, n = spec.partition("=")
        if not sep or name not in FAMILIES or not n.isdigit():
            raise typer.BadParameter(f"{spec!r} is not FAMILY=N with FAMILY one of {', '.join(FAMILIES)} and N >= 0",
                                     param_hint="--family-samples")
        counts[name] = int(n)
    if not any(counts.values()):
        raise typer.BadParameter("every family has 0 samples; nothing to train on", param_hint="--family-samples")
    return counts


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
    """Reading pre-training of the vision tower (`mmspec.train.reading`): learn to predict the tokens
    of each image's caption from single patch features (--objective bag), or to match each image
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
    lookup_share: float = typer.Option(0.5, help="share of lookup examples (the shares not given to lookups, lists "
                                       "or membership questions repeat their words)"),
    list_share: float = typer.Option(0.0, help="share of list examples (key-value pairs with a filler word "
                                     "between, listed in order: a chart caption's layout)"),
    member_share: float = typer.Option(0.0, help="share of membership questions (is this pair of words in the "
                                       "list? half are near misses: a hallucination question's decision); the "
                                       "shares are absolute: lower --lookup-share to make room"),
    minutes: Optional[float] = _MINUTES,
    bf16: bool = _BF16,
    half: bool = _HALF,
    device: str = typer.Option("cpu"),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None),
) -> None:
    """Copy practice for the LM: text-only examples that repeat, look up, list, or check the presence
    of, random vocabulary words from the prompt (`mmspec.train.data.copy_examples`). Only the LM
    changes (no image is seen, so the projector gets no gradient). Prints the held-out share of
    weighted answer tokens predicted right, overall and by kind (member: the verdict); follow
    with a world stage, which can keep mixing the practice in (`stage --copy-mix`)."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.errors import MMSpecError
    from mmspec.train.checkpoint import read_sidecar, save_checkpoint
    from mmspec.train.config import StageConfig
    from mmspec.train.data import Encoder, batch_stream, copy_examples, fixed_batches, word_pool
    from mmspec.train.recipe import token_accuracy, train_stage

    try:
        cfg = StageConfig("copy-practice", "projector+lm", lr=lr, steps=_default_steps(steps, minutes),
                          batch_size=batch_size, max_seconds=None if minutes is None else 60.0 * minutes)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if n_examples < 1:
        raise typer.BadParameter(f"--n-examples must be >= 1; got {n_examples}")
    shares = (lookup_share, list_share, member_share)
    if not (min(shares) >= 0 and sum(shares) <= 1):
        raise typer.BadParameter(f"--lookup-share, --list-share and --member-share must be >= 0 with a sum <= 1; "
                                 f"got {lookup_share}, {list_share} and {member_share}")
    _require_model_dir(init, "--init")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(init)
    tokenizer = processor.tokenizer
    try:
        pool = word_pool(tokenizer)
        train_ex = copy_examples(tokenizer, n_examples, seed, lookup_share=lookup_share, pool=pool,
                                 list_share=list_share, member_share=member_share)
        held_out = copy_examples(tokenizer, 128, seed + 1, lookup_share=lookup_share, pool=pool,
                                 list_share=list_share, member_share=member_share)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32).to(device)
    stream = batch_stream(train_ex, Encoder(tokenizer), processor.image_processor, batch_size,
                          torch.Generator().manual_seed(seed))
    scorer = Encoder(tokenizer, fact_weight=2.0)  # weights mark the copied words (each example's facts)
    val = fixed_batches(held_out, scorer, processor.image_processor, batch_size=32)
    kinds = sorted({ex.family for ex in held_out})
    by_kind = {k: fixed_batches([ex for ex in held_out if ex.family == k], scorer, processor.image_processor,
                                batch_size=32) for k in kinds}
    before = token_accuracy(model, val, device, facts_only=True)
    before_kind = {k: token_accuracy(model, b, device, facts_only=True) for k, b in by_kind.items()}
    res = train_stage(model, cfg, stream, device, autocast_bf16=bf16)
    after = token_accuracy(model, val, device, facts_only=True)
    after_kind = {k: token_accuracy(model, b, device, facts_only=True) for k, b in by_kind.items()}
    meta = read_sidecar(init)
    meta["stages"] = [*meta.get("stages", []), {**res.summary(), "lr": lr, "trainable": cfg.trainable,
                                                 "objective": "copy practice", "n_examples": n_examples,
                                                 "lookup_share": lookup_share, "list_share": list_share,
                                                 "member_share": member_share,
                                                 "held_out_copy_accuracy": {"before": before, "after": after},
                                                 "held_out_accuracy_by_kind": {
                                                     k: {"before": before_kind[k], "after": after_kind[k]}
                                                     for k in kinds}}]
    meta.pop("eval", None)  # world figures are measured after the next world stage
    save_checkpoint(model, out, processor=processor, half=half, meta=meta)
    typer.echo(f"held-out copy accuracy (weighted answer tokens right, teacher-forced, {len(held_out)} examples): "
               f"{before:.1%} -> {after:.1%}")
    for k in kinds:  # member: the verdict (chance 50%); copy / lookup / list: the copied words
        typer.echo(f"  {k}: {before_kind[k]:.1%} -> {after_kind[k]:.1%}")
    typer.echo(f"{res.summary()} -> {out}")


@train_app.command("grow")
def grow(
    init: Path = typer.Option(..., help="the HF LLaVA dir to grow"),
    layers: int = typer.Option(..., help="number of LM decoder layers after growing"),
    out: Path = typer.Option(..., help="where to save the grown model (HF dir)"),
    half: bool = typer.Option(False, help="save fp16 safetensors"),
) -> None:
    """Grow the LM to --layers decoder layers (depth up-scaling); the grown model computes exactly
    what --init computes until it is trained further with `mmspec train stage --init OUT`."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.train.checkpoint import read_sidecar, save_checkpoint
    from mmspec.train.config import param_report
    from mmspec.train.grow import grow_lm_depth

    model = LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    before = model.config.text_config.num_hidden_layers
    try:
        grown = grow_lm_depth(model, layers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--layers") from exc
    meta = read_sidecar(init)
    meta["params"] = param_report(grown)
    meta["stages"] = [*meta.get("stages", []), {"name": "grow-lm-depth", "from_layers": before, "to_layers": layers}]
    meta.pop("eval", None)  # the grown model's figures are measured after its next stage
    save_checkpoint(grown, out, processor=AutoProcessor.from_pretrained(init), half=half, meta=meta)
    typer.echo(f"LM {before} -> {layers} layers, {meta['params']['total'] / 1e6:.2f}M parameters -> {out}")


@train_app.command("evaluate")
def evaluate_cmd(
    results: Path = typer.Option(..., help="a `mmspec bench run` results dir on the embedded world"),
    captions_per_family: int = typer.Option(50, help="test samples per family for the caption check (0: skip)"),
    out: Optional[Path] = typer.Option(None, help="write the figures as JSON here"),
) -> None:
    """Quality of the embedded pack on the test split: fact recall of the target's answers,
    the captioner's fact rate, and multimodal vs text-only block efficiency."""
    import json

    from mmspec.train.evaluate import answer_fact_recall, caption_fact_rate, view_block_efficiency

    report: dict = {"answer_fact_recall": answer_fact_recall(results),
                    "block_efficiency_M_vs_T": view_block_efficiency(results)}
    if captions_per_family > 0:
        from mmspec.embedded import load_embedded

        pack = load_embedded()
        cap = pack.captioner()
        report["caption_fact_rate"] = caption_fact_rate(cap, captions_per_family)
    def tau_and_captions(family: str) -> str:
        tau = report["block_efficiency_M_vs_T"].get(family, {})
        cap_rate = report.get("caption_fact_rate", {}).get(family, {}).get("rate")
        return (f"  tau M {tau.get('M', float('nan')):.2f}  T {tau.get('T', float('nan')):.2f}"
                + (f"  captions {cap_rate:.1%}" if cap_rate is not None else ""))

    _echo_fact_table(report["answer_fact_recall"], tau_and_captions)
    if out is not None:
        out.write_text(json.dumps(report, indent=2))


@train_app.command("facts")
def facts_cmd(
    model: Optional[Path] = typer.Option(None, help="HF LLaVA dir (default: the shipped target)"),
    n: int = typer.Option(100, help="test samples per family (the split's first N, as the benchmark takes them)"),
    family: list[str] = typer.Option(list(SINGLE_IMAGE), help="world family (repeatable)"),
    view: str = typer.Option("multimodal", help="multimodal | caption (each image replaced by its "
                             "ground-truth caption: can the LM copy the facts from text?)"),
    max_new_tokens: int = typer.Option(128),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None),
    out: Optional[Path] = typer.Option(None, help="write the figures as JSON here"),
) -> None:
    """Fact recall of a target's greedy answers on the test split, per family and kind of fact,
    without a benchmark run. The caption view separates the LM from the vision tower."""
    import json

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path
    from mmspec.train.checkpoint import read_sidecar
    from mmspec.train.data import Encoder
    from mmspec.train.evaluate import model_fact_recall
    from mmspec.world import FAMILIES

    if n < 1:
        raise typer.BadParameter("need at least 1 sample per family", param_hint="--n")
    if max_new_tokens < 1:
        raise typer.BadParameter(f"need at least 1 new token; got {max_new_tokens}", param_hint="--max-new-tokens")
    if view not in ("multimodal", "caption"):
        raise typer.BadParameter(f"unknown view {view!r}; use multimodal or caption", param_hint="--view")
    unknown = [f for f in family if f not in FAMILIES]
    if unknown:
        raise typer.BadParameter(f"unknown world famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                                 f"choose from {', '.join(FAMILIES)}", param_hint="--family")
    if out is not None and not out.parent.is_dir():
        raise typer.BadParameter(f"{out.parent} does not exist; create it or write elsewhere", param_hint="--out")
    path = model or default_path() / "target"
    _require_model_dir(path, "--model")
    if threads:
        torch.set_num_threads(threads)
    families = list(dict.fromkeys(family))
    tokens_per_image = read_sidecar(path).get("pooled_tokens") or 64  # a pooled draft reads N tokens per image
    llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().to(device)
    processor = AutoProcessor.from_pretrained(path)
    report = model_fact_recall(llava, Encoder(processor.tokenizer), processor.image_processor, families, n,
                               view=view, max_new_tokens=max_new_tokens, device=device,
                               tokens_per_image=tokens_per_image)
    typer.echo(f"{path}: fact recall, {view} view, first {n} test samples per family, greedy")
    _echo_fact_table(report)
    if out is not None:
        out.write_text(json.dumps({"model": str(path), "view": view, "n_per_family": n,
                                   "tokens_per_image": tokens_per_image, "families": report}, indent=2))


def _echo_fact_table(report: dict, extra=None) -> None:
    """One line per family (recall, facts, ``extra(family)``), then by kind of fact and verdicts."""
    for fam, r in report.items():
        typer.echo(f"{fam:15s} facts {r['recall']:.1%} of {r['facts']}" + (extra(fam) if extra else ""))
        typer.echo("                " + ", ".join(f"{k} {v['recall']:.0%}" for k, v in r["by_fact"].items()))
        for truth, said in r.get("verdicts", {}).items():
            typer.echo(f"                {sum(said.values())} {truth}-questions end on: "
                       + ", ".join(f"{k} {c}" for k, c in said.items()))


@train_app.command("probe")
def probe_cmd(
    model: Optional[Path] = typer.Option(None, help="HF LLaVA dir (default: the shipped target)"),
    n_train: int = typer.Option(3000, help="train-split images per probe"),
    n_test: int = typer.Option(500, help="test-split images per probe"),
    threads: Optional[int] = typer.Option(None),
    out: Optional[Path] = typer.Option(None, help="write the accuracies as JSON here"),
) -> None:
    """Linear probes on the vision tower's patch features (sign word, chart label, chart value):
    a fact the probe reads but the target's answers miss is lost in the LM, not in the tower."""
    import json

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.embedded import default_path
    from mmspec.train.probe import vision_probes

    if n_train < 2 or n_test < 1:
        raise typer.BadParameter("need --n-train >= 2 and --n-test >= 1")
    if threads:
        torch.set_num_threads(threads)
    path = model or default_path() / "target"
    _require_model_dir(path, "--model")
    llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    results = vision_probes(llava, AutoProcessor.from_pretrained(path).image_processor, n_train, n_test)
    typer.echo(f"{path}: linear probes on vision features, {n_train} train / {n_test} test images")
    for r in results:
        typer.echo(f"  {r.name:12s} test {r.test_acc:6.1%}  (train {r.train_acc:.1%}, chance {r.chance:.1%})")
    if out is not None:
        out.write_text(json.dumps({r.name: {"test_acc": r.test_acc, "train_acc": r.train_acc,
                                            "n_classes": r.n_classes, "n_train": n_train, "n_test": n_test}
                                   for r in results}, indent=2))
