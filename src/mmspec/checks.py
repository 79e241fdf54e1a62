"""The input checks of :class:`mmspec.SpecDecoder`: each bad argument is refused with an
:class:`~mmspec.errors.MMSpecError` that names the problem and the fix, before anything is
decoded (and, where the check needs no model, before anything is loaded).

Pure functions of the arguments and the loaded models' adapters; nothing here runs a model.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence

import torch

from mmspec.drafting.adaptive import check_initial
from mmspec.drafting.tree import DEFAULT_GAMMA, TreeSpec, reads_gamma
from mmspec.drafting.views import View, parse_views
from mmspec.errors import ArgumentError, MMSpecError
from mmspec.models.base import ModelAdapter, video_families
from mmspec.models.pooling import valid_pool_sizes

DEFAULT_VIEWS = ("multimodal",)
# settings of the target's generation_config that change which token generate() picks;
# mmspec reproduces plain greedy / temperature sampling, so it refuses rather than diverge
LOGITS_PROCESSORS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                     "min_length": 0, "min_new_tokens": 0, "bad_words_ids": None, "suppress_tokens": None,
                     "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None,
                     "forced_eos_token_id": None}
VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike))


# ---------------------------------------------------------------------- before loading
def check_head_arguments(views, weights, captioner, draft_processor, substitute) -> None:
    """A feature-level head drafts alone, from the target's features: the arguments that shape
    token-level drafting would be silently ignored, so they are refused."""
    if [v.name for v in parse_views(views)] != list(DEFAULT_VIEWS):
        raise MMSpecError(f"views={views!r} was given with a feature-level head as the draft; a head drafts "
                          "alone, from the target's features: leave views out (or pass a draft model for views)")
    for name, value in (("weights", weights), ("captioner", captioner), ("draft_processor", draft_processor),
                        ("substitute", substitute)):
        if value is not None:
            raise MMSpecError(f"{name}= was given with a feature-level head as the draft; it applies to "
                              f"token-level draft views only: leave it out (or pass a draft model)")


def model_free_name(draft) -> str | None:
    """``draft="lookup"`` / ``"suffix"`` (drafting with no model) -> that name, else None. A
    directory of that name is still a model: pass it as ``./lookup``."""
    from mmspec.drafting.lookup import MODEL_FREE

    if isinstance(draft, str) and draft.strip().lower() in MODEL_FREE:
        return draft.strip().lower()
    return None


# how the model-free drafters' arguments are named in messages: SpecDecoder's keywords or the CLI's flags
MODEL_FREE_WORDS = {
    "python": {"draft": "draft={!r}", "model_free": "model_free={!r}", "model_free_any": "model_free='lookup' or "
               "'suffix'", "drop_model_free": "drop model_free", "lookup_options": "lookup_options", "lookup_options_given": "lookup_options=",
               "drop_lookup_options": "leave lookup_options out", "views": "views={!r}", "drop_views": "leave views out",
               "with_draft": "pass a draft model with model_free={!r}", "option": "{}=", "drop_option": "leave it out",
               "tree_children": "tree_children='views'", "drop_tree_children": "leave tree_children out",
               "captions": "; pass captions=[...] to generate() to add captions to what {} matches"},
    "cli": {"draft": "--draft {}", "model_free": "--model-free {}", "model_free_any": "--model-free lookup|suffix",
            "drop_model_free": "drop --model-free", "lookup_options": "--lookup-options",
            "lookup_options_given": "--lookup-options",
            "drop_lookup_options": "drop --lookup-options", "views": "--views {}", "drop_views": "drop --views",
            "with_draft": "pass --draft MODEL_DIR --model-free {}", "option": "--{}", "drop_option": "drop it",
            "tree_children": "--tree-children views", "drop_tree_children": "drop --tree-children",
            "captions": ""},
}


def check_model_free(alone: str | None, model_free, lookup_options, *, spelling: str = "python",
                     views_shown: str | None = None, **given):
    """The model-free drafters' arguments (:mod:`mmspec.drafting.lookup`) -> their checked settings.

    ``alone``: the draft is "lookup" / "suffix"; ``model_free``: one beside a draft. With no
    model to draft, the options that shape a draft model's drafting would be ignored: refused.
    ``spelling``: "python" names SpecDecoder's keywords in the messages, "cli" the flags
    (``views_shown``: ``--views`` as written)."""
    from mmspec.drafting.lookup import MODEL_FREE, LookupConfig

    w = MODEL_FREE_WORDS[spelling]
    mf_name = "model_free" if spelling == "python" else "--model-free"
    if model_free is not None and (not isinstance(model_free, str) or model_free not in MODEL_FREE):
        raise MMSpecError(f"{mf_name} must be one of {', '.join(MODEL_FREE)} (a model-free proposal added to the "
                          f"draft's tree), got {model_free!r}")
    if alone is not None and model_free is not None:
        raise MMSpecError(f"{w['draft'].format(alone)} already drafts with no model; {w['model_free'].format(model_free)} "
                          f"adds a model-free proposal beside a draft model or head: {w['drop_model_free']}, or pass "
                          "a draft")
    if alone is None and model_free is None:
        if lookup_options is not None:
            raise MMSpecError(f"{w['lookup_options_given']} sets the model-free drafters; pass {w['draft'].format('lookup')} "
                              f"or {w['draft'].format('suffix')} (or {w['model_free_any']} beside a draft), or "
                              f"{w['drop_lookup_options']}")
        return None
    if alone is not None:
        views = given.pop("views")
        if [v.name for v in parse_views(views)] != list(DEFAULT_VIEWS):
            shown = w["views"].format(views_shown if views_shown is not None else views)
            raise MMSpecError(f"{shown} was given with {w['draft'].format(alone)}; views are how a draft model sees "
                              f"the prompt and {alone} has none: {w['drop_views']}, or {w['with_draft'].format(alone)} "
                              f"to add {alone} to its views' tree")
        if given.pop("tree_children") != "mixture":
            raise MMSpecError(f"{w['tree_children']} makes each view's top tokens siblings; {w['draft'].format(alone)} "
                              f"has no views (its children are its continuations by count): {w['drop_tree_children']}")
        for name, value in given.items():
            if value is not None:
                hint = w["captions"].format(alone) if name == "captioner" else ""
                option = w["option"].format(name if spelling == "python" else name.replace("_", "-"))
                raise MMSpecError(f"{option} was given with {w['draft'].format(alone)}, which drafts with no model; "
                                  f"it applies to a draft model only: {w['drop_option']}, or "
                                  f"{w['with_draft'].format(alone)}{hint}")
    return LookupConfig.parse(lookup_options, flag=w["lookup_options"])


def check_draft_processor_is_read(views) -> None:
    if not any(v.needs_vision for v in parse_views(views)):
        raise MMSpecError("draft_processor= was given but no view reads the draft's images (multimodal or pooled); "
                          "add one (e.g. views='MT') or leave draft_processor out")


def check_dtype(dtype, target, draft, head_given: bool) -> None:
    """``dtype`` converts models given as paths; with loaded models it would be ignored."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return
    if not (is_path(target) or (is_path(draft) and not head_given)):
        raise MMSpecError(f"dtype={dtype!r} applies to models given as paths (it loads them in that dtype), but "
                          "the target and draft were given loaded; convert them yourself (model.to(dtype)) or "
                          "leave dtype out")


def check_gamma(gamma, tree=None) -> int:
    """``gamma``: a chain's length (None: the default, 5), also the chain ``tree="auto"`` measures;
    given with a tree that is no chain it would be ignored, so it is refused (as the CLI refuses
    ``--gamma`` with ``--tree``)."""
    if gamma is None:
        return DEFAULT_GAMMA
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise MMSpecError(f"gamma must be a whole number >= 1, got {gamma!r}")
    if isinstance(tree, TreeSpec) and tree.kind == "chain" and tree.depth != gamma:
        raise MMSpecError(f"gamma={gamma} was given with a TreeSpec chain of length {tree.depth}, which carries "
                          "its own length; drop gamma (or build the TreeSpec with the length you want)")
    if not reads_gamma(tree):
        shown = tree.label if isinstance(tree, TreeSpec) else repr(tree)
        raise MMSpecError(f"gamma={gamma} is a chain's length, but tree={shown} is no chain: its shape is its own "
                          "(tree_depth / tree_topk / tree_budget for a dynamic tree, the paths of a static one), so "
                          "gamma would be ignored; drop gamma, or set the tree's depth with tree='dynamic', "
                          "tree_depth=N")
    return gamma


# the tree keywords each tree kind reads (the rest would be silently ignored)
# ---------------------------------------------------------------------- once the models are known
def check_tree_fits_vocab(tree: TreeSpec, vocab: int) -> None:
    """A static tree's child ranks (or a dynamic tree's top-k) must be below the vocabulary size:
    a node cannot have more distinct children than there are tokens."""
    if tree.kind == "static" and tree.paths:
        widest = max(max(p) for p in tree.paths)
        if widest >= vocab:
            raise MMSpecError(f"the static tree asks for the child of rank {widest} but the draft proposes from "
                              f"{vocab} tokens (ranks 0..{vocab - 1}); use child ranks below {vocab}")
    if tree.kind == "dynamic" and tree.topk > vocab:
        raise MMSpecError(f"tree_topk={tree.topk} is more children per node than the draft's {vocab} tokens; "
                          f"use tree_topk <= {vocab}")


def resolve_views(views: list[View], draft: ModelAdapter, draft_name: str, captioner, substitute) -> list[View]:
    """The views checked against the draft (vision tower, patch grid), the captioner and the
    substitute encoder; bare "pooled" gets its default size."""
    out = []
    for v in views:
        if v.needs_vision and not draft.has_vision:
            raise MMSpecError(
                f"the {v.name} view needs a vision-language draft, but the draft "
                f"({draft_name}) has no vision tower; use the text or "
                "caption views with a text-only draft"
            )
        if v.kind == "substitute":
            if substitute is None:
                raise MMSpecError("the substitute view (E) needs the draft's substitute encoder: pass substitute=DIR "
                                  "(made by mmspec train align) or a SubstituteEncoder")
            if substitute.config.out_size != draft.model.get_input_embeddings().weight.shape[1]:
                raise MMSpecError(f"the substitute encoder gives {substitute.config.out_size}-wide tokens but the "
                                  "draft's embeddings are of another width: align it to this draft "
                                  "(mmspec train align --draft DIR)")
        if v.kind == "caption" and captioner is None:
            raise MMSpecError(
                "the caption view needs a captioner: pass captioner=HFCaptioner.from_pretrained(...)"
                " (e.g. a BLIP or Florence-2 directory) or --captioner on the command line"
            )
        if v.kind == "pooled" and getattr(draft, "tokens_per_image", None) is None:
            v = View("pooled", v.n_tokens or 16)  # dynamic resolution: any size (adaptive pooling)
        elif v.kind == "pooled":
            if draft.tokens_per_image != draft.patch_grid ** 2:
                raise MMSpecError(
                    f"the pooled view pools the draft's patch grid, but the draft keeps the CLS token "
                    f"in its image features (vision_feature_select_strategy="
                    f"{getattr(draft, 'select_strategy', None)!r}); use the multimodal, text or "
                    "caption view with this draft")
            grid = draft.patch_grid
            default_n = (grid // 2) ** 2 if grid % 2 == 0 else 1  # paper: 576 -> 144
            n = v.n_tokens or default_n
            if n not in valid_pool_sizes(grid):
                raise MMSpecError(
                    f"pooled:{n} is not reachable from the draft's {grid}x{grid} patch grid; "
                    f"choose one of pooled:{valid_pool_sizes(grid)}"
                )
            v = View("pooled", n)
        out.append(v)
    if substitute is not None and not any(v.needs_substitute for v in out):  # it would be silently unused
        raise MMSpecError("substitute= was given but no view reads it; add the substitute view (E, e.g. "
                          "views='ME') or leave substitute out")
    return out


def check_weights(weights, n_views: int) -> list[float]:
    if weights is None:
        return [1.0] * n_views
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__"):
        raise MMSpecError(f"weights must be a list of numbers, one per view, got {weights!r}")
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise MMSpecError(f"weights must be a list of numbers, one per view, got {weights!r}") from None
    if len(weights) != n_views:
        raise MMSpecError(f"{len(weights)} weights for {n_views} views; give one weight per view")
    if not all(math.isfinite(w) for w in weights):
        raise MMSpecError(f"ensemble weights must be finite numbers, got {weights}")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise MMSpecError(f"ensemble weights must be >= 0 with a positive sum, got {weights}")
    return weights


def check_initial_weights(initial_weights, adaptive, n_views: int) -> tuple[float, ...] | None:
    """generate(initial_weights=...): where adaptive weights start, one finite weight >= 0 per view."""
    if initial_weights is None:
        return None
    if adaptive is None:
        raise MMSpecError("initial_weights= is where adaptive weights start; build the SpecDecoder with "
                          "weights='adaptive' (or give fixed weights= there instead)")
    initial = check_initial(initial_weights)
    if len(initial) != n_views:
        raise MMSpecError(f"{len(initial)} initial weights for {n_views} views; give one per view")
    return initial


def check_vocab(target: ModelAdapter, draft: ModelAdapter, tokenizer) -> None:
    vt, vd = target.vocab_size, draft.vocab_size
    if vd > vt:
        raise MMSpecError(
            f"draft and target have different vocabularies: the draft scores {vd} tokens, the "
            f"target {vt}. Speculative decoding needs the draft to use the target's tokenizer; "
            "pick a draft trained with the same vocabulary"
        )
    tok_v = len(tokenizer)
    if tok_v > vt:
        raise MMSpecError(f"the tokenizer has {tok_v} tokens but the target only scores {vt}; "
                          "pass the target's own tokenizer")
    # ids the draft cannot score are fine when all are tokens added on top of the base vocabulary
    # (llava-hf's <image> and <pad>): a draft never needs to propose them, and the target
    # verifies every token anyway
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    if vd < tok_v and not set(range(vd, tok_v)) <= added:
        raise MMSpecError(
            f"draft and target have different vocabularies: the tokenizer has {tok_v} tokens "
            f"but the draft scores only {vd}; pick a draft trained with the target's tokenizer"
        )


def newline_id(tokenizer, views: Sequence[View]) -> int | None:
    for i in tokenizer.encode("\n", add_special_tokens=False):
        if tokenizer.decode([i]) == "\n":
            return int(i)
    if any(v.kind == "text" for v in views):
        raise MMSpecError("the text view needs a newline token, but this tokenizer has none")
    return None


def eos_ids(model, tokenizer) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def check_generation_config(model) -> None:
    gc = model.generation_config
    active = [k for k, neutral in LOGITS_PROCESSORS.items() if getattr(gc, k, None) not in (None, neutral, [])]
    if active:
        raise MMSpecError(
            f"the target's generation_config sets {active}, which changes the tokens "
            "target.generate() picks; mmspec reproduces plain greedy decoding and sampling, so "
            "its output would differ. Reset them (e.g. target.generation_config.repetition_penalty = 1.0)"
        )


# ---------------------------------------------------------------------- per generate() call
def check_ids(input_ids, attention_mask) -> torch.Tensor:
    """-> the prompt [L] long on the CPU, left padding removed."""
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise MMSpecError(f"input_ids must be token ids (an integer tensor or list of ints from the processor), "
                          f"got {type(input_ids).__name__}{'' if ids is None else ' of ' + str(ids.dtype)}")
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise MMSpecError(
                f"input_ids has batch size {ids.shape[0]}; generate decodes one prompt at a time (input_ids "
                "[1, L] or [L]); for many prompts pass one request dict per prompt to SpecDecoder.generate_batch"
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


def check_ids_in_vocab(ids: torch.Tensor, vocab: int) -> None:
    """Every prompt id must be one the target embeds (an id past it fails deep inside the model)."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise MMSpecError(f"input_ids holds the id {bad}, outside the target's vocabulary of {vocab} tokens "
                          "(0..{}); build the prompt with the target's own tokenizer or processor".format(vocab - 1))


def check_max_new_tokens(max_new_tokens, name: str = "max_new_tokens") -> int:
    """A request's token limit: a whole number >= 1 (``name``: the argument as its caller spells it)."""
    try:
        n = operator.index(max_new_tokens)  # ints, numpy ints; not 12.5, "12" or True
    except TypeError:
        n = None
    if n is None or isinstance(max_new_tokens, bool) or n < 1:
        raise ArgumentError(f"{name} must be >= 1 (a whole number), got {max_new_tokens!r}; ask for at least one "
                            "token, or leave it out for the default", name)
    return n


def check_logprobs(logprobs, vocab: int, most: int | None = None) -> int | None:
    """None (no log-probabilities), or the alternatives wanted per token: 0 up to the vocabulary
    and to ``most`` (the decoder's ``max_logprobs``)."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, bool):
        try:
            k = operator.index(logprobs)
        except TypeError:
            k = None
        if k is not None and 0 <= k <= vocab:
            if most is not None and k > most:
                raise MMSpecError(f"logprobs={k} is more than this decoder's max_logprobs={most} (the widest it "
                                  "computes); ask for fewer, or build the decoder with a larger max_logprobs=")
            return k
    raise MMSpecError(f"logprobs must be a whole number from 0 to the vocabulary's {vocab} (the likeliest "
                      f"alternatives reported per token; 0: the token's own only) or None, got {logprobs!r}")


def check_max_logprobs(most) -> int:
    """``max_logprobs``: a whole number >= 0."""
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        raise MMSpecError(f"max_logprobs must be a whole number >= 0 (the most alternatives a request may ask "
                          f"per token; OpenAI's bound is 20), got {most!r}")
    return most


def check_seed(seed) -> int | None:
    if seed is None:
        return None
    if not isinstance(seed, bool):
        try:
            return operator.index(seed)  # ints, numpy ints; not 1.5 or "7"
        except TypeError:
            pass
    raise MMSpecError(f"seed must be a whole number (or None: a fresh one), got {seed!r}")


def check_temperature(temperature) -> float:
    if isinstance(temperature, (bool, str, bytes)):
        raise ArgumentError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}", "temperature")
    try:
        return float(temperature)
    except (TypeError, ValueError):
        raise ArgumentError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}",
                            "temperature") from None


def check_images_and_captions(images, captions) -> None:
    """``images=`` is a list of PIL pictures (one per image or video), never one picture alone;
    ``captions=`` a list of strings, never one string (it would be read letter by letter)."""
    if images is not None and (isinstance(images, (str, bytes)) or not isinstance(images, Sequence)):
        raise MMSpecError(f"images= takes a list of PIL images, one per image (or video) of the prompt in order, "
                          f"got a {type(images).__name__}; wrap a single one in a list")
    if captions is not None and (isinstance(captions, str) or not isinstance(captions, Sequence)
                                 or not all(isinstance(c, str) for c in captions)):
        raise MMSpecError(f"captions= takes a list of strings, one per image or video in prompt order, got "
                          f"{captions!r:.80}")


def check_video_inputs(target: ModelAdapter, mm: dict, videos, substitutes) -> None:
    """Inputs the target's family does not read would be silently ignored: video inputs given to
    a family that reads images only, or another family's processor outputs (``image_sizes`` for
    LLaVA-1.5, ...)."""
    family = f"{target.model.config.model_type}, {type(target.model).__name__}"
    if target.video_token_id is None:
        given = [k for k in VIDEO_INPUTS if mm.get(k) is not None]
        given += [name for name, v in (("videos", videos), ("substitutes", substitutes)) if v is not None]
        if given:
            raise MMSpecError(f"{', '.join(given)} given, but the target ({family}) reads images only: its prompts "
                              f"have no video slots. Video families: {', '.join(video_families())}; pass one of "
                              "them as the target, or give the video's frames as images")
    unread = sorted(k for k, v in mm.items() if v is not None and k != "pixel_values" and k not in target.mm_keys)
    if unread:
        raise MMSpecError(f"{', '.join(unread)} given, but the target's family ({family}) does not read it; it reads "
                          f"{', '.join(target.mm_keys)}: pass that family's processor output (or drop the rest)")
