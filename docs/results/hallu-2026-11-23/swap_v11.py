"""Swap the v11 target, draft and pooled draft in (the captioner and every vision tower stay v10's)
and record them in pack_report.json under key v11. Each model is loaded and saved again here (fp16),
with the shipped processor and tokenizer_config (same tokenizer file), as swap_v10.py did.

    python docs/results/hallu-2026-11-23/swap_v11.py TARGET_DIR DRAFT_DIR DRAFT_POOLED_DIR
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.checkpoint import read_sidecar, save_checkpoint

if len(sys.argv) != 4:
    sys.exit(__doc__)
A = Path("src/mmspec/assets/embedded")
NEW = dict(zip(("target", "draft", "draft_pooled"), map(Path, sys.argv[1:4])))
tower = {k: v for k, v in load_file(A / "target" / "model.safetensors").items() if "vision_tower" in k}
for role, src in NEW.items():
    w = load_file(src / "model.safetensors")
    assert all(torch.equal(w[k], v) for k, v in tower.items()), f"{role}'s vision tower is not the shipped one"
    assert (src / "tokenizer.json").read_text() == (A / role / "tokenizer.json").read_text(), role
report = json.loads((A / "pack_report.json").read_text())
models = {}
for role, src in NEW.items():
    model = LlavaForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    meta = read_sidecar(src)
    meta.pop("eval", None)  # v10's held-out eval, carried over by --init; the v11 figures are in the docs
    processor = AutoProcessor.from_pretrained(A / role)
    tokenizer_config = (A / role / "tokenizer_config.json").read_text()  # a reloaded processor adds load-time keys
    shutil.rmtree(A / role)
    save_checkpoint(model, A / role, processor=processor, half=True, meta=meta)
    (A / role / "tokenizer_config.json").write_text(tokenizer_config)
    assert all(torch.equal(load_file(A / role / "model.safetensors")[k], v)
               for k, v in load_file(src / "model.safetensors").items()), f"{role} changed on re-saving"
    models[role] = {k: meta[k] for k in ("params", "stages", "pooled_tokens") if k in meta}
report["v11"] = {
    "note": "the shipped pack since 2026-11-23 (tenth session): the world's existence answers name the object "
            "they look for before deciding; the v10 target, draft and pooled draft trained on for the new answers "
            "on the 2-core CPU (projector + LM; vision towers and the captioner stay v10's); exact commands: "
            "scripts/train-embedded-pack.sh step 6 and docs/results/hallu-2026-11-23/",
    "models": models}
(A / "pack_report.json").write_text(json.dumps(report, indent=2) + "\n")
print({role: m.get("stages", [{}])[-1].get("final_loss") for role, m in models.items()})
