"""The public entry point: :class:`SpecDecoder` checks its inputs, prepares the draft views and
prefills both models, then hands the loop to :func:`mmspec.engine.run_loop`.

Lossless by construction: at temperature 0 the output equals ``target.generate(do_sample=False)``
token for token; with sampling the output is distributed exactly as the target's.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from mmspec.drafter import EnsembleDrafter
from mmspec.engine import run_loop
from mmspec.errors import MMSpecError
from mmspec.graphs import StepRunner, graph_mode
from mmspec.models.base import adapter_for, same_vision
from mmspec.models.cache import supports_trees
from mmspec.models.pooling import valid_pool_sizes
from mmspec.multimodal import MultimodalInputs, _for_prefix
from mmspec.stats import GenerationStats
from mmspec.timing import sync
from mmspec.tree import parse_tree
from mmspec.verify import SamplingParams
from mmspec.views import View, ensemble_name, parse_views

# processor outputs generate() passes on to the families that read them (models/*.py: mm_keys)
MM_KEYS = ("image_sizes", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
           "second_per_grid_ts", "batch_num_images")


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str
    stats: GenerationStats
    seed: int | None = None  # the seed used for sampling (None for greedy)


class SpecDecoder(MultimodalInputs):
    """Lossless speculative decoding of a VLM target with an (ensemble of) draft view(s).

    Args:
        target, draft: loaded HF models, or local directories / hub ids. The draft may also be a
            feature-level head (:mod:`mmspec.heads`: a ``FeatureHead`` or a directory saved by
            ``mmspec train head``), which drafts from the target's own hidden states; ``views``
            and ``weights`` do not apply to it.
        tokenizer: the target's tokenizer (or a path); the draft must share its vocabulary.
        draft_tokenizer: the draft's own tokenizer (or a path), compared id by id with the
            target's base vocabulary; by default the one saved with a draft given as a path, if
            it has one.
        views: names ("multimodal", "text", "caption", "pooled:144") or letters ("M", "MTC").
        weights: one non-negative weight per view for the ensemble mixture (default equal).
        captioner: an object with ``caption(images) -> list[str]`` (or a path to an HF
            image-to-text model); required by the caption view.
        gamma: draft tokens proposed per block (the chain's length).
        tree: the block's shape (:mod:`mmspec.tree`): None or "chain" (gamma drafts in a chain);
            "dynamic" (EAGLE-2: ``tree_depth`` expansion steps of the ``tree_topk`` best
            frontier nodes, ``tree_budget`` best nodes verified; defaults measured per device);
            a static tree as child-rank paths ``[[0], [1], [0, 0], ...]``; or a TreeSpec.
        tree_children: "mixture" (children from the views' mixed distribution) or "views"
            (each view's own top tokens become siblings).
        stop_below: dynamic draft length for chains: stop a block's drafting when the draft's
            probability of its proposal falls below this (lossless; None: always gamma).
        cuda_graphs: "auto" (on when target and draft share one CUDA device), True, or False.
            Graphs need fixed shapes, so they run on static caches; the tokens are the same.
        static_cache: force the fixed-shape path without graphs (True; for tests on the CPU).
        acceptance: "exact" (the default: lossless) or "relaxed" — LOSSY, MSD's modality-aware
            relaxed acceptance: a drafted token is also accepted when the target's probability of
            it reaches ``relaxed_thresholds[0]`` (blocks within ``relaxed_window`` positions
            after the prompt's last image) or ``[1]`` (elsewhere). Greedy only; the output is no
            longer the target's: benchmarks report how often it still is.
        processor: the target's processor; only used to turn pixel_values back into images
            for the captioner when ``images=`` is not passed to :meth:`generate`.
        draft_processor: a draft of another family than the target (same tokenizer) reads the
            images its own way: its processor, applied to the PIL ``images=`` of :meth:`generate`.
        substitute: the draft's substitute encoder (:mod:`mmspec.models.substitute`, or its
            directory from ``mmspec train align``) for the substitute view (E): the draft reads
            each video as events (or fewer frames, lower resolution) instead of the frames.
    """

    def __init__(self, target, draft, tokenizer=None, *, views=("multimodal",), weights=None,
                 captioner=None, gamma: int = 5, processor=None, dtype="auto", draft_tokenizer=None,
                 tree=None, tree_depth: int | None = None, tree_topk: int | None = None,
                 tree_budget: int | None = None, tree_children: str = "mixture", stop_below: float | None = None,
                 cuda_graphs="auto", static_cache: bool | None = None, draft_processor=None, substitute=None,
                 acceptance: str = "exact",
                 relaxed_thresholds: tuple[float, float] = (0.6, 0.4), relaxed_window: int = 64):
        from mmspec.models.loading import (check_same_vocabulary, compute_dtype, load_model, load_processor,
                                           load_saved_tokenizer, load_tokenizer, load_tokenizer_if_any)

        dtype = compute_dtype(dtype, "cpu")  # models given as paths load on the CPU: "auto" means float32 there

        if tokenizer is None and isinstance(target, (str, os.PathLike)):
            tokenizer = str(target)
        if tokenizer is None:
            raise MMSpecError("pass the target's tokenizer (tokenizer=...)")
        if isinstance(processor, (str, os.PathLike)):
            processor = load_processor(str(processor))
        if processor is None and isinstance(target, (str, os.PathLike)):
            try:
                processor = load_processor(str(target))
            except MMSpecError:
                processor = None
        from mmspec.heads.model import FeatureHead, is_head_dir, load_head

        head_given = isinstance(draft, FeatureHead) or is_head_dir(draft)
        # tokenizers first: a draft of another vocabulary is refused before any weights load
        self.tokenizer = load_tokenizer(str(tokenizer)) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        if isinstance(draft_tokenizer, (str, os.PathLike)):  # asked for: must load
            draft_tokenizer = load_saved_tokenizer(str(draft_tokenizer))
        elif draft_tokenizer is None and isinstance(draft, (str, os.PathLike)) and not head_given:
            draft_tokenizer = load_tokenizer_if_any(str(draft))  # saved with the draft, if any
        self.draft_tokenizer = draft_tokenizer
        check_same_vocabulary(self.tokenizer, self.draft_tokenizer)
        self.target_model = load_model(str(target), dtype=dtype) if isinstance(target, (str, os.PathLike)) else target.eval()
        self.head: FeatureHead | None = None
        if head_given:
            from mmspec.heads.model import check_head_fits

            self.head = draft.eval() if isinstance(draft, FeatureHead) else load_head(draft, self.target_model)
            check_head_fits(self.head, self.target_model)
            self.draft_model = None
        else:
            self.draft_model = load_model(str(draft), dtype=dtype) if isinstance(draft, (str, os.PathLike)) else draft.eval()
        self.processor = processor
        if isinstance(draft_processor, (str, os.PathLike)):
            draft_processor = load_processor(str(draft_processor))
        self.draft_processor = draft_processor
        if substitute is not None and not isinstance(substitute, torch.nn.Module):
            from mmspec.models.substitute import load_substitute_encoder

            substitute = load_substitute_encoder(substitute)
        self.substitute = substitute
        if isinstance(captioner, (str, os.PathLike)):
            from mmspec.models.captioner import HFCaptioner

            captioner = HFCaptioner.from_pretrained(str(captioner))
        self.captioner = captioner

        self.target = adapter_for(self.target_model)
        self.draft = None if self.head is not None else adapter_for(self.draft_model)
        if not self.target.has_vision:
            raise MMSpecError(f"the target ({type(self.target_model).__name__}) is not a vision-language model; "
                              "pass an image-text-to-text checkpoint such as a LLaVA one as the target "
                              "(the draft may be text-only)")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise MMSpecError(f"gamma must be a whole number >= 1, got {gamma!r}")
        self.gamma = gamma
        self.tree = parse_tree(tree, gamma=gamma, device_type=self.target.device.type, depth=tree_depth,
                               topk=tree_topk, budget=tree_budget, children=tree_children, stop_below=stop_below)
        self._setup_engine(cuda_graphs, static_cache)
        self.acceptance = self._check_acceptance(acceptance, relaxed_thresholds, relaxed_window)
        if self.head is not None:  # a head reads the target's features: no views, no draft model
            self.views, self.weights, self.newline_id, self.reuse_vision = [], [1.0], None, False
        else:
            self.views = self._resolve_views(parse_views(views))
            self.weights = self._check_weights(weights)
            self._check_vocab()
            self.newline_id = self._newline_id()
            self.reuse_vision = same_vision(self.target, self.draft)
        self.eos_ids = self._eos_ids()
        self._check_generation_config()

    # ------------------------------------------------------------------ construction checks
    def _setup_engine(self, cuda_graphs, static_cache) -> None:
        """Decide eager / static / CUDA-graph decoding and check the tree fits the models."""
        probes = [self.target.new_cache(8), (self.head or self.draft).new_cache(8)]
        full_attention = all(supports_trees(c) for c in probes)
        if not self.tree.is_chain and not full_attention:
            raise MMSpecError("token trees need models whose layers are all full attention (their caches are "
                              "compacted after each block); this target or draft has sliding-window or other "
                              "layers: use tree=None (a chain)")
        dispatched = any(len(set(getattr(m, "hf_device_map", {}).values())) > 1
                         for m in (self.target_model, self.draft_model) if m is not None)
        draft_device = self.draft.device if self.draft is not None else next(self.head.parameters()).device
        mode = graph_mode(cuda_graphs, self.target.device, draft_device)
        if mode != "eager" and (dispatched or not full_attention):
            if cuda_graphs is True:
                raise MMSpecError("cuda_graphs=True needs both models on one device with full-attention layers "
                                  "only; use cuda_graphs='auto' to fall back to eager decoding")
            mode = "eager"
        self.graph_mode = mode
        self.static = mode != "eager" or bool(static_cache and full_attention)
        self.engine = "cuda-graphs" if mode == "cuda" else ("static" if self.static else "eager")
        self._static_pool: dict[tuple, tuple] = {}  # (role, rows, capacity) -> (cache, runner)

    def _check_acceptance(self, acceptance: str, thresholds, window: int):
        """"exact" -> None; "relaxed" -> the (lossy) RelaxedAcceptance settings, checked."""
        from mmspec.engine import RelaxedAcceptance

        if acceptance == "exact":
            return None
        if acceptance != "relaxed":
            raise MMSpecError(f"acceptance must be 'exact' (lossless) or 'relaxed' (lossy: MSD's relaxed "
                              f"acceptance), got {acceptance!r}")
        vision, text = (float(t) for t in thresholds)
        if not (0 < vision <= 1 and 0 < text <= 1):
            raise MMSpecError(f"relaxed_thresholds must be two probabilities in (0, 1] (vision, text), got {thresholds}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise MMSpecError(f"relaxed_window must be a whole number >= 0, got {window!r}")
        return RelaxedAcceptance(vision=vision, text=text, window=window)

    def _static_cache(self, role: str, adapter, rows: int, needed: int):
        """A static cache of at least ``needed`` positions and the runner of its forwards, kept
        across calls (capacities are bucketed to powers of two, so graphs are reused)."""
        capacity = max(512, 1 << (needed - 1).bit_length())
        key = (role, rows, capacity)
        if key not in self._static_pool:
            cache = adapter.new_cache(capacity, static=True)
            hidden = self._hidden_layers if role == "target" else ()
            runner = StepRunner(_token_forward(adapter, cache, hidden), cache, mode=self.graph_mode, name=role)
            self._static_pool[key] = (cache, runner)
        return self._static_pool[key]

    def _resolve_views(self, views: list[View]) -> list[View]:
        out = []
        for v in views:
            if v.needs_vision and not self.draft.has_vision:
                raise MMSpecError(
                    f"the {v.name} view needs a vision-language draft, but the draft "
                    f"({type(self.draft_model).__name__}) has no vision tower; use the text or "
                    "caption views with a text-only draft"
                )
            if v.kind == "substitute":
                if self.substitute is None:
                    raise MMSpecError("the substitute view (E) needs the draft's substitute encoder: pass substitute=DIR "
                                      "(made by mmspec train align) or a SubstituteEncoder")
                if self.substitute.config.out_size != self.draft.model.get_input_embeddings().weight.shape[1]:
                    raise MMSpecError(f"the substitute encoder gives {self.substitute.config.out_size}-wide tokens but the "
                                      "draft's embeddings are of another width: align it to this draft "
                                      "(mmspec train align --draft DIR)")
            if v.kind == "caption" and self.captioner is None:
                raise MMSpecError(
                    "the caption view needs a captioner: pass captioner=HFCaptioner.from_pretrained(...)"
                    " (e.g. a BLIP or Florence-2 directory) or --captioner on the command line"
                )
            if v.kind == "pooled" and getattr(self.draft, "tokens_per_image", None) is None:
                v = View("pooled", v.n_tokens or 16)  # dynamic resolution: any size (adaptive pooling)
            elif v.kind == "pooled":
                if self.draft.tokens_per_image != self.draft.patch_grid ** 2:
                    raise MMSpecError(
                        f"the pooled view pools the draft's patch grid, but the draft keeps the CLS token "
                        f"in its image features (vision_feature_select_strategy="
                        f"{getattr(self.draft, 'select_strategy', None)!r}); use the multimodal, text or "
                        "caption view with this draft")
                grid = self.draft.patch_grid
                default_n = (grid // 2) ** 2 if grid % 2 == 0 else 1  # paper: 576 -> 144
                n = v.n_tokens or default_n
                if n not in valid_pool_sizes(grid):
                    raise MMSpecError(
                        f"pooled:{n} is not reachable from the draft's {grid}x{grid} patch grid; "
                        f"choose one of pooled:{valid_pool_sizes(grid)}"
                    )
                v = View("pooled", n)
            out.append(v)
        return out

    def _check_weights(self, weights) -> list[float]:
        if weights is None:
            return [1.0] * len(self.views)
        weights = [float(w) for w in weights]
        if len(weights) != len(self.views):
            raise MMSpecError(f"{len(weights)} weights for {len(self.views)} views; give one weight per view")
        if not all(math.isfinite(w) for w in weights):
            raise MMSpecError(f"ensemble weights must be finite numbers, got {weights}")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise MMSpecError(f"ensemble weights must be >= 0 with a positive sum, got {weights}")
        return weights

    def _check_vocab(self) -> None:
        vt, vd = self.target.vocab_size, self.draft.vocab_size
        if vd > vt:
            raise MMSpecError(
                f"draft and target have different vocabularies: the draft scores {vd} tokens, the "
                f"target {vt}. Speculative decoding needs the draft to use the target's tokenizer; "
                "pick a draft trained with the same vocabulary"
            )
        tok_v = len(self.tokenizer)
        if tok_v > vt:
            raise MMSpecError(f"the tokenizer has {tok_v} tokens but the target only scores {vt}; "
                              "pass the target's own tokenizer")
        # ids the draft cannot score are fine when all are tokens added on top of the base vocabulary
        # (llava-hf's <image> and <pad>): a draft never needs to propose them, and the target
        # verifies every token anyway
        added = {int(i) for i in getattr(self.tokenizer, "added_tokens_decoder", {})}
        if vd < tok_v and not set(range(vd, tok_v)) <= added:
            raise MMSpecError(
                f"draft and target have different vocabularies: the tokenizer has {tok_v} tokens "
                f"but the draft scores only {vd}; pick a draft trained with the target's tokenizer"
            )

    def _newline_id(self) -> int | None:
        for i in self.tokenizer.encode("\n", add_special_tokens=False):
            if self.tokenizer.decode([i]) == "\n":
                return int(i)
        if any(v.kind == "text" for v in self.views):
            raise MMSpecError("the text view needs a newline token, but this tokenizer has none")
        return None

    def _eos_ids(self) -> frozenset[int]:
        eos = getattr(self.target_model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])

    # settings of the target's generation_config that change which token generate() picks;
    # mmspec reproduces plain greedy / temperature sampling, so it refuses rather than diverge
    _PROCESSORS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "min_length": 0, "min_new_tokens": 0, "bad_words_ids": None, "suppress_tokens": None,
                   "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None,
                   "forced_eos_token_id": None}

    def _check_generation_config(self) -> None:
        gc = self.target_model.generation_config
        active = [k for k, neutral in self._PROCESSORS.items()
                  if getattr(gc, k, None) not in (None, neutral, [])]
        if active:
            raise MMSpecError(
                f"the target's generation_config sets {active}, which changes the tokens "
                "target.generate() picks; mmspec reproduces plain greedy decoding and sampling, so "
                "its output would differ. Reset them (e.g. target.generation_config.repetition_penalty = 1.0)"
            )

    @property
    def method(self) -> str:
        """The views' short name (or the head's variant), with "+tree" when blocks are trees
        ("M", "MTC+tree", "eagle+tree")."""
        name = self.head.config.variant if self.head is not None else ensemble_name(self.views)
        return name + ("" if self.tree.kind == "chain" else "+tree") + ("+relaxed" if self.acceptance else "")

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, input_ids, pixel_values=None, attention_mask=None, *, max_new_tokens: int = 128,
                 temperature: float = 0.0, seed: int | None = None, top_k: int | None = None,
                 top_p: float | None = None, images: Sequence | None = None,
                 captions: Sequence[str] | None = None, videos: Sequence | None = None,
                 substitutes: Sequence | None = None, **unused) -> GenerationResult:
        """Decode one prompt. Inputs are those of ``target.generate`` (the processor's output: for
        other families also ``image_sizes``, ``image_grid_thw``, ``pixel_values_videos``,
        ``video_grid_thw``, ``mm_token_type_ids``, ... as the target's family reads them; Video-LLaVA's
        ``pixel_values_images`` is taken as ``pixel_values``). ``images``: the PIL pictures, one per
        image or video in prompt order (a video's: a frame of it), for the captioner, and one per
        image for a draft with a processor of its own."""
        if unused.get("do_sample"):
            raise MMSpecError("pass temperature=... (> 0) for sampling instead of do_sample=True")
        mm = {k: v for k, v in unused.items() if k in self.target.mm_keys or k in MM_KEYS}
        unknown = set(unused) - {"do_sample"} - set(mm)
        if unknown:
            raise MMSpecError(f"unsupported generate() argument(s): {sorted(unknown)}")
        if mm.get("pixel_values_images") is not None:  # Video-LLaVA's older name for its images
            if pixel_values is not None:
                raise MMSpecError("the images were given twice (pixel_values and pixel_values_images); pass them once")
            pixel_values = mm.pop("pixel_values_images")
        mm["pixel_values"] = pixel_values
        t_start = time.perf_counter()
        dev = self.target.device
        ids = self._check_ids(input_ids, attention_mask)  # [L] on CPU
        if max_new_tokens < 1:
            raise MMSpecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p)
        if self.acceptance is not None and not params.greedy:
            raise MMSpecError("acceptance='relaxed' is defined for greedy decoding only; use temperature=0 "
                              "or the exact (lossless) acceptance for sampling")
        generator = None
        if not params.greedy:
            seed = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            generator = _generator(seed, dev)
        else:
            seed = None

        layout = self._layout(ids, mm)
        self._check_context(ids.shape[0], max_new_tokens)
        stats = self._new_stats()

        # 1) vision: each image / video encoded once (patches shared with the draft when towers match)
        target_feats, draft_feats = self._encode_vision(layout, mm, images, stats)
        # 2) captions, once per image or video; substitutes (events, ...), once per video
        caption_ids = self._caption_ids(layout, mm, images, captions, stats)
        if any(v.needs_substitute for v in self.views):
            draft_feats = {**(draft_feats or {}), **self._substitute_feats(layout, videos, substitutes, stats)}

        # 3) target prefill on all but the last prompt token (it is the first pending token)
        t0 = time.perf_counter()
        L = ids.shape[0]
        target_cache, target_step = self._target_cache(L + self._room(max_new_tokens))
        prefix = ids[:-1].to(dev)[None]  # [1, L-1], never empty: prompts have >= 2 tokens (_check_ids)
        embeds = self.target.embed(prefix)  # [1, L-1, H_t]
        for token, kind in self.target.placeholders().items():  # each run of placeholders gets its features
            if target_feats.get(kind):
                mask = (prefix == token).unsqueeze(-1)  # [1, L-1, 1]
                feats = torch.cat(target_feats[kind])  # [n_tokens, H_t]
                if feats.shape[0] != int(mask.sum()):  # masked_scatter would silently drop the surplus
                    raise MMSpecError(f"the target's {kind} features ({feats.shape[0]}) do not fill its "
                                      f"{int(mask.sum())} {kind} tokens: this family's adapter counted them wrong")
                embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
        if self.static:
            attn = torch.ones(L - 1, target_cache.max_len, dtype=torch.bool, device=dev).tril()[None, None]
        else:
            attn = torch.ones_like(prefix)
        positions, next_pos = self.target.prefill_positions(prefix, _for_prefix(mm, prefix))
        pos_offset = int(next_pos[0]) - (L - 1)  # multimodal RoPE: text after the prompt is not at past + i
        out = self.target.forward(cache=target_cache, attention_mask=attn, position_ids=positions,
                                  inputs_embeds=embeds, logits_to_keep=1, hidden=self._hidden_layers)
        sync(dev)
        stats.prefill_target_s = time.perf_counter() - t0

        # 4) draft prefill: every view one row of one batch (or the head, over the target's features)
        first_feats = None
        if self.head is not None:
            feats = out[1]  # [1, L - 1, F] the target's features at every prompt position, images included
            drafter = self._prefill_head(feats, ids, max_new_tokens, stats)
            first_feats = feats[0, -1:]  # before the pending token
        else:
            drafter = self._prefill_draft(layout, draft_feats, caption_ids, max_new_tokens, stats)

        captured = self._capture_seconds()
        tokens = run_loop(target=self.target, target_cache=target_cache, target_step=target_step, target_len=L - 1,
                          drafter=drafter, spec=self.tree, first_pending=int(ids[-1]), max_new_tokens=max_new_tokens,
                          eos_ids=self.eos_ids, params=params, generator=generator, stats=stats, static=self.static,
                          first_feats=first_feats, relaxed=self._relaxed_for(ids), pos_offset=pos_offset)
        stats.capture_s = self._capture_seconds() - captured
        stats.total_s = time.perf_counter() - t_start
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(token_ids=tokens, text=text, stats=stats, seed=seed)

    # ------------------------------------------------------------------ pieces of generate
    @torch.inference_mode()
    def new_drafter(self, input_ids, pixel_values=None, *, max_new_tokens: int = 128,
                    images: Sequence | None = None, captions: Sequence[str] | None = None,
                    cache=None) -> EnsembleDrafter:
        """The draft side of :meth:`generate` alone: vision, captions and the prefilled ensemble
        drafter for this prompt (its last token not fed). Used to time draft steps in isolation;
        ``cache`` runs it on a cache of the caller's (e.g. a ``DynamicCache``, to compare)."""
        if self.head is not None:
            raise MMSpecError("new_drafter times token-level drafters; a head drafts inside generate()")
        ids = self._check_ids(input_ids, None)
        mm = {"pixel_values": pixel_values}
        layout = self._layout(ids, mm)
        stats = self._new_stats()
        _, draft_feats = self._encode_vision(layout, mm, images, stats)
        caption_ids = self._caption_ids(layout, mm, images, captions, stats)
        return self._prefill_draft(layout, draft_feats, caption_ids, max_new_tokens, stats, cache)

    def _new_stats(self) -> GenerationStats:
        return GenerationStats(gamma=self.tree.max_depth, views=tuple(v.name for v in self.views),
                               tree=self.tree.label, engine=self.engine,
                               acceptance="exact" if self.acceptance is None else "relaxed (lossy)")

    def _room(self, max_new_tokens: int) -> int:
        """Positions a decode can append after the prompt: committed tokens + one block's tree."""
        return max_new_tokens + self.tree.n_nodes + 1

    def _relaxed_for(self, ids: torch.Tensor):
        """The relaxed-acceptance settings with this prompt's last image position, or None."""
        if self.acceptance is None:
            return None
        from dataclasses import replace

        img = (ids == self.target.image_token_id).nonzero()
        return replace(self.acceptance, last_image_pos=int(img[-1, 0]) if img.numel() else None)

    @property
    def _hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the draft reads (a head's), else none."""
        return self.head.config.feature_layers if self.head is not None else ()

    def _target_cache(self, needed: int):
        """The target's cache for one decode and the function that runs its block forwards."""
        if not self.static:
            cache = self.target.new_cache(needed)  # preallocated, O(1) roll-back
            return cache, _token_forward(self.target, cache, self._hidden_layers)
        cache, runner = self._static_cache("target", self.target, 1, needed)
        cache.reset()
        return cache, runner

    def _prefill_head(self, feats, ids, max_new_tokens: int, stats: GenerationStats):
        from mmspec.heads.drafter import HeadDrafter

        t0 = time.perf_counter()
        room = self._room(max_new_tokens)
        cache = runner = None
        drafter = HeadDrafter(self.head, self.target, room, static=self.static)
        if self.static:
            capacity = max(512, 1 << (ids.shape[0] + room - 1).bit_length())
            key = ("head", 1, capacity)
            if key not in self._static_pool:
                cache = self.head.new_cache(capacity, static=True)
                self._static_pool[key] = (cache, StepRunner(_head_forward(self.head, cache), cache,
                                                            mode=self.graph_mode, name="draft head"))
            cache, runner = self._static_pool[key]
            drafter.cache, drafter.step_fn = cache, runner
        drafter.prefill(feats, ids)
        sync(self.target.device)
        stats.prefill_draft_s = time.perf_counter() - t0
        return drafter

    def _capture_seconds(self) -> float:
        return sum(r.capture_s for _, r in self._static_pool.values())

    def _check_ids(self, input_ids, attention_mask) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise MMSpecError(
                    f"input_ids has batch size {ids.shape[0]}; SpecDecoder decodes one prompt at a "
                    "time (the batch dimension is used by the draft views). Loop over prompts."
                )
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise MMSpecError(f"input_ids must be [1, L] or [L] with L >= 2, got shape {tuple(ids.shape)}")
        if attention_mask is not None:
            m = torch.as_tensor(attention_mask).reshape(-1).bool().cpu()
            if m.shape[0] != ids.shape[0]:
                raise MMSpecError("attention_mask and input_ids have different lengths")
            if not m.any():
                raise MMSpecError("attention_mask is all zeros: it masks out the whole prompt; pass the "
                                  "processor's mask (ones over the prompt, zeros only on left padding)")
            first = int(m.nonzero()[0, 0])
            if not m[first:].all():
                raise MMSpecError("attention_mask has holes; only left padding is supported")
            ids = ids[first:]
        if ids.shape[0] < 2:  # each draft row holds the prompt less its last (pending) token
            raise MMSpecError(f"the prompt has {ids.shape[0]} token; speculative decoding needs at least 2 "
                              "(build it with the processor: the bos token, the chat template and the text)")
        return ids.long().cpu()

    def _draft_positions(self) -> str:
        """How the block's draft depth is set, for error messages."""
        return f"gamma={self.gamma}" if self.tree.kind == "chain" else f"a tree {self.tree.max_depth} deep"

    def _check_context(self, prompt_len: int, max_new_tokens: int) -> None:
        limit = self.target.max_positions
        depth = self.tree.max_depth
        if limit is not None and prompt_len + max_new_tokens + depth > limit:
            raise MMSpecError(
                f"the prompt ({prompt_len} tokens, images expanded) plus max_new_tokens={max_new_tokens} plus "
                f"{self._draft_positions()} draft positions ({prompt_len + max_new_tokens + depth} in all) exceeds "
                f"the target's context length of {limit} tokens; lower gamma (or the tree depth) or "
                "max_new_tokens, shorten the prompt or use fewer images"
            )

    def _check_draft_context(self, view: View, row_len: int, max_new_tokens: int) -> None:
        limit = self.draft.max_positions
        depth = self.tree.max_depth
        if limit is not None and row_len + max_new_tokens + depth > limit:
            raise MMSpecError(
                f"the {view.name} view's draft prompt ({row_len} tokens) plus max_new_tokens="
                f"{max_new_tokens} plus {self._draft_positions()} draft positions exceeds the draft's context "
                f"length of {limit}; lower gamma (or the tree depth) or max_new_tokens, or use a view with "
                "fewer image tokens (text, caption or pooled:N)"
            )

def _token_forward(adapter, cache, hidden: tuple[int, ...] = ()):
    """The fixed-shape forward of one model on one cache: ids, position ids and mask in, logits
    out (and the hidden states of ``hidden`` layers, for a head, from the same forward)."""
    def fn(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor):
        return adapter.forward(cache=cache, attention_mask=mask, position_ids=pos, input_ids=ids, hidden=hidden)
    return fn


def _head_forward(head, cache):
    """A head's fixed-shape forward on its cache: features, embeddings, positions, mask in."""
    def fn(feats: torch.Tensor, embeds: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return head(feats, embeds, cache=cache, position_ids=pos, attention_mask=mask)
    return fn


def _generator(seed: int, device: torch.device) -> torch.Generator:
    """The explicit generator of one sampling call: a CPU generator seeded with ``seed``; on a
    GPU, a generator on that device seeded from it, so uniforms never cross to the host."""
    cpu = torch.Generator().manual_seed(seed)
    if device.type == "cpu":
        return cpu
    gen = torch.Generator(device=device)
    gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=cpu)))
    return gen


