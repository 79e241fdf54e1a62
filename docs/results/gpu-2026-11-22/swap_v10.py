"""Swap the v10 pack in (all four models: the vision tower changed) and record it in pack_report.json
under key v10. Each model is loaded and saved again here (fp16, this environment's transformers), with
the shipped processor (the tokenizer is the same file), so the config files match the rest of the
package rather than the GPU machine's transformers 5.17."""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec.train.checkpoint import read_sidecar, save_checkpoint

A, SRC = Path("src/mmspec/assets/embedded"), Path("runs/v10")
ROLES = ("target", "draft", "draft_pooled", "captioner")
vis = [k for k in load_file(SRC / "target" / "model.safetensors") if "vision_tower" in k]
target_w = load_file(SRC / "target" / "model.safetensors")
for role in ROLES:
    w = load_file(SRC / role / "model.safetensors")
    assert all(torch.equal(w[k], target_w[k]) for k in vis), f"{role}'s vision tower differs from the target's"
report = json.loads((A / "pack_report.json").read_text())
models = {}
for role in ROLES:
    model = LlavaForConditionalGeneration.from_pretrained(SRC / role, dtype=torch.float32)
    meta = read_sidecar(SRC / role)
    assert (SRC / role / "tokenizer.json").read_text() == (A / role / "tokenizer.json").read_text()
    processor = AutoProcessor.from_pretrained(A / role)
    tokenizer_config = (A / role / "tokenizer_config.json").read_text()  # a reloaded processor adds load-time keys
    shutil.rmtree(A / role)
    save_checkpoint(model, A / role, processor=processor, half=True, meta=meta)
    (A / role / "tokenizer_config.json").write_text(tokenizer_config)
    assert all(torch.equal(load_file(A / role / "model.safetensors")[k], v)
               for k, v in load_file(SRC / role / "model.safetensors").items()), f"{role} changed on re-saving"
    models[role] = {k: meta[k] for k in ("params", "eval", "stages", "pooled_tokens") if k in meta}
report["v10"] = {
    "note": "the shipped pack since 2026-11-22 (eighth session), trained on a lent H100 from the v5 target: copy "
            "practice and 4.5 min of world training for the projector + LM (scripts/gpu-target-v8.sh, the "
            "target_v8_lm branch), then twice scripts/gpu-pack-v9.sh: the vision tower's contrastive reading "
            "pre-training (2.5 min), then the target's projector + LM (4 / 3.5 min), a new draft, pooled draft and "
            "captioner on that tower, side by side; exact commands: scripts/train-embedded-pack.sh steps 3-5 and "
            "docs/results/gpu-2026-11-22/",
    "models": models}
(A / "pack_report.json").write_text(json.dumps(report, indent=2) + "\n")
print({role: m.get("eval", {}).get("eval_loss") for role, m in models.items()})
