"""What the runner runs: the target alone (baseline), each drafting method, and latency probes.

Owns model loading for benchmarks (the embedded models by default, or local / hub checkpoints
through transformers' Auto classes) and the :class:`HFBackend` that turns a
:class:`~mmspec.bench.datasets.BenchSample` into processor inputs and runs
``target.generate`` (baseline) or ``SpecDecoder.generate`` (a method). The runner only talks to
the small :class:`Backend` protocol, so tests can drive it with a fake.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from mmspec.bench.config import BenchConfig, RankInfo, method_tree, method_views
from mmspec.bench.datasets import BenchSample
from mmspec.drafting.tree import reads_gamma
from mmspec.errors import MMSpecError
from mmspec.timing import sync


@dataclass
class Generation:
    """One generated continuation. ``stats`` is ``GenerationStats.to_dict()`` for a method."""

    token_ids: list[int]
    text: str
    wall_s: float
    input_len: int = 0
    stats: dict | None = None


class Backend(Protocol):
    def baseline(self, sample: BenchSample) -> Generation: ...
    def spec(self, sample: BenchSample, method: str) -> Generation: ...
    def begin_pass(self, batch_size: int) -> None:
        """The batched pass of ``batch_size`` begins (its decoders and prefix caches its own)."""
        ...

    def latency(self, sample: BenchSample) -> dict | None: ...
    def describe(self) -> dict: ...
    # optional (getattr): audit(sample, own, ours) -> dict | None; target_batch(samples) and
    # spec_batch(samples, method) -> (list[Generation], wall_s) for --batch-size B > 1


@dataclass
class BenchModels:
    """The models of a run, whatever their source (embedded or checkpoints)."""

    target: Any
    draft: Any
    tokenizer: Any
    processor: Any
    captioner: Any = None  # an HFCaptioner (prompt checked at load), or None: no C methods
    pooled_tokens: int | None = None  # --pool-tokens for the P view (None: SpecDecoder's default)
    source: str = "embedded"
    heads: dict = field(default_factory=dict)  # head variant -> trained head directory (head methods)


def load_models(cfg: BenchConfig) -> BenchModels:
    """Embedded models unless ``cfg.target`` is given; then ``cfg.draft`` is required too."""
    from mmspec.models.captioner import HFCaptioner
    from mmspec.models.loading import resolve_dtype

    if cfg.target is None:
        from mmspec.embedded import load_embedded

        e = load_embedded(dtype=resolve_dtype(cfg.dtype))
        captioner = e.captioner()
        return BenchModels(e.target, e.draft, e.tokenizer, e.processor, captioner, cfg.pool_tokens, "embedded",
                           heads={**e.heads, **dict(cfg.heads)})
    from mmspec.models.loading import check_same_vocabulary, load_model, load_processor, load_tokenizer_if_any

    dtype = resolve_dtype(cfg.dtype)
    processor = load_processor(cfg.target)
    tokenizer = getattr(processor, "tokenizer", processor)
    check_same_vocabulary(tokenizer, load_tokenizer_if_any(cfg.draft))  # before the weights load
    models = BenchModels(load_model(cfg.target, dtype=dtype), load_model(cfg.draft, dtype=dtype), tokenizer, processor,
                         pooled_tokens=cfg.pool_tokens, source="checkpoints", heads=dict(cfg.heads))
    if cfg.captioner is not None:
        models.captioner = HFCaptioner.from_pretrained(cfg.captioner, prompt=cfg.captioner_prompt, dtype=dtype)
    return models


def pick_device(cfg: BenchConfig, rank: RankInfo) -> torch.device:
    if cfg.device:
        from mmspec.models.loading import resolve_device

        return resolve_device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", rank.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class HFBackend:
    """Runs real models. Decoders are built once per method and reused across samples."""

    def __init__(self, models: BenchModels, cfg: BenchConfig, device: torch.device) -> None:
        self.m = models
        self.cfg = cfg
        self.device = device
        for mod in (models.target, models.draft, getattr(models.captioner, "model", None)):
            if mod is not None:
                mod.to(device).eval()
        self._decoders: dict[str, Any] = {}
        self._pass: int | None = None  # the batched pass under way (begin_pass), None: one prompt at a time

    def prompt(self, sample: BenchSample) -> str:
        """The sample's prompt text: a published multi-turn sample (MMSpec's) through the target's own
        chat template when its processor has one (real checkpoints), else as the data set rendered it
        (the LLaVA-1.5 chat format ``USER: ... ASSISTANT:``, which the embedded pack reads)."""
        template = getattr(self.m.processor, "chat_template", None)
        if sample.questions and template:
            from mmspec.prompt import chat_messages

            msgs = chat_messages(sample.questions[:sample.turn], sample.answers, sample.n_images)
            return self.m.processor.apply_chat_template(msgs, add_generation_prompt=True)
        return sample.prompt

    def new_tokens(self, sample: BenchSample, prompt_len: int) -> int:
        """New tokens for ``sample``'s answer: ``--max-new-tokens``, else its data set's protocol
        (:meth:`BenchConfig.new_tokens_for`), then cut to what fits the target's context (a margin of
        64 positions for a block's drafts) when the protocol's default would not: the embedded pack's
        1,024 positions cannot hold MMSpec's 1,024 new tokens after a prompt. An explicit
        ``--max-new-tokens`` is never cut (a prompt it does not fit is the decoder's error)."""
        n = self.cfg.new_tokens_for(sample.dataset)
        if self.cfg.max_new_tokens is None:
            limit = self.m.target.config.get_text_config().max_position_embeddings
            if limit:
                n = max(1, min(n, int(limit) - prompt_len - 64))
        return n

    def _inputs(self, sample: BenchSample) -> dict[str, torch.Tensor]:
        dtype = next(self.m.target.parameters()).dtype  # pixel_values follow the target (bf16 runs)
        if sample.video is not None:
            return self._clip_inputs(sample, dtype)
        images = sample.images or None
        enc = self.m.processor(text=self.prompt(sample), images=images, return_tensors="pt")
        return {k: v.to(self.device, dtype=dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in enc.items() if isinstance(v, torch.Tensor)}

    def _clip_inputs(self, sample: BenchSample, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A world clip as the Video-LLaVA pair reads it (:func:`mmspec.world.processor.clip_inputs`:
        evenly spaced frames, ``<video>`` expanded to the target's slots): input_ids [1, L],
        attention_mask [1, L], pixel_values_videos [1, T, 3, H, W]."""
        from mmspec.world.processor import clip_inputs, clip_layout

        try:
            vid, n_frames, per_frame = clip_layout(self.m.target)
        except MMSpecError:
            raise MMSpecError(f"dataset {sample.dataset!r} is the world's video clips: it needs a Video-LLaVA "
                              "target whose video_seq_length is frames x (grid^2 + 1) slots, as `mmspec train "
                              "video` makes (--target PAIR/target --draft PAIR/draft); this target is a "
                              f"{type(self.m.target).__name__}") from None
        x = clip_inputs(sample.video, self.m.tokenizer, self.m.processor.image_processor, vid, n_frames, per_frame)
        ids = x["input_ids"][None].to(self.device)  # [1, L]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values_videos": x["pixel_values_videos"].to(self.device, dtype=dtype)}

    def _get_captioner(self) -> Any:
        if self.m.captioner is None:
            raise MMSpecError("a caption (C) method needs a captioner: pass --captioner PATH")
        return self.m.captioner

    def _decoder(self, method: str, reuse: bool = False) -> Any:
        """The method's decoder, built once. ``reuse``: a conversation's, which keeps its recent prompts'
        caches (prefix caching) so turn 2 prefills only its new suffix; every other prompt is timed from
        scratch, as the target's own generate runs it (``prefix_cache_mb=0``)."""
        key = f"{method}\0reuse" if reuse else method
        if reuse and self._pass is not None:  # a batched pass's own cache: none of another pass's prompts
            key += f"\0b{self._pass}"
        if key not in self._decoders:
            from mmspec.decoder import SpecDecoder

            views = self.resolve_views(method)
            kw = method_tree(method)
            kw.pop("speculate", None)  # generate_batch's, not the decoder's (spec_batch passes it)
            draft = self.m.draft
            if "draft" in kw:  # lookup / suffix alone: no draft model
                draft, views = kw.pop("draft"), ("M",)
            if "head" in kw:
                variant = kw.pop("head")
                if variant not in self.m.heads:
                    raise MMSpecError(f"method {method!r} needs a trained {variant} head: pass --head "
                                      f"{variant}=DIR (made by mmspec train head); this run has "
                                      f"{sorted(self.m.heads) or 'none'}")
                draft, views = str(self.m.heads[variant]), ("M",)
            needs_caption = any(v in ("C", "caption") for v in views)
            if not reuse:  # each prompt timed from scratch, as the target's own generate runs it
                kw["prefix_cache_mb"] = 0
            if reads_gamma(kw.get("tree")):  # --gamma: the chains' length; a tree method has its own shape
                kw["gamma"] = self.cfg.gamma
            self._decoders[key] = SpecDecoder(
                self.m.target, draft, self.m.tokenizer, views=views,
                captioner=self._get_captioner() if needs_caption else None,
                processor=self.m.processor, **kw,
            )
        return self._decoders[key]

    def resolve_views(self, method: str) -> tuple[str, ...]:
        """Method letters -> views; a bare P becomes ``pooled:N`` when N is known."""
        views = method_views(method)
        n = self.m.pooled_tokens
        return tuple(f"pooled:{n}" if v in ("P", "pooled") and n else v for v in views)

    @torch.inference_mode()
    def baseline(self, sample: BenchSample) -> Generation:
        inputs = self._inputs(sample)
        n_in = int(inputs["input_ids"].shape[1])
        greedy = self.cfg.temperature <= 0
        kw: dict[str, Any] = {"do_sample": not greedy, "max_new_tokens": self.new_tokens(sample, n_in)}
        if not greedy:  # the distribution spec() samples: no top-k (transformers adds 50) or top-p
            kw.update(temperature=self.cfg.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(self.cfg.seed)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.m.target.generate(**inputs, **kw)  # [1, n_in + n_new]
        sync(self.device)
        wall = time.perf_counter() - t0
        new = out[0, n_in:].tolist()
        text = self.m.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(new, text, wall, n_in)

    def spec(self, sample: BenchSample, method: str) -> Generation:
        from mmspec.decoder import MM_KEYS

        inputs = self._inputs(sample)
        dec = self._decoder(method, reuse=sample.multi_turn)
        n_in = int(inputs["input_ids"].shape[1])
        sync(self.device)
        t0 = time.perf_counter()
        res = dec.generate(
            inputs["input_ids"], pixel_values=inputs.get("pixel_values"),
            attention_mask=inputs.get("attention_mask"), max_new_tokens=self.new_tokens(sample, n_in),
            temperature=self.cfg.temperature, seed=self.cfg.seed, images=sample.images,
            **{k: v for k, v in inputs.items() if k in MM_KEYS},
        )
        sync(self.device)
        wall = time.perf_counter() - t0
        return Generation(list(res.token_ids), res.text, wall, int(inputs["input_ids"].shape[1]),
                          res.stats.to_dict())

    def audit(self, sample: BenchSample, own: list[int], ours: list[int]) -> dict | None:
        """The target's margin where ``ours`` first leaves ``own`` (:func:`mmspec.bench.audit.audit_difference`)."""
        from mmspec.bench.audit import audit_difference

        return audit_difference(self.m.target, self._inputs(sample), own, ours)

    @torch.inference_mode()
    def target_batch(self, samples: list[BenchSample]) -> tuple[list[Generation], float]:
        """The target's own batched greedy ``generate`` over ``samples`` (left-padded, one processor
        call): each row's new tokens up to its first EOS, and the batch's wall time."""
        from mmspec.bench.batched import cut_at_eos

        tok = self.m.tokenizer
        side = tok.padding_side
        tok.padding_side = "left"
        try:
            images = [im for s in samples for im in s.images] or None
            enc = self.m.processor(text=[self.prompt(s) for s in samples], images=images, padding=True,
                                   return_tensors="pt")
        finally:
            tok.padding_side = side
        dtype = next(self.m.target.parameters()).dtype
        inputs = {k: v.to(self.device, dtype=dtype) if v.is_floating_point() else v.to(self.device)
                  for k, v in enc.items() if isinstance(v, torch.Tensor)}
        n_in = int(inputs["input_ids"].shape[1])
        sync(self.device)
        t0 = time.perf_counter()
        limits = [self.new_tokens(s, int(m.sum())) for s, m in zip(samples, inputs["attention_mask"])]
        out = self.m.target.generate(**inputs, do_sample=False, max_new_tokens=max(limits))  # [B, n_in + n_new]
        sync(self.device)
        wall = time.perf_counter() - t0
        eos = self.m.target.generation_config.eos_token_id
        gens = []
        for row, mask, limit in zip(out[:, n_in:].tolist(), inputs["attention_mask"], limits):
            new = cut_at_eos(row[:limit], eos)
            gens.append(Generation(new, tok.decode(new, skip_special_tokens=True), wall, int(mask.sum())))
        return gens, wall

    def spec_batch(self, samples: list[BenchSample], method: str) -> tuple[list[Generation], float]:
        """``SpecDecoder.generate_batch`` over ``samples`` (one request each), and the batch's wall time."""
        dec = self._decoder(method, reuse=any(s.multi_turn for s in samples))
        reqs = []
        for s in samples:
            inputs = self._inputs(s)
            reqs.append({**inputs, "images": s.images,
                         "max_new_tokens": self.new_tokens(s, int(inputs["input_ids"].shape[1]))})
        sync(self.device)
        t0 = time.perf_counter()
        speculate = method_tree(method).get("speculate", "always")
        results = dec.generate_batch(reqs, max_batch=len(reqs),
                                     speculate=speculate, temperature=self.cfg.temperature, seed=self.cfg.seed)
        sync(self.device)
        wall = time.perf_counter() - t0
        return [Generation(list(r.token_ids), r.text, wall, int(q["input_ids"].shape[-1]), r.stats.to_dict())
                for r, q in zip(results, reqs)], wall

    def begin_pass(self, batch_size: int) -> None:
        """The batched pass of ``batch_size`` begins: a conversation's turns decode on that pass's own
        decoders, whose prefix caches hold only that pass's earlier turns (a turn 1 never finds itself
        in the cache of another pass, a turn 2 finds its turn 1 of this pass). The previous pass's
        decoders are dropped with their caches (a 7B target's KV per pass would add up)."""
        if self._pass is not None and self._pass != batch_size:
            for key in [k for k in self._decoders if k.endswith(f"\0b{self._pass}")]:
                del self._decoders[key]
        self._pass = batch_size

    def latency(self, sample: BenchSample) -> dict | None:
        from mmspec.bench.latency import measure_latency

        if sample.video is not None:  # the probes feed images (pixel_values) only
            return None

        return measure_latency(self.m.target, self.m.draft, self._inputs(sample), self.cfg.gamma,
                               self.cfg.latency_batch_sizes, self.cfg.latency_repeats)

    def describe(self) -> dict:
        def size(m: Any) -> int | None:
            return None if m is None else sum(p.numel() for p in m.parameters())

        return {"source": self.m.source, "device": str(self.device),
                "target_params": size(self.m.target), "draft_params": size(self.m.draft),
                "captioner_params": size(getattr(self.m.captioner, "model", None)),
                "captioner_prompt": getattr(self.m.captioner, "prompt", None),
                "target_class": type(self.m.target).__name__}
