"""Typed configuration of the training recipes and the model builder.

Owns: the model size presets (:class:`ModelSize`), the per-stage optimisation settings
(:class:`StageConfig`), the whole embedded-pack recipe (:class:`RecipeConfig`) and
:func:`build_llava`, which turns a size preset + tokenizer into a randomly initialised HF
``LlavaForConditionalGeneration`` (CLIP vision tower, Llama LM, image 96 px, patch 12).

Does not know about data, training loops or files: see ``data.py``, ``recipe.py``, ``loop.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from mmspec.errors import MMSpecError
from mmspec.train.loop import check_schedule  # noqa: F401 - the one schedule rule, re-exported

IMAGE_SIZE = 96
PATCH_SIZE = 12
IMAGE_TOKEN_ID = 4
GRID = IMAGE_SIZE // PATCH_SIZE  # 8 -> 64 image tokens per image

Trainable = Literal["all", "projector", "projector+lm"]


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of one LLaVA-architecture model (vision tower + projector + LM)."""

    name: str
    lm_hidden: int
    lm_layers: int
    lm_heads: int
    lm_intermediate: int
    lm_kv_heads: int | None = None  # None: same as lm_heads (no GQA)
    vision_hidden: int = 192
    vision_layers: int = 4
    vision_heads: int = 4
    vision_intermediate: int = 576
    max_positions: int = 1024
    tie_embeddings: bool = True


# Presets: the shipped pack's shapes (docs/embedded-models.md). "target" is 10.57M params in all
# (vision tower included); "draft" keeps LM + projector under 2M and shares the target's vision
# tower (so the vision fields must match "target").
_SIZES: dict[str, ModelSize] = {
    "target": ModelSize("target", lm_hidden=256, lm_layers=10, lm_heads=4, lm_intermediate=768),
    # One layer: at this scale a forward costs per layer, not per parameter (docs/perf.md §4);
    # the first pack's 4 x 128 draft cost a third of a target step, 1 x 192 costs a tenth.
    "draft": ModelSize("draft", lm_hidden=192, lm_layers=1, lm_heads=4, lm_intermediate=576),
    "captioner": ModelSize("captioner", lm_hidden=128, lm_layers=3, lm_heads=4, lm_intermediate=384),
    # For tests: everything tiny.
    "tiny": ModelSize("tiny", lm_hidden=32, lm_layers=2, lm_heads=2, lm_intermediate=64,
                      vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
                      max_positions=1024),
    "tiny-draft": ModelSize("tiny-draft", lm_hidden=16, lm_layers=1, lm_heads=2, lm_intermediate=32,
                            vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
                            max_positions=1024),
}


def model_size(name: str) -> ModelSize:
    """The preset called ``name`` ("target", "draft", "captioner", "tiny", "tiny-draft")."""
    if name not in _SIZES:
        raise MMSpecError(f"unknown model size {name!r}; choose one of {sorted(_SIZES)}")
    return _SIZES[name]


def check_optimiser(name: str, lr: float, steps: int | None, max_seconds: float | None, batch_size: int) -> None:
    """What every optimisation config refuses when built, before any work: the schedule
    (:func:`check_schedule`), a learning rate that is not > 0, a batch size below 1."""
    check_schedule(steps, max_seconds, name)
    if not (math.isfinite(lr) and lr > 0):
        raise MMSpecError(f"{name} needs a learning rate > 0; got {lr}")
    if batch_size < 1:
        raise MMSpecError(f"{name} needs a batch size >= 1; got {batch_size}")


@dataclass(frozen=True)
class StageConfig:
    """One optimisation stage: AdamW, linear warm-up then cosine decay to 0, grad clipping.

    ``steps`` fixes the schedule length. With ``max_seconds`` the schedule runs on
    ``max(step/steps, elapsed/max_seconds)`` and the stage stops when either reaches 1, so a
    wall-clock budget is honoured (use ``max_seconds=None`` for bit-reproducible runs).
    """

    name: str
    trainable: Trainable
    lr: float
    steps: int | None  # None: max_seconds alone sets the schedule (the recipe presets always give steps)
    batch_size: int = 16
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_seconds: float | None = None
    pooled_tokens: int | None = None  # None: the full 8x8 grid (64 tokens per image)
    # Fraction of examples shown through the text view (each image -> "\n") or the caption
    # view (each image -> its caption). Not in the paper's recipe: our LMs have no text
    # pretraining, so a little of this keeps the T/C draft views in distribution.
    text_view_prob: float = 0.0
    caption_view_prob: float = 0.0

    def __post_init__(self) -> None:
        check_optimiser(self.name, self.lr, self.steps, self.max_seconds, self.batch_size)


@dataclass(frozen=True)
class RecipeConfig:
    """The whole embedded pack: tokenizer -> target stage 0/1/2 -> the target's answers -> draft 1/2 ->
    pooled -> captioner (:func:`mmspec.train.pack.run_pack`)."""

    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # CPU threads (mmspec.threads.apply_threads); None: the idle cores (its default)
    autocast_bf16: bool = True  # measured 1.4x faster on an AVX512-BF16 CPU
    n_train_per_family: int = 1500  # generation is cheap; fresh data beats repeated epochs
    n_eval_per_family: int = 4
    max_answer_tokens: int = 96
    target_size: str = "target"
    draft_size: str = "draft"
    captioner_size: str = "captioner"
    pooled_tokens: int = 16
    # Every target stage: this many image -> caption examples per QA example (a caption states all
    # of its image's facts in a few tokens: dense supervision for the vision tower), and the loss on
    # the answer tokens that state a fact, or decide an existence answer, weighed this many times
    # (``Encoder.fact_weight`` / ``cue_weight``). The shipped target's stages used 0.5-0.75 and 4 / 4.
    caption_mix: float = 0.5
    fact_weight: float = 4.0
    cue_weight: float = 4.0
    # Draft distillation: after draft stage 1 (the projector, on the reference answers), the draft's
    # later stages and the pooled draft train on the trained target's own greedy answers to this many
    # train samples per family (:mod:`mmspec.train.distill`), as the shipped drafts did. 0: they train
    # on the world's reference answers.
    distill_per_family: int = 200
    target_stages: tuple[StageConfig, ...] = field(default_factory=lambda: (
        StageConfig("target-stage0", "all", lr=1e-3, steps=1200, batch_size=8),
        StageConfig("target-stage1", "projector", lr=1e-3, steps=20, batch_size=8),
        StageConfig("target-stage2", "projector+lm", lr=5e-4, steps=1000, batch_size=8),
    ))
    draft_stages: tuple[StageConfig, ...] = field(default_factory=lambda: (
        StageConfig("draft-stage1", "projector", lr=1e-3, steps=30, batch_size=8),
        StageConfig("draft-stage2", "projector+lm", lr=1e-3, steps=500, batch_size=8,
                    text_view_prob=0.2, caption_view_prob=0.1),
    ))
    pooled_stage: StageConfig = field(default_factory=lambda: StageConfig(
        "draft-pooled", "projector+lm", lr=3e-4, steps=150, batch_size=8, pooled_tokens=16))
    captioner_stages: tuple[StageConfig, ...] = field(default_factory=lambda: (
        StageConfig("captioner-stage1", "projector", lr=1e-3, steps=20, batch_size=16),
        StageConfig("captioner-stage2", "projector+lm", lr=1e-3, steps=300, batch_size=16),
    ))

    def __post_init__(self) -> None:
        if not (math.isfinite(self.caption_mix) and self.caption_mix >= 0):
            raise MMSpecError(f"recipe: caption_mix must be a finite number >= 0; got {self.caption_mix}")
        for name in ("fact_weight", "cue_weight"):
            w = getattr(self, name)
            if not (math.isfinite(w) and w > 0):
                raise MMSpecError(f"recipe: {name} must be a finite number > 0 (1 weighs every answer token "
                                  f"alike); got {w}")
        if self.distill_per_family < 0:
            raise MMSpecError(f"recipe: distill_per_family must be >= 0 (0: no distillation); got "
                              f"{self.distill_per_family}")

    def scaled(self, factor: float) -> RecipeConfig:
        """The same recipe with every stage's step count multiplied by ``factor`` (>= 1 step)."""
        def s(st: StageConfig) -> StageConfig:
            return replace(st, steps=max(1, round(st.steps * factor)))
        return replace(self, target_stages=tuple(map(s, self.target_stages)),
                       draft_stages=tuple(map(s, self.draft_stages)),
                       pooled_stage=s(self.pooled_stage),
                       captioner_stages=tuple(map(s, self.captioner_stages)))


def build_llava(size: ModelSize, tokenizer, vision_tower: torch.nn.Module | None = None,
                ) -> LlavaForConditionalGeneration:
    """A randomly initialised LLaVA model of ``size`` for ``tokenizer``'s vocabulary.

    ``vision_tower``: an existing (trained) CLIP vision tower whose weights are copied in, so a
    draft or captioner shares the target's image encoder exactly. Its config must match
    ``size``'s vision fields. Uses the global torch RNG for initialisation (seed it first).
    """
    vision = CLIPVisionConfig(
        hidden_size=size.vision_hidden, intermediate_size=size.vision_intermediate,
        num_hidden_layers=size.vision_layers, num_attention_heads=size.vision_heads,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3, projection_dim=size.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size.lm_hidden, intermediate_size=size.lm_intermediate,
        num_hidden_layers=size.lm_layers, num_attention_heads=size.lm_heads,
        num_key_value_heads=size.lm_kv_heads or size.lm_heads, max_position_embeddings=size.max_positions,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=size.tie_embeddings,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", image_seq_length=GRID * GRID,
        tie_word_embeddings=size.tie_embeddings,
    )
    config.pad_token_id = tokenizer.pad_token_id
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if vision_tower is not None:
        try:
            model.model.vision_tower.load_state_dict(vision_tower.state_dict())
        except RuntimeError as exc:
            raise MMSpecError(f"vision tower does not fit size {size.name!r}: {exc}") from exc
    return model


def count_params(module: torch.nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def param_report(model: LlavaForConditionalGeneration) -> dict[str, int]:
    """Parameter counts per part: vision, projector, lm (embeddings included) and total."""
    inner = model.model
    return {
        "vision": count_params(inner.vision_tower),
        "projector": count_params(inner.multi_modal_projector),
        "lm": count_params(inner.language_model) + (0 if model.config.tie_word_embeddings
                                                   else count_params(model.lm_head)),
        "total": count_params(model),
    }
