"""What the ``mmspec train`` commands share: options, step defaults and checks."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

# options that several commands share, declared once
STEPS = typer.Option(None, help="optimiser steps (default: 1000, or as many as --minutes allow when it is given)")
MINUTES = typer.Option(None, help="wall-clock cap; the schedule then follows time")
BF16 = typer.Option(True, help="bf16 autocast")


def default_steps(steps: int | None, minutes: float | None) -> int | None:
    """--steps as given; unset, 1000 without --minutes and None (the clock decides) with it."""
    return steps if steps is not None or minutes is not None else 1000


def require_model_dir(path: Path, option: str) -> None:
    if not (path / "config.json").exists():
        raise typer.BadParameter(f"{path} is not an HF LLaVA model directory (no config.json)", param_hint=option)


def parse_family_samples(specs: list[str], default: int, purpose: str = "train on",
                         families=None) -> dict[str, int]:
    """``["chartqa=4000", ...]`` -> training samples per family (every family of ``families``,
    default the world's image families; ``default``, the ``--n-train-per-family`` given, unless
    named). A negative ``default``, or none left for any family, is refused naming the flags the
    user gave."""
    from mmspec.world import FAMILIES

    names = tuple(families) if families is not None else tuple(FAMILIES)
    if isinstance(default, bool) or not isinstance(default, int) or default < 0:
        raise typer.BadParameter(f"must be a whole number of samples per family >= 0, got {default!r} (0: only "
                                 "the families --family-samples FAMILY=N names)", param_hint="--n-train-per-family")
    counts = {name: default for name in names}
    for spec in specs:
        name, sep, n = spec.partition("=")
        if not sep or name not in names or not n.isdigit():
            raise typer.BadParameter(f"{spec!r} is not FAMILY=N with FAMILY one of {', '.join(names)} and N >= 0",
                                     param_hint="--family-samples")
        counts[name] = int(n)
    if not any(counts.values()):
        given = f"--n-train-per-family {default}" + "".join(f" --family-samples {x}" for x in specs)
        raise typer.BadParameter(f"every family has 0 samples ({given}); nothing to {purpose}: give "
                                 "--n-train-per-family N >= 1, or name a family with --family-samples FAMILY=N (N >= 1)",
                                 param_hint="--family-samples" if specs else "--n-train-per-family")
    return counts


@contextlib.contextmanager
def training_errors():
    """Every ``train`` command's exits: a bad input -> its one-line error (exit 2); Ctrl-C during
    training -> the one line saying what was kept and that the same command resumes (exit 130)."""
    from mmspec.cli.common import fail
    from mmspec.errors import MMSpecError
    from mmspec.train.loop import TrainingInterrupted

    try:
        yield
    except MMSpecError as e:
        fail(e)
    except TrainingInterrupted as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        typer.echo("interrupted before training began: nothing to keep", err=True)
        raise typer.Exit(130) from None


def check_threads(threads: int | None) -> None:
    from mmspec.errors import MMSpecError

    if threads is not None and threads < 1:
        raise MMSpecError(f"--threads must be >= 1, got {threads}; or leave it out for one share of the cores "
                          "per process")


def check_device(device: str) -> None:
    """``--device``: cpu, cuda or cuda:N that this torch can use."""
    import torch

    from mmspec.errors import MMSpecError

    if device == "cpu":
        return
    if not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise MMSpecError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise MMSpecError(f"--device {device}: this torch sees no CUDA device; use --device cpu")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise MMSpecError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_count(value, option: str, least: int = 1) -> None:
    """A whole-number option that must be >= ``least``."""
    from mmspec.errors import MMSpecError

    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MMSpecError(f"{option} must be a whole number >= {least}, got {value!r}")


def check_model_dir(path: Path | None, option: str, what: str = "a model") -> None:
    """``path`` must be a model directory (config.json): refused otherwise, before anything loads."""
    from mmspec.errors import MMSpecError

    if path is None:
        return
    if not path.exists():
        raise MMSpecError(f"{option} {path} not found; give {what} directory (with config.json)")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise MMSpecError(f"{option} {path} is not {what} directory (no config.json)")


def check_model_type(path: Path, option: str, want: str | tuple[str, ...], why: str) -> None:
    """``path``'s config.json must name ``model_type`` ``want`` (or one of them); ``why`` says what needs it."""
    import json

    from mmspec.errors import MMSpecError

    try:
        got = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise MMSpecError(f"{option} {path}: its config.json is not readable JSON") from None
    wanted = (want,) if isinstance(want, str) else tuple(want)
    if got not in wanted:
        name = repr(want) if isinstance(want, str) else "one of " + ", ".join(wanted)
        raise MMSpecError(f"{option} {path} is a {got!r} model; {why} (model_type {name})")


def check_processor(path: Path, option: str, tokenizer: bool = True) -> None:
    """``path`` must hold an image processor (and, with ``tokenizer``, tokenizer files) to read."""
    from mmspec.errors import MMSpecError

    image = any((path / f).is_file() for f in ("preprocessor_config.json", "processor_config.json"))
    tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not image or (tokenizer and not tok):
        missing = " and ".join(n for n, ok in (("an image processor (preprocessor_config.json)", image),
                                               ("tokenizer files (tokenizer.json)", tok or not tokenizer)) if not ok)
        raise MMSpecError(f"{option} {path} lacks {missing}; save the processor beside the weights "
                          "(processor.save_pretrained(DIR))")


def check_out(out: Path, option: str = "--out") -> None:
    """``out`` must be a directory or not exist yet (it is made once the inputs are checked)."""
    from mmspec.errors import MMSpecError

    if out.exists() and not out.is_dir():
        raise MMSpecError(f"{option} {out} is a file; give a directory (it is created if missing)")
