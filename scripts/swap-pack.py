"""Swap trained models into the shipped pack and record them in its pack_report.json.

    python scripts/swap-pack.py KEY NOTE ROLE=DIR [ROLE=DIR ...]
    e.g. python scripts/swap-pack.py v12 "the v11 target trained on ..." target=runs/v12/target

ROLE is target, draft, draft_pooled or captioner; the roles not named stay as shipped. Each new
model must be fp16 (`stage --half`) and keep its role's shipped vision tower and tokenizer (these
stages train projector + LM only): the script refuses otherwise. Each model is saved again (fp16,
this environment's transformers) with the shipped processor and tokenizer_config, so its files
match the rest of the package, into a staging folder; the weights must come back bit-identical.
Only when every role has passed are the pack's folders replaced. pack_report.json gets KEY with
NOTE and each new model's parameter counts and stage history (its last stage's losses are printed).
Run it from the repository root. (The v10 and v11 swaps used the per-release scripts kept in
docs/results/gpu-2026-11-22/ and docs/results/hallu-2026-11-23/.)
"""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.embedded import ROLES
from mmspec.train.checkpoint import read_sidecar, save_checkpoint

PACK = Path("src/mmspec/assets/embedded")


def parse(argv: list[str]) -> tuple[str, str, dict[str, Path]]:
    if len(argv) < 3 or not all("=" in a for a in argv[2:]):
        sys.exit(__doc__)
    new = {}
    for arg in argv[2:]:
        role, src = arg.split("=", 1)
        if role not in ROLES:
            sys.exit(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (Path(src) / name).is_file():
                sys.exit(f"{src} has no {name}: pass a checkpoint directory from `mmspec train stage`")
        new[role] = Path(src)
    return argv[0], argv[1], new


def check(role: str, src: Path) -> None:
    """Refuse a checkpoint that is not fp16 or does not share the shipped tower and tokenizer."""
    weights = load_file(src / "model.safetensors")
    wide = sorted({str(v.dtype) for v in weights.values() if v.is_floating_point() and v.dtype != torch.float16})
    if wide:
        sys.exit(f"{role}: {src} holds {', '.join(wide)} weights; the pack is fp16: train with --half")
    shipped = {k: v for k, v in load_file(PACK / role / "model.safetensors").items() if "vision_tower" in k}
    if not all(k in weights and torch.equal(weights[k], v) for k, v in shipped.items()):
        sys.exit(f"{role}: {src}'s vision tower is not the shipped one")
    if (src / "tokenizer.json").read_text() != (PACK / role / "tokenizer.json").read_text():
        sys.exit(f"{role}: {src}'s tokenizer is not the shipped one")


def stage(role: str, src: Path, out: Path) -> dict:
    """Re-save ``src`` into ``out`` the way the pack keeps it; returns its records for the report."""
    model = LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    meta = read_sidecar(src)
    meta.pop("eval", None)  # an earlier release's held-out eval, carried over by --init
    processor = AutoProcessor.from_pretrained(PACK / role)
    save_checkpoint(model, out, processor=processor, half=True, meta=meta)
    # a reloaded processor adds load-time keys: keep the shipped tokenizer_config as it is
    shutil.copyfile(PACK / role / "tokenizer_config.json", out / "tokenizer_config.json")
    saved = load_file(out / "model.safetensors")
    if not all(torch.equal(saved[k], v) for k, v in load_file(src / "model.safetensors").items()):
        sys.exit(f"{role}: the weights changed on re-saving; the pack is untouched")
    return {k: meta[k] for k in ("params", "stages", "pooled_tokens") if k in meta}


def main() -> None:
    key, note, new = parse(sys.argv[1:])
    report = json.loads((PACK / "pack_report.json").read_text())
    if key in report:
        sys.exit(f"pack_report.json already has {key!r}: pick a new key")
    for role, src in new.items():
        check(role, src)
    if stale := sorted(PACK.glob(".swap-*")):
        sys.exit(f"{stale[0]} is left from an interrupted swap: check the pack against git, then remove it")
    with tempfile.TemporaryDirectory(dir=PACK, prefix=".swap-") as tmp:  # same file system: renames
        tmp = Path(tmp)
        models = {role: stage(role, src, tmp / role) for role, src in new.items()}
        report[key] = {"note": note, "models": models}
        (tmp / "pack_report.json").write_text(json.dumps(report, indent=2) + "\n")
        swapped = []  # every role is staged and checked: only now does the pack change
        try:
            for role in new:
                (PACK / role).rename(tmp / f"{role}.old")  # set aside, not deleted, until all are in
                swapped.append(role)
                (tmp / role).rename(PACK / role)
            os.replace(tmp / "pack_report.json", PACK / "pack_report.json")
        except BaseException:
            for role in reversed(swapped):  # put the shipped folders back
                if (PACK / role).exists():
                    (PACK / role).rename(tmp / role)
                (tmp / f"{role}.old").rename(PACK / role)
            raise
    print({role: m.get("stages", [{}])[-1].get("final_loss") for role, m in models.items()})


if __name__ == "__main__":
    main()
