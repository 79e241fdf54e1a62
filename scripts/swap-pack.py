"""Swap trained models into the shipped pack and record them in its pack_report.json.

    python scripts/swap-pack.py KEY NOTE ROLE=DIR [ROLE=DIR ...]
    e.g. python scripts/swap-pack.py v12 "the v11 target trained on ..." target=runs/v12/target

ROLE is target, draft, draft_pooled or captioner; the roles not named stay as shipped. Each new
model must keep its role's shipped vision tower and tokenizer (these stages train projector + LM
only): the script refuses otherwise. Each model is loaded and saved again (fp16, this environment's
transformers) with the shipped processor and tokenizer_config, so its files match the rest of the
package; the weights must come back bit-identical. pack_report.json gets KEY with NOTE and each new
model's parameter counts and stage history (its last stage's losses are printed).
Run it from the repository root. (The v10 and v11 swaps used the per-release scripts kept in
docs/results/gpu-2026-11-22/ and docs/results/hallu-2026-11-23/.)
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.checkpoint import read_sidecar, save_checkpoint

ROLES = ("target", "draft", "draft_pooled", "captioner")
PACK = Path("src/mmspec/assets/embedded")


def parse(argv: list[str]) -> tuple[str, str, dict[str, Path]]:
    if len(argv) < 3 or not all("=" in a for a in argv[2:]):
        sys.exit(__doc__)
    new = {}
    for arg in argv[2:]:
        role, src = arg.split("=", 1)
        if role not in ROLES:
            sys.exit(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        if not (Path(src) / "model.safetensors").is_file():
            sys.exit(f"{src} has no model.safetensors: pass a checkpoint directory from `mmspec train stage`")
        new[role] = Path(src)
    return argv[0], argv[1], new


def main() -> None:
    key, note, new = parse(sys.argv[1:])
    report = json.loads((PACK / "pack_report.json").read_text())
    if key in report:
        sys.exit(f"pack_report.json already has {key!r}: pick a new key")
    for role, src in new.items():  # check all before changing anything
        shipped = {k: v for k, v in load_file(PACK / role / "model.safetensors").items() if "vision_tower" in k}
        weights = load_file(src / "model.safetensors")
        if not all(k in weights and torch.equal(weights[k], v) for k, v in shipped.items()):
            sys.exit(f"{role}: {src}'s vision tower is not the shipped one")
        if (src / "tokenizer.json").read_text() != (PACK / role / "tokenizer.json").read_text():
            sys.exit(f"{role}: {src}'s tokenizer is not the shipped one")
    models = {}
    for role, src in new.items():
        model = LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
        meta = read_sidecar(src)
        meta.pop("eval", None)  # an earlier release's held-out eval, carried over by --init
        processor = AutoProcessor.from_pretrained(PACK / role)
        tokenizer_config = (PACK / role / "tokenizer_config.json").read_text()  # reloading adds load-time keys
        shutil.rmtree(PACK / role)
        save_checkpoint(model, PACK / role, processor=processor, half=True, meta=meta)
        (PACK / role / "tokenizer_config.json").write_text(tokenizer_config)
        saved = load_file(PACK / role / "model.safetensors")
        assert all(torch.equal(saved[k], v) for k, v in load_file(src / "model.safetensors").items()), \
            f"{role} changed on re-saving"
        models[role] = {k: meta[k] for k in ("params", "stages", "pooled_tokens") if k in meta}
    report[key] = {"note": note, "models": models}
    (PACK / "pack_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print({role: m.get("stages", [{}])[-1].get("final_loss") for role, m in models.items()})


if __name__ == "__main__":
    main()
