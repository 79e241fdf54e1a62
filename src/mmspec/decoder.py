"""The public entry point: :class:`SpecDecoder` loads and checks its models and inputs and
prepares each request's prompt (its images encoded, its draft rows, the prefix cache matched,
the target's prefill inputs); every decode, one request (``generate``, ``stream``) or many
(``generate_batch``, ``mmspec serve``), runs on the one engine (:mod:`mmspec.engine`: a request is
a row of :class:`~mmspec.engine.step.Engine`, ``generate`` a batch of one).

Owns the keyword API and its grouping into typed settings (:class:`~mmspec.options.EngineOptions`,
:class:`~mmspec.options.AcceptanceConfig`, :class:`~mmspec.options.EngineMode`) and the engine it
keeps across calls with static shapes (:class:`~mmspec.runtime.graphs.StaticPool`). The prompt's
images, captions and draft rows are :class:`~mmspec.multimodal.MultimodalPrompt`'s; the checks
of the arguments are :mod:`mmspec.checks`', gathered per request by :func:`mmspec.request.prepare`.

Lossless by construction: at temperature 0 the output equals ``target.generate(do_sample=False)``
token for token; with sampling the output is distributed exactly as the target's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mmspec import checks
from mmspec.config import DecoderConfig
from mmspec.constrain.tails import FORCED_TAIL
from mmspec.drafting.adaptive import AdaptiveWeights
from mmspec.drafting.lookup import SuffixStore, history, proposer_for
from mmspec.drafting.tree import TreeSpec, parse_shapes
from mmspec.drafting.views import View, ensemble_name, parse_views
from mmspec.engine.policy import SpeculationPolicy
from mmspec.errors import MMSpecError
from mmspec.heads.directory import is_head_dir, load_head
from mmspec.heads.model import FeatureHead, check_head_fits
from mmspec.models.base import adapter_for, same_vision
from mmspec.models.captioner import HFCaptioner
from mmspec.models.loading import (
    check_same_vocabulary,
    compute_dtype,
    load_model,
    load_processor,
    load_saved_tokenizer,
    load_tokenizer,
    load_tokenizer_if_any,
)
from mmspec.models.substitute import load_substitute_encoder
from mmspec.multimodal import EncodedPrompt, MultimodalPrompt, for_prefix
from mmspec.options import AcceptanceConfig, EngineMode, EngineOptions, RelaxedAcceptance
from mmspec.prefix_cache import (
    PrefixCache,
    PrefixMatch,
    PromptKeys,
    check_budget,
    prompt_keys,
    segment_digests,
)
from mmspec.request import MAX_NEW_TOKENS, check_context, prepare
from mmspec.results import GenerationResult
from mmspec.runtime.graphs import StaticPool, graph_mode
from mmspec.stats import GenerationStats
from mmspec.streaming import TextStream

# processor outputs generate() passes on to the families that read them (models/*.py: mm_keys)
MM_KEYS = ("image_sizes", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
           "second_per_grid_ts", "batch_num_images")


@dataclass
class EncodedRequest:
    """One request after :meth:`SpecDecoder.encode_prompt`: its images encoded, its draft rows,
    and what the prefix cache holds of its prompt; its caches not yet prefilled."""

    ids: torch.Tensor  # [L] the prompt
    mm: dict
    encoded: EncodedPrompt
    rows: list  # the draft views' rows (ViewRow), [] without a draft model
    keys: PromptKeys | None  # the prompt's content keys (None: prefix caching off)
    match: PrefixMatch | None  # what the prefix cache holds of it
    captions: Sequence[str] | None = None


@dataclass
class TargetInputs:
    """The target's prefill inputs for one request (:meth:`SpecDecoder.target_inputs`)."""

    embeds: torch.Tensor  # [1, n, H_t]: the prompt less its pending token and the reused positions
    positions: torch.Tensor  # [1, n] (or M-RoPE's [3, 1, n])
    reused: int  # positions the prefix cache holds, before these
    pos_offset: int  # a token's position minus its cache slot after the prompt (M-RoPE's delta; else 0)


class SpecDecoder:
    """Lossless speculative decoding of a VLM target with an (ensemble of) draft view(s).

    Options come as flat keywords (below) or grouped in one typed :class:`~mmspec.config.DecoderConfig`
    (``config=DecoderConfig(tree=TreeConfig(gamma=3), ...)``; keywords given beside it override its
    fields); an unknown keyword is refused, naming the closest. ``self.config`` holds them grouped:
    ``draft`` (views, weights, captioner, draft_tokenizer, draft_processor, substitute, model_free,
    lookup_options, check_head), ``tree`` (gamma, tree, tree_depth, tree_topk, tree_budget,
    tree_children, stop_below), ``runtime`` (dtype, cuda_graphs, static_cache, prefix_cache_mb),
    ``acceptance`` (acceptance, relaxed_thresholds, relaxed_window).

    Args:
        target, draft: loaded HF models, or local directories / hub ids. The draft may also be a
            feature-level head (:mod:`mmspec.heads`: a ``FeatureHead`` or a directory saved by
            ``mmspec train head``), which drafts from the target's own hidden states alone:
            ``views`` (other than the default), ``weights``, ``captioner``, ``draft_processor``
            and ``substitute`` do not apply to it and are refused. ``check_head=True`` runs a short
            calibration on load (:func:`mmspec.heads.check.calibrate`: 4 world prompts) into
            ``self.head_report`` (τ, acceptance by depth, the layers read) and warns when τ is near 1.
        tokenizer: the target's tokenizer (or a path); the draft must share its vocabulary.
        draft_tokenizer: the draft's own tokenizer (or a path), compared id by id with the
            target's base vocabulary; by default the one saved with a draft given as a path, if
            it has one.
        views: names ("multimodal", "text", "caption", "pooled:144") or letters ("M", "MTC").
        weights: one non-negative weight per view for the ensemble mixture (default equal); or
            ``"adaptive"`` (TABED: per request, after every block, each view's weight follows how
            well its own distribution predicted the tokens the target confirmed; lossless, as the
            mixture is still the q verification uses), ``"adaptive:loglik"``, or an
            :class:`~mmspec.drafting.adaptive.AdaptiveWeights` for the rule's options. The weights every
            block drafted with are in ``stats.view_weights``; ``generate(initial_weights=...)``
            starts a request from an earlier one's ``stats.final_weights`` (a conversation's turn).
        captioner: an object with ``caption(images) -> list[str]`` (or a path to an HF
            image-to-text model); required by the caption view.
        gamma: draft tokens proposed per block (the chain's length; default 5); also the chain
            ``tree="auto"`` measures. Refused with a tree that is no chain, which would ignore it.
        tree: the block's shape (:mod:`mmspec.drafting.tree`): None or "chain" (gamma drafts in a chain);
            "dynamic" (EAGLE-2: ``tree_depth`` expansion steps of the ``tree_topk`` best
            frontier nodes, ``tree_budget`` best nodes verified; defaults measured per device);
            a static tree as child-rank paths ``[[0], [1], [0, 0], ...]``; a TreeSpec; or "auto":
            per step the chain of ``gamma`` or the device's dynamic tree at one of two budgets,
            whichever gives the most measured tokens per second on this device at the batch size
            (:class:`~mmspec.engine.policy.SpeculationPolicy`; its figures in ``stats.shape_rates``;
            lossless whatever it picks, though a seeded request's draws then follow the picks).
        tree_children: "mixture" (children from the views' mixed distribution) or "views"
            (each view's own top tokens become siblings).
        stop_below: dynamic draft length for chains: stop a block's drafting when the draft's
            probability of its proposal falls below this (lossless; None: always gamma).
        cuda_graphs: "auto" (on when target and draft share one CUDA device), True, or False.
            Graphs need fixed shapes, so they run on static caches; the tokens are the same.
        static_cache: force the fixed-shape path without graphs (True; for tests on the CPU).
        compile: the target's and the draft's step forwards through ``torch.compile`` (mode
            "default": inductor's fused kernels for norms, rotary embeddings, casts; one compilation
            per shape, so on static caches), captured by the step's CUDA graph as eager kernels
            are. Seconds spent compiling: ``stats.compile_s``. If compiling fails: one warning and
            the uncompiled forwards; the tokens are the same either way.
        acceptance: "exact" (the default: lossless) or "relaxed" — LOSSY, MSD's modality-aware
            relaxed acceptance: a drafted token is also accepted when the target's probability of
            it reaches ``relaxed_thresholds[0]`` (blocks within ``relaxed_window`` positions
            after the prompt's last image) or ``[1]`` (elsewhere). Greedy only; the output is no
            longer the target's: benchmarks report how often it still is. ``relaxed_thresholds``
            and ``relaxed_window`` are refused with the exact acceptance.
        processor: the target's processor; only used to turn pixel_values back into images
            for the captioner when ``images=`` is not passed to :meth:`generate`.
        draft_processor: a draft of another family than the target (same tokenizer) reads the
            images its own way: its processor, applied to the PIL ``images=`` of :meth:`generate`.
        substitute: the draft's substitute encoder (:mod:`mmspec.models.substitute`, or its
            directory from ``mmspec train align``) for the substitute view (E): the draft reads
            each video as events (or fewer frames, lower resolution) instead of the frames.
        prefix_cache_mb: memory (MiB, on the models' devices) for automatic prefix caching
            (:mod:`mmspec.prefix_cache`): the target's, draft rows' and head's caches and the
            encoded images of recent prompts are kept, least recently used evicted first, and a
            prompt extending one (a conversation's next turn) prefills only its new suffix
            (``stats.prompt_tokens_reused``). 0 turns it off. Not used with the substitute
            view (E) or models with sliding-window layers.
        draft="lookup" / "suffix": drafting with no model (:mod:`mmspec.drafting.lookup`): prompt lookup
            over the request's own text, or suffix decoding over it and this decoder's earlier
            prompts and answers; the target alone is enough. Options that shape a draft model's
            drafting (views, weights, captioner, draft_processor, substitute, draft_tokenizer,
            tree_children="views") are refused with it.
        model_free: "lookup" or "suffix" beside a draft model or head: each block's proposal is
            added to the draft's tree as other branches, verified in the same forward.
        lookup_options: the model-free drafters' settings, a dict of
            :class:`~mmspec.drafting.lookup.LookupConfig`'s fields (n-gram sizes, candidates, the suffix
            store's depth, memory, speculation factor and probability floor), bounds checked.
    """

    def __init__(self, target, draft, tokenizer=None, *, processor=None, config: DecoderConfig | None = None,
                 **options):
        cfg = DecoderConfig.of(config, **options)  # the keywords above, grouped (unknown ones refused)
        self.config = cfg
        d, t = cfg.draft, cfg.tree
        # checks that need no model: before anything loads
        alone = checks.model_free_name(draft)  # "lookup" / "suffix": drafting with no model
        head_given = alone is None and (isinstance(draft, FeatureHead) or is_head_dir(draft))
        self.lookup = checks.check_model_free(alone, d.model_free, d.lookup_options, views=d.views, weights=d.weights,
                                              captioner=d.captioner, draft_processor=d.draft_processor,
                                              substitute=d.substitute, draft_tokenizer=d.draft_tokenizer,
                                              tree_children=t.tree_children)
        self.model_free = alone or d.model_free  # None: a draft model or head alone
        self.model_free_alone = alone is not None
        if alone is not None:
            draft = None
        elif head_given:
            checks.check_head_arguments(d.views, d.weights, d.captioner, d.draft_processor, d.substitute)
        elif d.draft_processor is not None:
            checks.check_draft_processor_is_read(d.views)
        acceptance_cfg = AcceptanceConfig.parse(cfg.acceptance.acceptance, cfg.acceptance.relaxed_thresholds,
                                                cfg.acceptance.relaxed_window)
        prefix_mb = check_budget(cfg.runtime.prefix_cache_mb)
        self.max_logprobs = checks.check_max_logprobs(cfg.runtime.max_logprobs)
        self.gamma = checks.check_gamma(t.gamma, t.tree)  # given with a tree that is no chain: refused
        checks.check_dtype(cfg.runtime.dtype, target, draft, head_given)
        dtype = compute_dtype(cfg.runtime.dtype, "cpu")  # models given as paths load on the CPU: "auto" means float32 there

        if tokenizer is None and checks.is_path(target):
            tokenizer = str(target)
        if tokenizer is None:
            raise MMSpecError("pass the target's tokenizer (tokenizer=...)")
        if checks.is_path(processor):
            processor = load_processor(str(processor))
        if processor is None and checks.is_path(target):
            try:
                processor = load_processor(str(target))
            except MMSpecError:
                processor = None
        # tokenizers first: a draft of another vocabulary is refused before any weights load
        self.tokenizer = load_tokenizer(str(tokenizer)) if checks.is_path(tokenizer) else tokenizer
        draft_tokenizer = d.draft_tokenizer
        if checks.is_path(draft_tokenizer):  # asked for: must load
            draft_tokenizer = load_saved_tokenizer(str(draft_tokenizer))
        elif draft_tokenizer is None and checks.is_path(draft) and not head_given and alone is None:
            draft_tokenizer = load_tokenizer_if_any(str(draft))  # saved with the draft, if any
        self.draft_tokenizer = draft_tokenizer
        check_same_vocabulary(self.tokenizer, self.draft_tokenizer)
        self.target_model = load_model(str(target), dtype=dtype) if checks.is_path(target) else target.eval()
        self.head: FeatureHead | None = None
        self.draft_model = None
        if head_given:
            self.head = draft.eval() if isinstance(draft, FeatureHead) else load_head(draft, self.target_model)
            check_head_fits(self.head, self.target_model)
        elif alone is None:
            self.draft_model = load_model(str(draft), dtype=dtype) if checks.is_path(draft) else draft.eval()
        self.processor = processor
        self.draft_processor = load_processor(str(d.draft_processor)) if checks.is_path(d.draft_processor) \
            else d.draft_processor
        substitute = d.substitute
        if substitute is not None and not isinstance(substitute, torch.nn.Module):
            substitute = load_substitute_encoder(substitute)
        self.substitute = substitute
        self.captioner = HFCaptioner.from_pretrained(str(d.captioner)) if checks.is_path(d.captioner) else d.captioner

        self.target = adapter_for(self.target_model)
        self.draft = None if self.draft_model is None else adapter_for(self.draft_model)
        if not self.target.has_vision:
            raise MMSpecError(f"the target ({type(self.target_model).__name__}) is not a vision-language model; "
                              "pass an image-text-to-text checkpoint such as a LLaVA one as the target "
                              "(the draft may be text-only)")
        self.tree_shapes = parse_shapes(t.tree, gamma=self.gamma, device_type=self.target.device.type,
                                        depth=t.tree_depth, topk=t.tree_topk, budget=t.tree_budget,
                                        children=t.tree_children, stop_below=t.stop_below)  # one, or tree="auto"'s
        self.tree = self.tree_shapes[-1]  # the largest: every block, cache and buffer is sized for it
        if self.tree.kind == "chain":
            self.gamma = self.tree.depth  # a TreeSpec chain given: its own length
        draft_vocab = self.target.vocab_size if self.draft is None else self.draft.vocab_size
        checks.check_tree_fits_vocab(self.tree, min(self.target.vocab_size, draft_vocab))
        self.adaptive = None if self.draft is None else AdaptiveWeights.parse(d.weights)  # None: fixed weights
        self.mode = self._engine_mode(cfg.runtime.cuda_graphs, cfg.runtime.static_cache, cfg.runtime.compile)
        self._static_pool = StaticPool(self.mode.graphs)
        self._speculation_policy = None  # generate_batch(speculate="auto")'s, made on first use
        self._grammar_compiler = None  # constraints compiled for the tokenizer (mmspec.constrain), made on first use
        self._shape_policy = None  # tree="auto"'s, made on first use
        if self.draft is None:  # a head reads the target's features, lookup its text: no views, no draft model
            self.views, self.weights, newline = [], [1.0], None
        else:
            self.views = checks.resolve_views(parse_views(d.views), self.draft, type(self.draft_model).__name__,
                                              self.captioner, self.substitute)
            self.weights = checks.check_weights(None if self.adaptive else d.weights, len(self.views))
            if self.adaptive is not None and self.adaptive.initial is not None \
                    and len(self.adaptive.initial) != len(self.views):
                raise MMSpecError(f"{len(self.adaptive.initial)} initial weights for {len(self.views)} views; "
                                  "give one per view")
            checks.check_vocab(self.target, self.draft, self.tokenizer)
            newline = checks.newline_id(self.tokenizer, self.views)
        self.mm = MultimodalPrompt(
            target=self.target, draft=self.draft, views=self.views, tokenizer=self.tokenizer, newline_id=newline,
            reuse_vision=self.draft is not None and same_vision(self.target, self.draft), processor=self.processor,
            draft_processor=self.draft_processor, captioner=self.captioner, substitute=self.substitute)
        self.options = EngineOptions(tree=self.tree, eos_ids=checks.eos_ids(self.target_model, self.tokenizer),
                                     acceptance=acceptance_cfg)
        self.prefix_cache = PrefixCache(prefix_mb)
        self.suffix_store = SuffixStore(self.lookup) if self.model_free == "suffix" else None  # this decoder's history
        checks.check_generation_config(self.target_model)
        self.head_report = None
        if d.check_head and self.head is not None:  # a short calibration: mmspec.heads.check
            from mmspec.heads.check import calibrate

            self.head_report = calibrate(self)
            for w in self.head_report.warnings:
                warnings.warn(w, stacklevel=2)

    # ------------------------------------------------------------------ settings, as attributes
    @property
    def acceptance(self) -> RelaxedAcceptance | None:
        """The relaxed (LOSSY) acceptance settings, or None for the exact (lossless) one."""
        return self.options.acceptance.relaxed

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.options.eos_ids

    @property
    def reuse_vision(self) -> bool:
        return self.mm.reuse_vision

    @property
    def newline_id(self) -> int | None:
        return self.mm.newline_id

    @property
    def static(self) -> bool:
        return self.mode.static

    @property
    def graph_mode(self) -> str:
        return self.mode.graphs

    @property
    def static_pool(self) -> StaticPool:
        """The static caches and graph runners this decoder keeps across calls (``generate``'s,
        and the batch engine's leased forwards)."""
        return self._static_pool

    @property
    def engine(self) -> str:
        """"eager", "static" (fixed shapes) or "cuda-graphs"."""
        return self.mode.name

    @property
    def method(self) -> str:
        """The views' short name (or the head's variant), with "+tree" when blocks are trees
        ("M", "MTC+tree", "eagle+tree")."""
        name = self.head.config.variant if self.head is not None else ensemble_name(self.views)
        if self.model_free:
            name = self.model_free if self.model_free_alone else f"{name}+{self.model_free}"
        tree = "+tree:auto" if len(self.tree_shapes) > 1 else "" if self.tree.kind == "chain" else "+tree"
        return name + (f"+{self.adaptive.label}" if self.adaptive else "") + tree + ("+relaxed" if self.acceptance else "")

    def _engine_mode(self, cuda_graphs, static_cache, compile) -> EngineMode:
        """Decide eager / static / CUDA-graph decoding, compiled or not, and check the tree fits the models."""
        full_attention = all(m.full_attention for m in (self.target, self.head, self.draft) if m is not None)
        if not self.tree.is_chain and not full_attention:
            raise MMSpecError("token trees need models whose layers are all full attention (their caches are "
                              "compacted after each block); this target or draft has sliding-window or other "
                              "layers: use tree=None (a chain)")
        if static_cache not in (None, True, False):
            raise MMSpecError(f"static_cache must be True, False or None, got {static_cache!r}")
        if not isinstance(compile, bool):
            raise MMSpecError(f"compile must be True or False, got {compile!r}")
        for flag, on in (("static_cache=True", static_cache), ("compile=True", compile)):
            if on and not full_attention:
                raise MMSpecError(f"{flag} needs models whose layers are all full attention (fixed shapes); this "
                                  f"target or draft has sliding-window or other layers: leave it out")
        dispatched = any(len(set(getattr(m, "hf_device_map", {}).values())) > 1
                         for m in (self.target_model, self.draft_model) if m is not None)
        draft_device = self.draft.device if self.draft is not None else \
            next(self.head.parameters()).device if self.head is not None else self.target.device
        mode = graph_mode(cuda_graphs, self.target.device, draft_device)
        if mode != "eager" and (dispatched or not full_attention):
            if cuda_graphs is True:
                raise MMSpecError("cuda_graphs=True needs both models on one device with full-attention layers "
                                  "only; use cuda_graphs='auto' to fall back to eager decoding")
            mode = "eager"
        return EngineMode(graphs=mode, static=mode != "eager" or bool(static_cache) or compile, compile=compile)

    # ------------------------------------------------------------------ generate
    @torch.inference_mode()
    def generate(self, input_ids, pixel_values=None, attention_mask=None, *, max_new_tokens: int = MAX_NEW_TOKENS,
                 temperature: float = 0.0, seed: int | None = None, top_k: int | None = None,
                 top_p: float | None = None, images: Sequence | None = None,
                 captions: Sequence[str] | None = None, videos: Sequence | None = None,
                 substitutes: Sequence | None = None, streamer=None,
                 initial_weights: Sequence[float] | None = None, logprobs: int | None = None,
                 constraint=None, **unused) -> GenerationResult:
        """Decode one prompt. Inputs are those of ``target.generate`` (the processor's output: for
        other families also ``image_sizes``, ``image_grid_thw``, ``pixel_values_videos``,
        ``video_grid_thw``, ``mm_token_type_ids``, ... as the target's family reads them; Video-LLaVA's
        ``pixel_values_images`` is taken as ``pixel_values``). ``images``: the PIL pictures, one per
        image or video in prompt order (a video's: a frame of it), for the captioner, and one per
        image for a draft with a processor of its own. ``streamer``: transformers'
        ``TextStreamer`` / ``TextIteratorStreamer`` (or any object with ``put(ids)`` / ``end()``):
        it gets the prompt ids [1, L] first (``skip_prompt`` skips them), then each block's new
        tokens [n], then ``end()``. ``initial_weights``: with
        adaptive weights, where this request's weights start (e.g. the previous turn's
        ``stats.final_weights``). ``logprobs=K``: the result's ``logprobs`` holds each new token's
        log-probability under the target and its K likeliest alternatives
        (:class:`~mmspec.results.TokenLogprob`), read from the verify forwards that emitted them.
        ``constraint``: a :class:`~mmspec.constrain.Constraint` (a JSON schema, any JSON object, a
        regex, a choice, a grammar): the answer is the target's own decoding under it, and ends
        (EOS) when the grammar is complete (docs/structured.md)."""
        req = prepare(self, dict(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask,
                                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_k=top_k,
                                 top_p=top_p, images=images, captions=captions, videos=videos,
                                 substitutes=substitutes, initial_weights=initial_weights, logprobs=logprobs,
                                 constraint=constraint, **unused))
        from mmspec.engine.scheduler import BatchScheduler

        sched = BatchScheduler(self, max_batch=1, stream_text=False)  # one request: a batch of one on the one engine
        captured, compiled = sched.engine.capture_s, sched.engine.compile_s
        sched.submit(req)
        if streamer is not None:
            streamer.put(req.ids[None])  # the prompt first, as transformers' generate does
        result = None
        try:
            while sched.has_work():
                for ev in sched.step():
                    if ev.exception is not None:
                        raise ev.exception
                    if streamer is not None and ev.new_token_ids:
                        streamer.put(torch.tensor(ev.new_token_ids))
                    if ev.finished:
                        result = ev.result
        finally:
            if sched.has_work():  # an error or a cancelled stream: the rows go back
                for rid in list(range(sched._next_rid)):
                    sched.cancel(rid)
            sched.close()
            if streamer is not None:
                streamer.end()
        result.stats.capture_s = sched.engine.capture_s - captured
        result.stats.compile_s = sched.engine.compile_s - compiled
        return result

    def generate_batch(self, requests: list[dict], *, max_batch: int = 16, speculate: str = "always",
                       overlap: bool | None = None, **defaults) -> list[GenerationResult]:
        """Decode many prompts together (:mod:`mmspec.batch`): each request a dict of what
        :meth:`generate` takes for one prompt (``input_ids``, ``pixel_values``, the family's processor
        outputs, ``images``, ``captions``, ...) plus its own ``max_new_tokens``, ``temperature``,
        ``top_k``, ``top_p``, ``seed`` overriding ``defaults``. Every request is checked before any
        decoding ("request N: ..."); results come back in input order, each one what ``generate``
        returns for that request alone (greedy: the target's tokens; a seed: the same draws).
        ``speculate``: "always", "never" (plain batched target steps) or "auto" (the goodput
        policy: per step the draft depth, plain decoding included, with the most expected tokens
        per second at the batch size: :class:`~mmspec.batch.SpeculationPolicy`); ``max_batch``:
        requests decoded at once; ``overlap``: each step launched before the previous one is read
        (None: on a GPU; :class:`~mmspec.batch.BatchScheduler`)."""
        from mmspec.batch import generate_batch

        return generate_batch(self, requests, max_batch=max_batch, speculate=speculate, overlap=overlap, **defaults)

    def encode_text(self, text: str) -> list[int]:
        """``text``'s token ids under this decoder's tokenizer, without special tokens (a
        constraint's jump-forward strings: :meth:`mmspec.constrain.state.RowGrammar.forced_run`)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def grammar_compiler(self):
        """The constraints' compiler for this decoder's tokenizer and the target's vocabulary, with its
        cache of compiled grammars (:class:`~mmspec.constrain.compile.GrammarCompiler`; made on first use)."""
        if self._grammar_compiler is None:
            from mmspec.constrain.compile import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.eos_ids)
        return self._grammar_compiler

    @property
    def speculation_policy(self) -> SpeculationPolicy:
        """The "auto" policy this decoder's ``generate_batch(speculate="auto")`` calls share: the
        step-cost model, the rows' average acceptance and the shapes' gains it learnt carry over
        from call to call (a fresh policy per call would spend a short batch re-measuring what the
        last one learnt)."""
        if self._speculation_policy is None:
            self._speculation_policy = SpeculationPolicy("auto", shapes=self._auto_shapes)
        return self._speculation_policy

    @property
    def _auto_shapes(self) -> tuple[TreeSpec, ...] | None:
        return self.tree_shapes if len(self.tree_shapes) > 1 else None

    def policy_for(self, speculate: str) -> SpeculationPolicy:
        """The policy a scheduler steps with for ``speculate``: the decoder's own where it learns
        (``"auto"``; ``"always"`` with ``tree="auto"``, choosing among the shapes), else a fresh one."""
        if speculate == "auto":
            return self.speculation_policy
        if speculate == "always" and self.shape_policy is not None:
            return self.shape_policy
        return SpeculationPolicy(speculate)

    @property
    def tree_label(self) -> str:
        """The block shape (``TreeSpec.label``), or tree="auto"'s candidates ("chain(γ=5) | dynamic(...),
        chosen per step"; the method, ``M+tree:auto``, already says auto)."""
        if len(self.tree_shapes) == 1:
            return self.tree.label
        return " | ".join(t.label for t in self.tree_shapes) + ", chosen per step"

    @property
    def shape_policy(self) -> SpeculationPolicy | None:
        """With ``tree="auto"``: the policy every ``speculate="always"`` call of this decoder shares
        (each step drafts whole, the shape with the most tokens per second; what it measured carries
        over, so a short request does not pay for measuring again); None with one shape."""
        if self._shape_policy is None and self._auto_shapes is not None:
            self._shape_policy = SpeculationPolicy("always", shapes=self._auto_shapes)
        return self._shape_policy

    def stream(self, input_ids, pixel_values=None, attention_mask=None, **kwargs) -> TextStream:
        """:meth:`generate` as an iterator of text pieces, at most one per block, that concatenate
        to ``generate(...).text`` (same arguments, ``streamer`` excepted); the result, stats
        included, is the iterator's ``result`` once it is exhausted. Errors (bad input included)
        are raised by the iteration. The decode runs in a worker thread: use the decoder for
        nothing else until the stream has ended (or ``close()`` it)."""
        if "streamer" in kwargs:
            raise MMSpecError("stream() streams by itself; pass streamer= to generate() instead")
        return TextStream(self, (input_ids, pixel_values, attention_mask), kwargs)

    # ------------------------------------------------------------------ one request's prefill
    # ------------------------------------------------------------------ one request's prompt
    def encode_prompt(self, ids: torch.Tensor, mm: dict, layout, stats: GenerationStats, images=None,
                      captions=None, videos=None, substitutes=None) -> EncodedRequest:
        """Step 1 of a prefill: the prompt's images encoded (or the encoded images of a stored
        prompt reused), its draft rows, and what the prefix cache holds of it."""
        cache_on = self.prefix_cache.enabled and not any(v.needs_substitute for v in self.views)
        digests = ((tuple(segment_digests(mm, layout.kinds)), None if captions is None else tuple(captions))
                   if cache_on else ())
        enc = self.prefix_cache.encoded_for(digests) if cache_on and layout.n_segments else None
        if enc is not None:
            enc = replace(enc, layout=layout)  # the same images: no vision tower, no captioner
        else:  # vision (each image / video once), captions, substitutes
            enc = self.mm.encode(layout, mm, stats, images=images, captions=captions, videos=videos,
                                 substitutes=substitutes)
        rows = self.mm.rows(enc) if self.draft is not None else []
        keys, match = None, None
        if cache_on:
            keys = prompt_keys(ids, self.target.placeholders(), enc, rows, self.views, digests)
            match = self.prefix_cache.match(keys.target[:-1], [k[:-1] for k in keys.rows], head=self.head is not None)
        return EncodedRequest(ids=ids, mm=mm, encoded=enc, rows=rows, keys=keys, match=match, captions=captions)

    def mm_inputs(self, pixel_values, unused: dict) -> dict:
        """generate()'s extra keywords -> the multimodal inputs, unknown ones refused."""
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
        return mm

    def new_stats(self) -> GenerationStats:
        return GenerationStats(gamma=self.tree.max_depth, views=tuple(v.name for v in self.views),
                               tree=self.tree_label, engine=self.engine,
                               weighting=self.adaptive.label if self.adaptive else "fixed",
                               acceptance="exact" if self.acceptance is None else "relaxed (lossy)")

    def room(self, max_new_tokens: int) -> int:
        """Positions a decode can append after the prompt: committed tokens + one block's tree."""
        extra = self.tree.n_nodes if self.model_free and not self.model_free_alone else 0  # branches added beside a draft
        extra += 2 * FORCED_TAIL + self.tree.max_depth  # a constrained step's forced tails: verified, then pending
        return max_new_tokens + self.tree.n_nodes + extra + 1

    def _proposer(self, ids: torch.Tensor, enc: EncodedPrompt, captions, sampled: bool = False):
        """A model-free proposer for one request, fed its text before the pending last token:
        the captions (the caption view's, else ``captions=``), then the prompt."""
        caps = enc.caption_ids
        if caps is None and captions:
            caps = [self.tokenizer.encode(" " + c.strip(), add_special_tokens=False) for c in captions]
        proposer = proposer_for(self.model_free, self.lookup, self.suffix_store, sampled)
        proposer.begin(history(ids, self.target.placeholders(), caps))
        return proposer

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the draft reads (a head's), else none."""
        return self.head.config.feature_layers if self.head is not None else ()

    def target_inputs(self, prompt: EncodedRequest) -> TargetInputs:
        """What the target's prefill feeds for one request: the embeddings of all but the last
        prompt token (it is the first pending token), each run of placeholders filled with its
        features, and their positions, less the first ``match.target`` positions (in the prefix
        cache)."""
        ids, enc, match = prompt.ids, prompt.encoded, prompt.match
        dev = self.target.device
        L = ids.shape[0]
        s = 0 if match is None else match.target  # positions reused
        prefix = ids[:-1].to(dev)[None]  # [1, L-1], never empty: prompts have >= 2 tokens (check_ids)
        embeds = self.target.embed(prefix)  # [1, L-1, H_t]
        for token, kind in self.target.placeholders().items():  # each run of placeholders gets its features
            if enc.target_feats.get(kind):
                mask = (prefix == token).unsqueeze(-1)  # [1, L-1, 1]
                feats = torch.cat(enc.target_feats[kind])  # [n_tokens, H_t]
                if feats.shape[0] != int(mask.sum()):  # masked_scatter would silently drop the surplus
                    raise MMSpecError(f"the target's {kind} features ({feats.shape[0]}) do not fill its "
                                      f"{int(mask.sum())} {kind} tokens: this family's adapter counted them wrong")
                embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
        positions, next_pos = self.target.prefill_positions(prefix, for_prefix(prompt.mm, prefix))  # M-RoPE: the suffix continues the prefix
        return TargetInputs(embeds=embeds[:, s:], positions=positions[..., s:], reused=s,
                            pos_offset=int(next_pos[0]) - (L - 1))

    def _draft_positions(self) -> str:
        """How the block's draft depth is set, for error messages."""
        return f"gamma={self.gamma}" if self.tree.kind == "chain" else f"a tree {self.tree.max_depth} deep"

    def check_context(self, prompt_len: int, max_new_tokens: int) -> None:
        check_context(self.target.max_positions, prompt_len, max_new_tokens, self.tree.max_depth, what="the prompt",
                      note=", images expanded", whose="the target's", depth_words=self._draft_positions(),
                      fix="lower gamma (or the tree depth) or max_new_tokens, shorten the prompt or use fewer images")

    # ------------------------------------------------------------------ the batched engine
    def engine_for(self, holder):
        """The engine a scheduler steps (:class:`~mmspec.engine.step.Engine`): a fresh one, or
        with static shapes the one this decoder keeps (its buffers and graphs) for one holder at a time."""
        from mmspec.drafting.ensemble import EnsembleDrafting
        from mmspec.engine.step import Engine
        from mmspec.runtime.graphs import GraphPool

        def make():
            pool = GraphPool(self.graph_mode)  # one pool for every graph of the engine (a whole step each)
            drafting = None
            feat_dim = feat_dtype = None
            if self.head is not None:
                from mmspec.drafting.heads import HeadDrafting

                drafting = HeadDrafting(self.head, self.target, self.tree, static=self.static)
                feat_dim, feat_dtype = self.head.config.feature_size, self.head.dtype
            elif self.draft is not None:
                drafting = EnsembleDrafting(self.draft, self.weights, self.target.vocab_size, self.tree,
                                            static=self.static)
                if self.adaptive is not None:
                    from mmspec.drafting.weights import BatchAdaptive

                    drafting.adaptive = BatchAdaptive(self.adaptive, len(self.views), self.draft.device)
            n_layers = self.target_model.config.get_text_config(decoder=True).num_hidden_layers
            return Engine(self.target, n_layers, self.tree, drafting, hidden_layers=self.hidden_layers,
                          relaxed=self.acceptance, static=self.static, graphs=self.graph_mode, feat_dim=feat_dim,
                          feat_dtype=feat_dtype or torch.float32, pool=pool,
                          proposals_beside=bool(self.model_free) and not self.model_free_alone,
                          compile=self.mode.compile, max_logprobs=self.max_logprobs)

        return self._static_pool.lease("engine", holder, make) if self.static else make()

    @torch.inference_mode()
    def warm_up(self, *, max_batch: int = 16, speculate="always", max_context: int = 2048):
        """Capture, before any request, every CUDA graph a batch of up to ``max_batch`` requests
        of up to ``max_context`` positions (prompt and new tokens, images expanded) may step
        with under ``speculate`` ("always", "never", "auto" or a policy): each step shape the
        policy may choose, for every row bucket, span bucket, sampling path and logprobs width
        (:mod:`mmspec.engine.warmup`). -> a :class:`~mmspec.engine.warmup.WarmUp` (graphs,
        seconds); nothing to do without graphs. A later request that needs more (a longer
        context, model-free proposals) still captures on first use."""
        from mmspec.drafting.trees import inblock_slots
        from mmspec.engine.warmup import WarmUp, step_shapes, warm_up

        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise MMSpecError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise MMSpecError(f"max_context must be a whole number of positions >= 2, got {max_context!r}")
        if self.graph_mode == "eager":
            return WarmUp(0, 0, 0, 0.0)
        policy = speculate if isinstance(speculate, SpeculationPolicy) else self.policy_for(speculate)
        held = self._static_pool.leased.get("engine")
        if held is not None and held[1]() is not None:  # a fresh engine would be warmed, then dropped
            raise MMSpecError("warm_up() while a scheduler holds this decoder's engine; warm up before creating "
                              "it, or close() it first")
        holder = _WarmUpHolder()
        engine = self.engine_for(holder)
        try:
            capacity = max_context + self.room(0)  # as admission sizes a request's rows
            return warm_up(engine, max_batch, step_shapes(policy, self.tree), capacity,
                           capacity + engine.lag + 1 + inblock_slots(self.tree), policy.mode != "never")
        finally:
            self._static_pool.give_back(holder)

    def proposer_for_request(self, prompt: EncodedRequest, sampled: bool = False):
        """A model-free drafter's proposer for one admitted request (None without lookup / suffix);
        ``sampled``: the request samples (its suffix proposals: its own text alone, so that its
        seed reproduces it: :func:`mmspec.drafting.lookup.proposer_for`)."""
        if not self.model_free:
            return None
        return self._proposer(prompt.ids, prompt.encoded, prompt.captions, sampled)

    def check_draft_context(self, view: View, row_len: int, max_new_tokens: int) -> None:
        self._check_draft_context(view, row_len, max_new_tokens)

    def _check_draft_context(self, view: View, row_len: int, max_new_tokens: int) -> None:
        check_context(self.draft.max_positions, row_len, max_new_tokens, self.tree.max_depth,
                      what=f"the {view.name} view's draft prompt", whose="the draft's", depth_words=self._draft_positions(),
                      fix="lower gamma (or the tree depth) or max_new_tokens, or use a view with fewer image tokens "
                      "(text, caption or pooled:N)")


class _WarmUpHolder:
    """Who holds the static engine while :meth:`SpecDecoder.warm_up` captures its graphs."""
