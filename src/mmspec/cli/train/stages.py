"""``mmspec train embedded | stage | answers``: the commands that make and change models.

``embedded`` makes the whole pack (:mod:`mmspec.train.pack`); ``stage`` runs one stage of the
recipe on one model directory, or on a fresh model of a size preset; ``answers`` writes a
target's own greedy answers for draft distillation (:mod:`mmspec.train.distill`). Flags only map
onto the typed configs.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mmspec.cli import options
from mmspec.cli.common import set_threads
from mmspec.cli.train.common import (
    BF16,
    MINUTES,
    STEPS,
    check_count,
    check_device,
    check_out,
    check_threads,
    default_steps,
    parse_family_samples,
    require_model_dir,
    training_errors,
)


def embedded(
    out: Path = typer.Option(None, help="output dir (default: the package assets/embedded)"),
    minutes_budget: float | None = typer.Option(None, help="wall-clock budget; stages get shares of it"),
    steps_scale: float = typer.Option(1.0, help="multiply every stage's step count (no budget)"),
    device: str = options.device(),
    seed: int = typer.Option(0),
    threads: int | None = options.THREADS,
    n_train_per_family: int = typer.Option(1500, help="training samples per task family"),
    bf16: bool = typer.Option(False, help="bf16 autocast (faster on a CPU with AVX512-BF16, and on a GPU)"),
    distill_per_family: int = typer.Option(200, help="train the draft's stage 2 and the pooled draft on the "
                                           "target's own greedy answers to this many train samples per family "
                                           "(0: on the world's reference answers)"),
    quiet: bool = typer.Option(False, help="no progress bars"),
    fresh: bool = options.FRESH,
) -> None:
    """Make a pack of the shipped shapes from nothing.

    Tokenizer -> target stage 0/1/2 -> the target's answers -> draft 1/2 -> pooled draft -> captioner.
    Ctrl-C keeps each stage's finished steps (OUT/checkpoints/); the same command resumes them."""
    import math

    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError
    from mmspec.train.config import RecipeConfig
    from mmspec.train.pack import run_pack, with_budget

    with training_errors():
        check_threads(threads)
        check_device(device)
        check_count(n_train_per_family, "--n-train-per-family")
        check_count(distill_per_family, "--distill-per-family", 0)
        if not (math.isfinite(steps_scale) and steps_scale > 0):
            raise MMSpecError(f"--steps-scale must be a finite number > 0, got {steps_scale}")
        if minutes_budget is not None and not (math.isfinite(minutes_budget) and minutes_budget > 0):
            raise MMSpecError(f"--minutes-budget must be a finite number > 0 (a time budget), got {minutes_budget}")
        check_out(out or default_path())
    try:
        recipe = RecipeConfig(seed=seed, device=device, threads=threads, autocast_bf16=bf16,
                              n_train_per_family=n_train_per_family,
                              distill_per_family=distill_per_family).scaled(steps_scale)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if minutes_budget is not None:
        try:
            with_budget(recipe, minutes_budget)  # the stages' schedules refuse a budget <= 0 here, before any work
        except MMSpecError as exc:
            raise typer.BadParameter(str(exc), param_hint="--minutes-budget") from exc
    with training_errors():
        run_pack(recipe, out or default_path(), minutes_budget=minutes_budget, progress=not quiet, resume=not fresh)


def stage(
    out: Path = typer.Option(..., help="where to save the trained model (HF dir)"),
    init: Path | None = typer.Option(None, help="start from this HF LLaVA dir"),
    size: str = typer.Option("draft", help="size preset for a fresh model when no --init"),
    vision_from: Path | None = typer.Option(None, help="copy this HF LLaVA dir's vision tower"),
    trainable: str = typer.Option("projector+lm", help="all | projector | projector+lm"),
    lr: float = typer.Option(2e-5),
    steps: int | None = STEPS,
    batch_size: int = typer.Option(16),
    pooled_tokens: int | None = typer.Option(None, help="train with pooling to N tokens/image"),
    captioner: bool = typer.Option(False, help="train on the caption task instead of the QA task"),
    caption_mix: float = typer.Option(0.0, help="QA training: add this many image->caption examples per QA "
                                      "example (fact-dense supervision for the vision tower)"),
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
    minutes: float | None = MINUTES,
    bf16: bool = BF16,
    half: bool = typer.Option(False, help="save fp16 safetensors (the embedded pack's format)"),
    evaluate: bool = typer.Option(False, "--eval", help="held-out loss and fact recall after training"),
    device: str = options.device(),
    seed: int = typer.Option(0, help="training seed: initialisation, batch order, view draws, mixed-in practice"),
    world_seed: int | None = typer.Option(None, help="seed of the world's samples (and of a fresh model's "
                                             "tokenizer); default: --seed. Keep it to train again on the same "
                                             "samples, or the same --answers file, with another --seed"),
    threads: int | None = options.THREADS,
    workers: int = typer.Option(0, help="build training batches in this many worker processes (0: in this one); "
                                "a GPU step outruns one core's tokenising and image preprocessing"),
    answers: Path | None = typer.Option(None, help="train on a target's own greedy answers (a JSONL file from "
                                           "`mmspec train answers`, same world seed and sample counts) instead of the "
                                           "world's reference answers: draft distillation"),
    fresh: bool = options.FRESH,
) -> None:
    """One stage of the LLaVA recipe (stage 1: --trainable projector, stage 2: projector+lm).

    Starting from --init, the new stage is appended to the init dir's mmspec.json history.
    """
    import math
    import shutil

    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.errors import MMSpecError
    from mmspec.models.loading import read_sidecar
    from mmspec.train.checkpoint import save_checkpoint
    from mmspec.train.config import RecipeConfig, StageConfig, build_llava, model_size
    from mmspec.train.data import (
        CAPTIONER_PROMPT,
        Encoder,
        batch_stream,
        caption_examples,
        example_from_sample,
        mix_in_captions,
    )
    from mmspec.train.loop import read_checkpoint
    from mmspec.train.pack import CHECKPOINTS, world_samples, world_tokenizer_and_processor
    from mmspec.train.recipe import stage_settings, train_stage

    if workers < 0:
        raise typer.BadParameter(f"--workers must be >= 0 (0 builds batches in this process); got {workers}")
    if init is not None and vision_from is not None:
        raise typer.BadParameter("--vision-from builds a new model on another's tower; --init continues a model "
                                 "with its own tower: give one of them")
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
        cfg = StageConfig(f"stage-{trainable}", trainable, lr=lr, steps=default_steps(steps, minutes),
                          batch_size=batch_size, pooled_tokens=pooled_tokens,
                          max_seconds=None if minutes is None else 60.0 * minutes)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    per_family = parse_family_samples(family_samples, n_train_per_family)
    world_seed = seed if world_seed is None else world_seed
    ckpt = out / CHECKPOINTS / "stage.pt"
    settings = {"init": str(init) if init else None, "size": None if init else size,
                "vision_from": str(vision_from) if vision_from else None, "captioner": captioner,
                "caption_mix": caption_mix, "cue_weight": cue_weight, "fact_weight": fact_weight,
                "text_view_prob": text_view_prob, "caption_view_prob": caption_view_prob, "family_samples": per_family,
                "seed": seed, "world_seed": world_seed, "bf16": bf16, "workers": workers,
                "answers": str(answers) if answers else None}
    with training_errors():
        check_threads(threads)
        check_device(device)
        check_count(n_train_per_family, "--n-train-per-family", 0)
        if pooled_tokens is not None:
            check_count(pooled_tokens, "--pooled-tokens")
        check_out(out)
        if init is None:
            model_size(size)
        if not fresh:
            read_checkpoint(ckpt, {**stage_settings(cfg), **settings}, cfg.steps, label=f"stage {cfg.name}")
    set_threads(threads)
    torch.manual_seed(seed)
    # The token ids come from the model this one continues or borrows its tower from (a draft must
    # share its target's vocabulary), whatever the seeds; only a model from nothing gets a fresh tokenizer.
    source = init if init is not None else vision_from
    if source is not None:
        require_model_dir(source, "--init" if init is not None else "--vision-from")
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
    samples = world_samples("train", per_family, world_seed)
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
    encoder = Encoder(tokenizer, max_answer_tokens=RecipeConfig.max_answer_tokens, fact_weight=fact_weight,
                      cue_weight=cue_weight)
    try:
        stream = batch_stream(examples, encoder, processor.image_processor, batch_size,
                              torch.Generator().manual_seed(seed), tokens_per_image=pooled_tokens or 64,
                              text_view_prob=text_view_prob, caption_view_prob=caption_view_prob, workers=workers)
    except MMSpecError as exc:  # e.g. more workers than examples
        raise typer.BadParameter(str(exc)) from exc
    with training_errors():
        res = train_stage(model, cfg, stream, device, autocast_bf16=bf16, checkpoint=ckpt, settings=settings,
                          resume=not fresh, log=typer.echo)
    meta = read_sidecar(init) if init is not None else {"role": "captioner" if captioner else "stage"}
    meta["stages"] = [*meta.get("stages", []), {**res.summary(), "lr": lr, "trainable": trainable,
                                                 "caption_mix": caption_mix,
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
        from mmspec.train.pack import PackRun

        run = PackRun(RecipeConfig(device=device), out, typer.echo, progress=False)
        run.tokenizer, run.processor, run.encoder = tokenizer, processor, encoder
        val = world_samples("val", 4, world_seed)
        val_ex = [ex for s in val for ex in caption_examples(s)][:64] if captioner else [example_from_sample(s) for s in val]
        meta["eval"] = run.evaluate(meta.get("role", "stage"), model, val_ex, [] if captioner else val,
                                    tokens_per_image=pooled_tokens or 64, facts=not captioner)
    save_checkpoint(model, out, processor=processor, half=half, meta=meta)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)  # the model is saved: the stage is done
    typer.echo(f"{res.line()} -> {out}")


def answers_cmd(
    out: Path = typer.Option(..., help="JSONL file to write (appended to: a rerun resumes, skipping samples "
                             "already answered)"),
    target: Path | None = typer.Option(None, help="the target model dir (default: the shipped target); with --data "
                                       "any family mmspec decodes"),
    data: str | None = typer.Option(None, help="your conversations instead of the world's samples: "
                                    "sharegpt:FILE.json[l] or llava-instruct:FILE.json; every assistant turn is "
                                    "answered again by the target, written to --out as ShareGPT JSONL for "
                                    "`mmspec train head --data sharegpt:OUT`"),
    media_dir: Path | None = typer.Option(None, help="the folder the conversations' image / video paths are read from"),
    frames: int = typer.Option(8, help="frames read from each video of the conversations"),
    n_train_per_family: int = typer.Option(400, help="train-split samples per family (on a Video-LLaVA target "
                                           "such as `mmspec train video`'s: clips per video family)"),
    family_samples: list[str] = typer.Option([], help="FAMILY=N: N samples of this family instead of "
                                             "--n-train-per-family (repeatable; as `train stage` takes it; a "
                                             "video family on a Video-LLaVA target)"),
    seed: int = typer.Option(0, "--world-seed", "--seed", help="world seed of the samples: the draft stage's "
                             "--world-seed (default: its --seed)"),
    max_new_tokens: int | None = typer.Option(None, help="longest answer (default: the answer length the "
                                                 "stages train on, RecipeConfig.max_answer_tokens = 96)"),
    batch_size: int = typer.Option(32, help="prompts per generate call (prompts of one token length each)"),
    device: str = options.device(),
    threads: int | None = options.THREADS,
    quiet: bool = typer.Option(False, help="no progress bar"),
) -> None:
    """The target's own greedy answers to training samples, for draft distillation.

    Train a draft on them with `mmspec train stage --answers FILE`, a head with `mmspec train head
    --answers FILE`. On a Video-LLaVA target (`mmspec train video`'s) the samples are the world's
    video clips."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration, VideoLlavaForConditionalGeneration

    from mmspec.cli.train.head import is_video_llava
    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError
    from mmspec.train.config import RecipeConfig
    from mmspec.train.distill import (
        AnswerSource,
        generate_answers,
        generate_clip_answers,
        target_fingerprint,
        tokenizer_fingerprint,
    )
    from mmspec.train.pack import world_samples
    from mmspec.world import VIDEO_FAMILIES, make_video_sample

    max_new_tokens = RecipeConfig.max_answer_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens < 1:
        raise typer.BadParameter(f"need at least 1 new token; got {max_new_tokens}", param_hint="--max-new-tokens")
    if batch_size < 1:
        raise typer.BadParameter(f"need at least 1 prompt per batch; got {batch_size}", param_hint="--batch-size")
    if not out.parent.is_dir():
        raise typer.BadParameter(f"{out.parent} does not exist; create it or write elsewhere", param_hint="--out")
    path = target or default_path() / "target"
    require_model_dir(path, "--target")
    if data is not None:
        set_threads(threads)
        conversation_answers(path, data, media_dir, out, max_new_tokens, frames, device)
        return
    video = is_video_llava(path)
    per_family = parse_family_samples(family_samples, n_train_per_family, "answer",
                                      tuple(VIDEO_FAMILIES) if video else None)
    set_threads(threads)
    model_class = VideoLlavaForConditionalGeneration if video else LlavaForConditionalGeneration
    model = model_class.from_pretrained(path, dtype=torch.float32).eval().to(device)
    processor = AutoProcessor.from_pretrained(path)
    source = AnswerSource(target_fingerprint(path), tokenizer_fingerprint(processor.tokenizer), seed, max_new_tokens)
    try:
        if video:  # the world's clips, as `mmspec train video` made the pair read them
            clips = [make_video_sample(f, "train", i, seed) for f, n in per_family.items() for i in range(n)]
            counts = generate_clip_answers(model, processor, clips, out, source, batch_size=batch_size,
                                           device=device, progress=not quiet)
        else:
            counts = generate_answers(model, processor, world_samples("train", per_family, seed), out, source,
                                      batch_size=batch_size, device=device, progress=not quiet)
    except MMSpecError as exc:
        raise typer.BadParameter(str(exc), param_hint="--out") from exc
    typer.echo(f"{counts['written']} answers written, {counts['already_there']} already there "
               f"(target {source.target}, seed {seed}) -> {out}")


def conversation_answers(target: Path, data: str, media_dir: Path | None, out: Path, max_new_tokens: int,
                         frames: int, device: str) -> None:
    """``train answers --data``: the target's own answers to every assistant turn of the user's
    conversations (any family), resumable (:func:`mmspec.train.conversations.regenerate_answers`)."""
    from mmspec.cli.common import fail
    from mmspec.cli.train.head import CONVERSATION_FORMATS
    from mmspec.errors import MMSpecError
    from mmspec.models.base import adapter_for
    from mmspec.models.loading import load_model, load_processor
    from mmspec.train.conversations import regenerate_answers

    try:
        fmt, _, file = data.partition(":")
        if fmt not in CONVERSATION_FORMATS or not file:
            raise MMSpecError(f"unknown --data {data!r}; use sharegpt:FILE.json[l] or llava-instruct:FILE.json")
        if not Path(file).is_file():
            raise MMSpecError(f"--data {data}: {file} not found; give a JSON or JSONL file of conversations")
        if frames < 1:
            raise MMSpecError(f"--frames must be >= 1, got {frames}")
        model = load_model(str(target), dtype="float32" if device == "cpu" else "auto").to(device).eval()
        processor = load_processor(str(target))
        adapter = adapter_for(model)
        types = (adapter.image_token_id, adapter.video_token_id) if "mm_token_type_ids" in adapter.mm_keys else None
        regenerate_answers(model, processor, file, media_dir, out, max_new_tokens=max_new_tokens, n_frames=frames,
                           mm_token_types=types, log=typer.echo)
    except MMSpecError as e:
        fail(e)
