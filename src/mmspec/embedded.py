"""The embedded model pack: tiny target / draft / pooled draft / captioner shipped in the package.

Owns: :func:`load_embedded`, which loads ``src/mmspec/assets/embedded/{target,draft,
draft_pooled,captioner}`` (and finds the feature-level heads under ``heads/``) (fp16 safetensors on disk, upcast to ``dtype`` on load) into an
:class:`EmbeddedModels`. The models are plain HF ``LlavaForConditionalGeneration``
directories trained on the synthetic world; ``pack_report.json`` beside them records every
stage that made them, and ``mmspec train embedded`` (:mod:`mmspec.train`) makes a pack of the
same shapes from nothing. This module only reads their ``mmspec.json`` sidecars.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mmspec.errors import MMSpecError
from mmspec.models.captioner import DEFAULT_CAPTIONER_PROMPT, HFCaptioner, recorded_prompt

ROLES = ("target", "draft", "draft_pooled", "captioner")


@dataclass
class EmbeddedModels:
    """The loaded pack. ``draft_pooled`` is None when the pack has none."""

    target: object  # LlavaForConditionalGeneration
    draft: object
    draft_pooled: object | None
    pooled_tokens: int | None  # image tokens per image the pooled draft was fine-tuned with
    captioner_model: object
    captioner_processor: object
    captioner_prompt: str
    tokenizer: object
    processor: object  # the target's (and draft's) LlavaProcessor
    path: Path

    @property
    def heads(self) -> dict[str, Path]:
        """Trained feature-level heads shipped with the pack (variant -> directory), if any."""
        from mmspec.heads.model import CONFIG_NAME  # the pack ships mmspec's own heads (no EAGLE imports)

        root = self.path / "heads"
        return {d.name: d for d in sorted(root.iterdir()) if (d / CONFIG_NAME).is_file()} if root.is_dir() else {}

    def captioner(self, **kw):
        """The pack's captioner with its recorded prompt, ready for ``SpecDecoder(captioner=)``."""
        return HFCaptioner(self.captioner_model, self.captioner_processor, prompt=self.captioner_prompt, **kw)


def default_path() -> Path:
    """Where the package keeps the pack."""
    return Path(__file__).resolve().parent / "assets" / "embedded"


def _missing(path: Path, what: str) -> MMSpecError:
    return MMSpecError(
        f"embedded models not found: {what} is missing under {path}. "
        + ("mmspec ships them, so the install is damaged: reinstall mmspec. " if path == default_path() else "")
        + f"To make a pack of the shipped shapes: `mmspec train embedded --out {path} --minutes-budget 55 "
        f"--bf16` (a 2-core CPU, about an hour; docs/embedded-models.md says how close it gets to the "
        f"shipped pack); or pass path= to a directory that holds target/, draft/, draft_pooled/, captioner/.")


def _has_weights(d: Path) -> bool:
    return (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists()


def load_embedded(dtype: torch.dtype = torch.float32, path: str | Path | None = None,
                  device: str | torch.device = "cpu") -> EmbeddedModels:
    """Load the pack from ``path`` (default: the package assets), weights cast to ``dtype``."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.models.loading import read_sidecar, resolve_device

    root = Path(path) if path is not None else default_path()
    for role in ("target", "draft", "captioner"):
        if not (root / role / "config.json").exists():
            raise _missing(root, f"{role}/config.json")
        if not _has_weights(root / role):
            raise _missing(root, f"{role}/model.safetensors")
    device = resolve_device(device)

    def model(role: str):
        m = LlavaForConditionalGeneration.from_pretrained(root / role, dtype=dtype)
        return m.to(device).eval()

    pooled_dir = root / "draft_pooled"
    has_pooled = (pooled_dir / "config.json").exists()
    if has_pooled and not _has_weights(pooled_dir):
        raise _missing(root, "draft_pooled/model.safetensors")
    processor = AutoProcessor.from_pretrained(root / "target")
    return EmbeddedModels(
        target=model("target"),
        draft=model("draft"),
        draft_pooled=model("draft_pooled") if has_pooled else None,
        pooled_tokens=read_sidecar(pooled_dir).get("pooled_tokens") if has_pooled else None,
        captioner_model=model("captioner"),
        captioner_processor=AutoProcessor.from_pretrained(root / "captioner"),
        captioner_prompt=recorded_prompt(root / "captioner") or DEFAULT_CAPTIONER_PROMPT,
        tokenizer=processor.tokenizer,
        processor=processor,
        path=root,
    )
