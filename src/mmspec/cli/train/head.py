"""``mmspec train head``: flags onto :class:`~mmspec.train.head.HeadTrainConfig`; the training
sequences come from :func:`~mmspec.train.head.world_sequences` (the embedded world, LLaVA-1.5
targets), :func:`~mmspec.train.head.world_video_sequences` (its video clips, Video-LLaVA targets) or :func:`~mmspec.train.conversations.conversation_sequences` (the user's LLaVA-Instruct
or ShareGPT conversations, any family, through the target's own processor and chat template).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mmspec.cli import options
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

if TYPE_CHECKING:
    from mmspec.train.head import HeadTrainConfig

CONVERSATION_FORMATS = ("llava-instruct", "sharegpt", "conversations")  # --data FORMAT:FILE, read alike
TARGET_FAMILIES = ("llava", "llava_next", "llava_onevision", "video_llava", "qwen2_vl", "qwen2_5_vl")


def head(
    target: Path = typer.Option(..., help="The target model directory (its processor is read from it too)."),
    variant: str = typer.Option("eagle", help="eagle (EAGLE-1/2), eagle3 (low/mid/high features, training-time "
                                "test) or msd (decoupled modality, text-first)."),
    out: Path = typer.Option(..., help="Where the head is saved (and its checkpoint: a rerun resumes)."),
    data: str = typer.Option("world", help="world (the embedded world: LLaVA-1.5 targets, and Video-LLaVA targets "
                             "such as mmspec train video's on its video clips), or your conversations: "
                             "llava-instruct:FILE.json, sharegpt:FILE.json[l] (any family; with --media-dir)."),
    image_dir: Path | None = typer.Option(None, "--media-dir", "--image-dir",
                                          help="The folder the conversations' image / video paths are read from."),
    max_length: int | None = typer.Option(None, help="Conversations longer than this (in tokens, images expanded) "
                                          "are skipped (default: the target's context length)."),
    frames: int = typer.Option(8, help="Frames read from each video of the conversations."),
    draft_vocab: int | None = typer.Option(None, help="eagle3: the draft vocabulary's size, the tokens the "
                                           "training answers use most (default: the target's whole vocabulary)."),
    answers: Path | None = typer.Option(None, help="The target's own greedy answers (mmspec train answers) "
                                           "to the world's training prompts (a Video-LLaVA target's: to its clips)."),
    families: str | None = typer.Option(None, help="World families to train on (default: the eight image "
                                        "families; motion,order, the video ones, for a Video-LLaVA target)."),
    samples: int | None = typer.Option(None, help="Training samples per world family (default 200), or the first "
                                       "N conversations of --data FILE (default: all)."),
    world_seed: int = typer.Option(0, help="World seed of the samples (must match the answers file's)."),
    layers: int = typer.Option(1, help="Decoder layers of the head."),
    feature_layers: str | None = typer.Option(None, help="The target's decoder layers the head reads, by their output "
                                              "(0-based, comma-separated; eagle3: three ascending, default 1, N/2-1, "
                                              "N-4, moved apart in a target of fewer than 8 layers)."),
    steps: int = typer.Option(1000, help="Optimizer steps in all (a resume may raise it, never lower it)."),
    minutes: float | None = typer.Option(None, help="Time budget of the training: stop and save before a step that "
                                         "would end past it; "
                                         "the learning rate's schedule then runs over it (held-out evaluations are "
                                         "off its clock)."),
    batch_size: int = typer.Option(16, help="Global batch (split over torchrun's processes)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW: a warm-up, then a cosine to a tenth of it at --steps, "
                             "or when --minutes is spent if that comes first; the warm-up is the first 50 steps, with "
                             "--minutes the first 5% of the schedule and at least 10 steps)."),
    ttt_depth: int = typer.Option(5, "--ttt-depth", "--ttt-steps",
                                  help="Training-time test: passes unrolled, the depth the head will draft (a chain's "
                                  "gamma, 5 by default, or a tree's depth); pass k reads the head's own predictions "
                                  "under the attention drafting gives it. 1: pass 1 alone. (--ttt-steps: its older "
                                  "name.)"),
    ttt_decay: float = typer.Option(1.0, help="Pass k's loss weighs DECAY^(k-1), the weights normalised (1: every "
                                    "depth counts alike; EAGLE-3 used 0.8)."),
    eval_every_minutes: float | None = typer.Option(None, help="Held-out tau (the engine drafting --eval-prompts "
                                                    "prompts the training never sees, a chain of --ttt-depth) every "
                                                    "this many training minutes and at the end; OUT keeps the head of "
                                                    "the best, OUT/checkpoints/last the last (default: a fifth of "
                                                    "--minutes, or only at the end; 0: never, OUT keeps the last)."),
    eval_prompts: int = typer.Option(4, help="Held-out prompts per evaluation: the world's test split of the "
                                     "families trained on (its test clips for a Video-LLaVA target; the image "
                                     "families' with --data FILE), 32 new tokens each."),
    text_steps: int | None = typer.Option(None, help="msd: text-only steps first (default: a third of --steps; "
                                             "with --minutes, that share of the time budget if it ends training "
                                             "first)."),
    cache_features: Path | None = typer.Option(None, help="Dump the target's features of each training sequence "
                                               "here once and read them back every later epoch (resumable)."),
    cache_max_gb: float = typer.Option(50.0, help="Size limit of --cache-features; past it the remaining sequences' "
                                       "features are computed on the fly."),
    seed: int = typer.Option(0),
    device: str = options.device("cpu", "Under torchrun, cuda is each process's cuda:LOCAL_RANK; "),
    threads: int | None = options.THREADS,
    fresh: bool = options.FRESH,
) -> None:
    """Train a feature-level draft head (EAGLE / EAGLE-3 / MSD) on the frozen target's features.

    Scales out with `torchrun --nproc_per_node=N -m mmspec train head ...` (DDP). Ctrl-C keeps the
    finished steps (OUT/checkpoints/head.pt and the head itself); the same command resumes them."""
    import os

    from mmspec.provenance import command_line
    from mmspec.train.head import HeadTrainConfig, train_head, world_sequences, world_video_sequences

    with training_errors():
        if samples is None and data == "world":
            samples = 200
        if families is None:
            families = ",".join(world_families(target, data))
        local = os.environ.get("LOCAL_RANK")
        if device == "cuda" and local is not None:
            device = f"cuda:{local}"
        cfg = HeadTrainConfig(variant=variant, out=str(out), num_layers=layers, steps=steps, minutes=minutes,
                              batch_size=batch_size, lr=lr, ttt_depth=ttt_depth, ttt_decay=ttt_decay,
                              text_steps=text_steps, seed=seed, eval_every_minutes=eval_every_minutes,
                              resume=not fresh, device=device, cache_max_gb=cache_max_gb,
                              cache_features=None if cache_features is None else str(cache_features),
                              notes={"command": command_line(), "data": data, "samples": samples, "families": families,
                                     "answers": str(answers) if answers else None, "world_seed": world_seed,
                                     "draft_vocab": draft_vocab, "max_length": max_length,
                                     "feature_layers": feature_layers})
        if isinstance(eval_prompts, bool) or eval_prompts < 1:
            raise MMSpecError(f"--eval-prompts must be >= 1, got {eval_prompts} (--eval-every-minutes 0 turns the "
                              "evaluations off)")
        check_conversation_options(cfg.variant, data, max_length, frames, draft_vocab)
        check_head_options(cfg, target, data, image_dir, answers, families, samples, threads)
        feature_ids = check_feature_layers(cfg.variant, feature_layers, target)  # before the target loads
        set_threads(threads)
        from mmspec.models.loading import load_model, load_processor

        model = load_model(str(target), dtype="float32" if device == "cpu" else "auto")
        processor = load_processor(str(target))
        img = getattr(model.config, "image_token_id", None)
        head = None
        if data == "world" and is_video_llava(target):
            seqs = world_video_sequences(model, processor, names(families), samples, world_seed, answers)
        elif data == "world":
            seqs = world_sequences(processor, names(families), samples, world_seed, answers, img)
        else:
            seqs = user_sequences(model, processor, data, image_dir, samples, max_length, frames)
        if data == "world" and answers is None:
            typer.echo("note: training on the world's reference answers; the target's own (`mmspec train "
                       "answers`, then --answers FILE) train a head that drafts deeper (docs/heads.md, \"Train\")",
                       err=True)
        if draft_vocab is not None or feature_layers:
            from mmspec.heads.model import build_head
            from mmspec.train.conversations import draft_vocabulary

            vocab = None if draft_vocab is None else draft_vocabulary(
                seqs, draft_vocab, model.get_output_embeddings().weight.shape[0])
            head = build_head(model, cfg.variant, num_layers=layers, draft_vocab=vocab, seed=seed,
                              feature_layers=feature_ids)
        evaluate = None if eval_every_minutes == 0 else held_out(model, processor, target, data, names(families),
                                                                  eval_prompts, ttt_depth)
        train_head(model, seqs, cfg, head=head, evaluate=evaluate)


def held_out(model, processor, target: Path, data: str, families: list[str], n: int, gamma: int):
    """The held-out evaluator: the world's test clips of the trained families for a Video-LLaVA
    target on --data world, else its test prompts (of the trained families on --data world)."""
    from mmspec.heads.check import CHECK_FAMILIES, world_prompts
    from mmspec.train.held_out import HeldOut, world_clip_prompts

    if data == "world" and is_video_llava(target):
        prompts = world_clip_prompts(model, processor, families, n)
    else:
        prompts = world_prompts(n, tuple(families) if data == "world" else CHECK_FAMILIES)
    return HeldOut(model, processor.tokenizer, processor, prompts, gamma=gamma)


def user_sequences(model, processor, data: str, media_dir: Path | None, samples: int | None, max_length: int | None,
                   frames: int):
    """The conversations of ``--data FORMAT:FILE`` through the target's processor (the first
    ``samples``), bad records counted and skipped; ``max_length`` defaults to the context length."""
    from mmspec.models.base import adapter_for
    from mmspec.train.conversations import conversation_sequences

    adapter = adapter_for(model)
    types = (adapter.image_token_id, adapter.video_token_id) if "mm_token_type_ids" in adapter.mm_keys else None
    seqs, _ = conversation_sequences(processor, Path(data.split(":", 1)[1]), media_dir, limit=samples,
                                     max_length=max_length or adapter.max_positions, n_frames=frames,
                                     mm_token_types=types)
    return seqs


def check_feature_layers(variant: str, text: str | None, target: Path) -> tuple[int, ...] | None:
    """``--feature-layers 1,13,24`` -> (1, 13, 24), each a decoder layer of the target (its depth
    read from its config.json, no weights loaded); an eagle3 head's layers, given or the default,
    three ascending ones, as the engines read them and ``export head`` writes them."""
    from mmspec.heads.model import check_eagle3_layers, default_feature_layers

    n = target_depth(target)
    ids = None
    if text:
        try:
            ids = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise MMSpecError(f"--feature-layers {text!r}: give decoder layer numbers separated by commas, e.g. "
                              "1,13,24") from None
        if n is not None and any(not 0 <= i < n for i in ids):
            raise MMSpecError(f"--feature-layers {text!r}: the target has {n} decoder layers (0 to {n - 1})")
    if variant == "eagle3" and n is not None:
        check_eagle3_layers(ids or default_feature_layers(variant, n), n, text or None)
    return ids


def target_depth(target: Path) -> int | None:
    """The decoder layers of the target's language model, from its config (None: unreadable;
    loading it says why)."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(str(target)).get_text_config(decoder=True).num_hidden_layers)
    except Exception:  # noqa: BLE001 - an unknown architecture or a damaged config: the load names it
        return None


def check_conversation_options(variant: str, data: str, max_length: int | None, frames: int,
                               draft_vocab: int | None) -> None:
    if max_length is not None and max_length < 2:
        raise MMSpecError(f"--max-length must be >= 2 tokens, got {max_length}")
    if frames < 1:
        raise MMSpecError(f"--frames must be >= 1, got {frames}")
    if draft_vocab is not None and variant != "eagle3":
        raise MMSpecError(f"--draft-vocab sizes an EAGLE-3 head's own vocabulary; the {variant} head scores with the "
                          "target's: drop --draft-vocab or use --variant eagle3")
    if draft_vocab is not None and draft_vocab < 1:
        raise MMSpecError(f"--draft-vocab must be >= 1, got {draft_vocab}")


def is_video_llava(target: Path) -> bool:
    import json

    try:
        return json.loads((target / "config.json").read_text()).get("model_type") == "video_llava"
    except (OSError, ValueError, AttributeError):
        return False  # check_head_options says what is wrong with it


def world_families(target: Path, data: str) -> tuple[str, ...]:
    """The world families ``--families`` defaults to: the video ones for a Video-LLaVA target."""
    from mmspec.world import FAMILIES, VIDEO_FAMILIES

    return tuple(VIDEO_FAMILIES) if data == "world" and is_video_llava(target) else tuple(FAMILIES)


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_head_options(cfg: HeadTrainConfig, target: Path, data: str, image_dir: Path | None,
                       answers: Path | None, families: str, samples: int, threads: int | None) -> None:
    """Every `train head` option, before anything is loaded or written (the numbers of the
    config itself are checked by :class:`HeadTrainConfig`)."""
    from mmspec.train.head import CHECKPOINT, head_settings
    from mmspec.train.loop import read_checkpoint
    from mmspec.world import FAMILIES, VIDEO_FAMILIES

    check_threads(threads)
    if samples is not None and (isinstance(samples, bool) or samples < 1):
        raise MMSpecError(f"--samples must be >= 1, got {samples}")
    check_device(cfg.device)
    check_model_dir(target, "--target", "a target model")
    if data == "world":
        check_model_type(target, "--target", ("llava", "video_llava"), "the embedded world's sequences are in "
                         "LLaVA-1.5's prompt and image format (its video clips: Video-LLaVA's): give such a target, "
                         "or train on your own conversations with --data sharegpt:FILE --media-dir DIR (any family)")
    else:
        check_model_type(target, "--target", TARGET_FAMILIES, "`train head --data` builds sequences for the vision-language "
                         "families mmspec decodes")
    check_processor(target, "--target")
    if data == "world":
        video = is_video_llava(target)
        allowed = VIDEO_FAMILIES if video else FAMILIES
        unknown = [f for f in names(families) if f not in allowed]
        if unknown or not names(families):
            kind, why = ("video family", " (a Video-LLaVA target reads the world's clips)") if video else ("family", "")
            raise MMSpecError(f"--families {families!r}: unknown world {kind} {unknown[0] if unknown else '(none)'!r}"
                              f"{why}; use some of {', '.join(allowed)}")
        if answers is not None and not answers.is_file():
            raise MMSpecError(f"answers file {answers} not found; make it with `mmspec train answers --out {answers}` "
                              "for the same families, counts and world seed, or leave --answers out")
        if image_dir is not None:
            raise MMSpecError("--media-dir holds your conversations' images; the world makes its own: drop it or "
                              "use --data sharegpt:FILE.jsonl")
    elif data.split(":", 1)[0] in CONVERSATION_FORMATS and ":" in data:
        path = Path(data.split(":", 1)[1])
        if not path.is_file():
            raise MMSpecError(f"--data {data}: {path} not found; give a JSON or JSONL file of conversations")
        if image_dir is not None and not image_dir.is_dir():
            raise MMSpecError(f"--media-dir {image_dir} is not a folder; give the folder the conversations' image and "
                              "video paths are relative to")
        if answers is not None:
            raise MMSpecError("--answers holds the target's answers to the world's prompts; with your own "
                              "conversations drop it (regenerate their answers with `mmspec train answers --data`)")
    else:
        raise MMSpecError(f"unknown --data {data!r}; use world, llava-instruct:FILE.json or sharegpt:FILE.json[l]")
    out = Path(cfg.out)
    check_out(out)
    if cfg.resume:
        if (out / "checkpoint" / "train_state.pt").is_file() and not (out / CHECKPOINT).is_file():
            raise MMSpecError(f"{out / 'checkpoint'} is a checkpoint of an older mmspec, which this one cannot resume; "
                              "add --fresh to start over (the head saved in --out stays usable meanwhile)")
        read_checkpoint(out / CHECKPOINT, head_settings(cfg), cfg.steps, cfg.minutes, "head training")  # the
        # checkpoint's variant may be another than --variant: its own is named among the settings that differ
