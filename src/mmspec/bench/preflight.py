"""Checks of a benchmark run's arguments that need the disk, done before anything is created.

Owns :func:`preflight`: the ``--out`` path (a directory, or one that can be made), every
dataset (its name, its path and schema, by loading its first usable sample), the head
directories (readable, of the variant named, one for each head method), the model paths
(local directories, or hub ids this machine can get: :func:`mmspec.models.loading.locate`) and
the device. A run refused here leaves no results directory or empty results file behind.
:class:`~mmspec.bench.config.BenchConfig` checks what needs no disk (numbers, flags).
"""

from __future__ import annotations

import os
from pathlib import Path

from mmspec.bench.config import BenchConfig, RankInfo
from mmspec.errors import MMSpecError


def check_out_dir(out: Path) -> None:
    """``out`` is a directory, or can become one: no file in its place or on its way."""
    out = Path(out)
    fix = "pass a directory for the results (a new one, or the --out of a run to resume)"
    if out.exists() and not out.is_dir():
        raise MMSpecError(f"--out {str(out)!r} is a file, not a directory; {fix}")
    for parent in out.absolute().parents:  # the deepest one that exists
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise MMSpecError(f"--out {str(out)!r} cannot be made: {str(parent)!r} is a file, not a directory; {fix}")
        if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
            raise MMSpecError(f"--out {str(out)!r} cannot be made: {str(parent)!r} is not writable; {fix}")
        break


def check_datasets(cfg: BenchConfig) -> None:
    """Every dataset loads: a family of the embedded world and a split it has; or a real
    benchmark's path with the expected columns and a usable first row."""
    from mmspec.bench.datasets import EMBEDDED_NAMES, load_dataset
    from mmspec.world.core import check_split

    for spec in cfg.datasets:
        if spec.path is None and spec.name != "mmspec":  # the world: checked by name, without rendering a sample
            if spec.name not in EMBEDDED_NAMES:
                raise MMSpecError(f"unknown dataset {spec.name!r}; choose from {sorted(EMBEDDED_NAMES)}")
            check_split(spec.split or cfg.split or "test")  # the world's split when none is named
        else:
            load_dataset(spec.name, spec.path, 1, spec.split or cfg.split)


def check_models(cfg: BenchConfig) -> None:
    """Each model path is a local directory or a hub id this machine can get, found fast."""
    from mmspec.heads.directory import is_head_dir
    from mmspec.models.loading import check_processor_files, locate

    for flag, name in (("--target", cfg.target), ("--draft", cfg.draft), ("--captioner", cfg.captioner)):
        if name is None:
            continue
        if is_head_dir(name):
            raise MMSpecError(f"{flag} {name!r} is a draft head directory, not a model; pass it as --head "
                              f"VARIANT={name} with a head method (-m eagle, ...)")
        path = Path(locate(name, flag))
        if path.is_dir() and not (path / "config.json").is_file():
            raise MMSpecError(f"{flag} {name!r} is not a model directory (no config.json); pass the directory "
                              "save_pretrained() wrote")
        if flag != "--draft":
            check_processor_files(str(path))  # the target's and captioner's processors load from their directories


def embedded_heads() -> dict[str, str]:
    """Heads shipped in the embedded pack's ``heads/`` folder (variant -> directory); none today."""
    from mmspec.embedded import default_path
    from mmspec.heads.directory import is_head_dir

    root = default_path() / "heads"
    return {d.name: str(d) for d in sorted(root.iterdir()) if is_head_dir(d)} if root.is_dir() else {}


def check_heads(cfg: BenchConfig) -> None:
    """Each ``--head VARIANT=DIR`` is a readable head directory of that variant (its results are
    labelled with it) used by some method; each head method has its head."""
    from mmspec.bench.config import method_tree
    from mmspec.errors import article
    from mmspec.heads.directory import check_head_target, describe_head

    given: dict[str, str] = {}
    infos: dict = {}
    for name, path in cfg.heads:
        if name in given:
            raise MMSpecError(f"--head gives two {name} heads; give one per variant")
        try:
            info = describe_head(path)  # any kind: mmspec, EAGLE-1/2, EAGLE-3, speculators
        except MMSpecError as e:
            raise MMSpecError(f"--head {name}={path}: {e}") from None
        variant = info.variant
        if variant != name:
            raise MMSpecError(f"--head {name}={path}: that directory holds {article(variant)} {variant} head, not "
                              f"{article(name)} {name} one "
                              f"(its results would be labelled {name}); write --head {variant}={path} and "
                              f"-m {variant}...")
        given[name] = path
        infos[name] = info
    wanted: dict[str, str] = {}  # head variant -> the first method drafting with it
    for m in cfg.methods:
        variant = method_tree(m).get("head")
        if variant:
            wanted.setdefault(variant, m)
    shipped = embedded_heads() if cfg.target is None else {}
    for variant, method in wanted.items():
        if variant not in given and variant not in shipped:
            where = "no head ships with the embedded pack" if cfg.target is None else "train one for this target"
            raise MMSpecError(f"-m {method} needs --head {variant}=DIR ({where}; make one with mmspec train head "
                              f"--variant {variant})")
    unused = sorted(set(given) - set(wanted))
    if unused:
        raise MMSpecError(f"--head {unused[0]}=... is given but no method drafts with it; add -m {unused[0]} (or "
                          f"{unused[0]}+tree), or drop that --head")
    for name, info in infos.items():  # last: the mistakes above name themselves first
        try:
            check_head_target(info, cfg.target)
        except MMSpecError as e:
            raise MMSpecError(f"--head {name}={given[name]}: {e}") from None


def check_batch_run(cfg: BenchConfig, rank: RankInfo) -> None:
    """``--batch-size`` above 1: one process (throughput and latency of processes sharing a machine
    are not the batch's), and a SpecDecoder with ``generate_batch`` when real models run."""
    big = max(cfg.batch_sizes)
    if big <= 1:
        return
    if rank.world_size > 1:
        raise MMSpecError(f"--batch-size {big} under torchrun / accelerate (WORLD_SIZE={rank.world_size}): batched "
                          "throughput and latency are measured by one process; run it without the launcher")


def preflight(cfg: BenchConfig, rank: RankInfo, default_backend: bool = True) -> None:
    """All checks above; the model and device checks only where the run builds real models."""
    check_out_dir(cfg.out_dir)
    check_batch_run(cfg, rank)
    check_heads(cfg)
    if default_backend:
        from mmspec.bench.backend import pick_device

        check_models(cfg)
        pick_device(cfg, rank)  # a device this machine lacks
    check_datasets(cfg)
