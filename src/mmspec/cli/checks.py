"""Every option of ``generate``, ``demo`` and ``bench run`` checked in ONE place per command, before
any model loads or any file is written: numbers and their ranges, paths (existence and kind),
the tree notation, and the combinations the docs rule out (a head with views, a video for an
image-only target, ``--stop-below`` with a tree, ...). Each check raises an MMSpecError that
names the flag in CLI words and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mmspec.cli.options import ModelFlags, RuntimeFlags, ShapeFlags, ViewFlags
from mmspec.errors import MMSpecError

# the model_type of every family that reads videos (models/*.py)
VIDEO_FAMILIES = ("llava_onevision", "video_llava", "qwen2_vl", "qwen2_5_vl")


def at_least(flag: str, value, low: int = 1) -> None:
    """A whole-number option's range (``--gamma``, ``--repeats``, ``-n``, ...)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise MMSpecError(f"{flag} must be >= {low} (a whole number), got {value!r}")


def check_sampling(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    from mmspec.runtime.verify import SamplingParams

    if not math.isfinite(temperature) or temperature < 0:
        raise MMSpecError(f"--temperature: temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        flag = "--top-k" if top_k is not None else "--top-p"
        raise MMSpecError(f"{flag} filters sampling; with --temperature 0 (greedy) it would be ignored: add "
                          f"--temperature > 0, or drop {flag}")
    try:
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    except MMSpecError as e:
        flag = "--top-k" if "top_k" in str(e) else "--top-p" if "top_p" in str(e) else "--temperature"
        raise MMSpecError(f"{flag}: {e}") from None


def check_threads(threads: int | None) -> None:
    if threads is not None and (isinstance(threads, bool) or threads < 1):
        raise MMSpecError(f"--threads must be >= 1, got {threads}; or leave it out for the cores the machine leaves idle")


def check_device(device: str | None) -> None:
    """A device this machine has (``--device cuda`` on a CPU-only torch: "use --device cpu")."""
    from mmspec.models.loading import resolve_device

    if device is not None:
        resolve_device(device)


def head_variant(path: str, target: str | None = None) -> str:
    """The variant of a head directory of any kind (mmspec, EAGLE-1/2, EAGLE-3, speculators:
    :func:`mmspec.heads.directory.describe_head`), checked readable (config, the weights' header)
    and against ``target``'s config (None: the embedded target) without loading any weights."""
    from mmspec.heads.directory import check_head_target, describe_head

    info = describe_head(path)
    check_head_target(info, target)
    return info.variant


def check_model_dir(name: str | None, flag: str) -> None:
    """A model flag names a directory save_pretrained() wrote (config.json), or a hub id this
    machine can get; a draft head directory given where a model belongs is named as such."""
    from mmspec.heads.directory import KIND_NAMES, head_kind
    from mmspec.models.loading import check_processor_files, locate

    if name is None:
        return
    kind = head_kind(name)
    if kind is not None:
        what = "mmspec_head.json" if kind == "mmspec" else f"an {KIND_NAMES[kind]} head"
        raise MMSpecError(f"{flag} {name!r} is a draft head directory ({what}), not a model; pass it "
                          f"as --head {name}" + (" (bench: --head VARIANT=DIR)" if flag != "--draft" else ""))
    path = Path(locate(name, flag))
    if path.is_dir() and not (path / "config.json").is_file():
        raise MMSpecError(f"{flag} {name!r} is not a model directory (no config.json); pass the directory "
                          "save_pretrained() wrote" + (", or a draft head directory" if flag == "--draft" else ""))
    if flag != "--draft":
        check_processor_files(str(path))  # the target's and captioner's processors load from their directories


def model_type_of(name: str) -> str:
    """``config.json``'s model_type of a checkpoint directory or hub id (no weights read)."""
    import json

    from mmspec.models.loading import locate

    path = Path(locate(name, "--target"))
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


# ------------------------------------------------------------------------------- generate
@dataclass
class GenerateOptions:
    """``mmspec generate``'s flags; :func:`check_generate` fills the derived fields."""

    prompt: str | None = None
    image: list = field(default_factory=list)
    video: list = field(default_factory=list)
    frames: int = 8
    # the flags of the groups generate and serve share: their defaults are the groups' (mmspec.cli.options,
    # which take the decoder's from mmspec.config)
    target: str | None = ModelFlags.target
    draft: str | None = ModelFlags.draft
    head: str | None = ModelFlags.head
    captioner: str | None = ModelFlags.captioner
    captioner_prompt: str | None = ModelFlags.captioner_prompt
    views: str = ViewFlags.views
    weights: str | None = ViewFlags.weights
    gamma: int | None = ShapeFlags.gamma
    tree: str | None = ShapeFlags.tree
    tree_depth: int | None = ShapeFlags.tree_depth
    tree_topk: int | None = ShapeFlags.tree_topk
    tree_budget: int | None = ShapeFlags.tree_budget
    tree_children: str = ViewFlags.tree_children
    stop_below: float | None = ShapeFlags.stop_below
    cuda_graphs: str = RuntimeFlags.cuda_graphs
    compile: bool = RuntimeFlags.compile
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    dtype: str = RuntimeFlags.dtype
    device: str = RuntimeFlags.device
    threads: int | None = RuntimeFlags.threads
    model_free: str | None = ModelFlags.model_free  # --model-free lookup|suffix beside the draft
    lookup_options: str | None = ModelFlags.lookup_options  # --lookup-options KEY=VALUE,...
    check_head: bool = True  # a head runs a short calibration on load (mmspec.heads.check; the CLI's default: on)
    json_schema: Path | None = None  # --json-schema FILE
    regex: str | None = None  # --regex R
    choice: str | None = None  # --choice A,B,C
    # derived by check_generate
    caption_view: bool = False  # --views has C
    draft_reads_own_images: bool = False  # a VLM draft of another family: its own processor reads the images
    view_list: list = field(default_factory=list)
    weight_list: object = None  # [numbers], an AdaptiveWeights, or None (equal)
    graphs: object = "auto"
    lookup_dict: dict | None = None  # --lookup-options, parsed
    alone: str | None = None  # --draft lookup|suffix
    constraint: object = None  # a mmspec.constrain.Constraint from --json-schema / --regex / --choice


def check_generate(o: GenerateOptions) -> GenerateOptions:
    """All of ``generate``'s options; returns ``o`` with the head found and the derived fields set."""
    _check_numbers(o)
    _check_inputs(o)
    o.constraint = check_constraint(o.json_schema, o.regex, o.choice)
    _check_models(o)
    return o


def check_constraint(json_schema: Path | None, regex: str | None, choice: str | None):
    """``--json-schema FILE`` / ``--regex R`` / ``--choice A,B,C`` -> a Constraint (None: none given):
    one of them, the file readable JSON, the schema one the grammar can enforce, the choices non-empty."""
    import json

    from mmspec.constrain import Constraint
    from mmspec.serve.structured import check_schema

    given = [f for f, v in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice)) if v is not None]
    if len(given) > 1:
        raise MMSpecError(f"{' and '.join(given)} were given together; an answer follows one constraint: pass one")
    if not given:
        return None
    if json_schema is not None:
        path = Path(json_schema)
        if not path.is_file():
            raise MMSpecError(f"--json-schema {str(path)!r} {'is a directory' if path.is_dir() else 'not found'}; "
                              "pass a .json file holding the JSON schema the answer must follow")
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise MMSpecError(f"--json-schema {str(path)!r} is not valid JSON ({e}); write the schema as a JSON "
                              'object, like {"type": "object", "properties": {"label": {"type": "string"}}}') from None
        c = Constraint("json_schema", schema=check_schema(schema, f"--json-schema {path.name}"), name=path.stem)
    elif regex is not None:
        c = Constraint("regex", pattern=regex)
    else:
        choices = tuple(x.strip() for x in choice.split(","))
        if not any(choices):
            raise MMSpecError(f"--choice {choice!r} lists no strings; give the answers to choose from, comma-separated "
                              "(--choice yes,no)")
        if not all(choices):
            raise MMSpecError(f"--choice {choice!r} has an empty choice (two commas, or one at an end); every choice "
                              "must be a non-empty string")
        c = Constraint("choice", choices=choices)
    try:
        c.check()
    except MMSpecError as e:
        raise MMSpecError(f"{given[0]}: {e}") from None
    return c


def check_decoder(o: GenerateOptions) -> GenerateOptions:
    """The model and decoding options alone, as :func:`check_generate` checks them (``mmspec
    serve``: the prompts, images and sampling settings come with each request)."""
    _check_numbers(o)
    _check_models(o)
    return o


def _check_numbers(o: GenerateOptions) -> None:
    """Numbers and their ranges, the block shape, sampling, views, dtype and device."""
    from mmspec.cli.common import graphs_flag, parse_weights
    from mmspec.drafting.tree import DEFAULT_GAMMA, is_auto, parse_shapes
    from mmspec.models.loading import resolve_dtype

    at_least("--max-new-tokens", o.max_new_tokens)
    at_least("--gamma", o.gamma)
    at_least("--frames", o.frames)
    check_threads(o.threads)
    check_sampling(o.temperature, o.top_k, o.top_p)
    tree_given = o.tree is not None and o.tree.strip().lower() != "chain" and not is_auto(o.tree)  # auto: gamma's chain too
    if o.gamma is not None and tree_given:
        raise MMSpecError("--gamma is a chain's length; a tree's shape is --tree's (DEPTHxTOPKxBUDGET, or "
                          "--tree dynamic with --tree-depth/--tree-topk/--tree-budget): drop --gamma")
    # o.gamma stays None when not given: SpecDecoder's default, and refused by it beside a tree
    parse_shapes(o.tree, gamma=DEFAULT_GAMMA if o.gamma is None else o.gamma, device_type=o.device.split(":")[0], depth=o.tree_depth, topk=o.tree_topk,
                 budget=o.tree_budget, children=o.tree_children, stop_below=o.stop_below, spelling="cli")
    if o.seed is not None and o.temperature == 0:
        raise MMSpecError("--seed seeds sampling; with --temperature 0 (greedy) the output is the same without it: "
                          "add --temperature > 0, or drop --seed")
    o.graphs = graphs_flag(o.cuda_graphs)
    if o.graphs is True and not o.device.startswith("cuda"):
        raise MMSpecError(f"--cuda-graphs on needs a CUDA device (--device cuda), not {o.device!r}; use "
                          "--cuda-graphs auto or off")
    at_least("--seed", o.seed, 0)
    o.weight_list = parse_weights(o.weights)
    if isinstance(o.weight_list, list) and (not all(math.isfinite(w) and w >= 0 for w in o.weight_list)
                                      or sum(o.weight_list) <= 0):
        raise MMSpecError(f"--weights {o.weights}: each weight must be a finite number >= 0, and one > 0")
    o.view_list = [v.strip() for v in o.views.split(",") if v.strip()]
    _check_views(o)
    resolve_dtype(o.dtype)
    check_device(o.device)


def _check_inputs(o: GenerateOptions) -> None:
    """The prompt and its images and videos."""
    from mmspec.cli.common import check_prompt
    from mmspec.inputs import check_video_path, with_markers

    check_prompt(o.prompt)
    if o.prompt is None and (o.image or o.video):
        raise MMSpecError(f"{'--image' if o.image else '--video'} was given without --prompt; say what to ask "
                          "about the image(s) or video(s)")
    if o.prompt is None and o.target is not None:
        raise MMSpecError("pass --prompt (and --image for each image, --video for each video)")
    for p in o.image:
        if Path(p).is_dir():
            raise MMSpecError(f"--image {str(p)!r} is a directory, not an image file; pass one file per --image "
                              "(a directory of a video's frames goes to --video)")
        if not Path(p).is_file():
            raise MMSpecError(f"image file not found: {str(p)!r}; check the path given to --image")
    for v in o.video:
        check_video_path(v)
    if o.frames != 8 and not o.video:
        raise MMSpecError("--frames sets the frames taken from each --video; there is none: drop --frames or add --video")
    if o.prompt is not None:
        with_markers(o.prompt, len(o.image), len(o.video))  # slots against images and videos


def _check_models(o: GenerateOptions) -> None:
    """The draft (a model, or a head), the model directories and what the target family reads."""
    from mmspec.models.loading import check_model_flags

    _check_model_free(o)
    _check_draft(o)
    given = (o.draft if o.target else None) if o.alone else o.draft if o.head is None else (o.head if o.target else None)
    check_model_flags(o.target, given, o.captioner, o.captioner_prompt)
    if o.captioner is not None and not o.caption_view and o.head is None:
        raise MMSpecError(f"--captioner is read by the caption view (C) only, and --views {o.views} has none: "
                          "add C to --views, or drop --captioner")
    for flag, name in (("--target", o.target), ("--draft", None if o.alone else o.draft), ("--captioner", o.captioner)):
        check_model_dir(name, flag)  # local directories first; a hub id that cannot be had fails in one line
    if o.target is not None and o.draft is not None and not o.alone:
        o.draft_reads_own_images = _other_vision_family(o.target, o.draft)
        if o.draft_reads_own_images and o.video:
            raise MMSpecError("--video: a draft of another family than the target reads images only (through its "
                              "own processor); pass a draft of the target's family, a text-only draft, or a head")
    if o.video:
        family = "llava" if o.target is None else model_type_of(o.target)
        if family not in VIDEO_FAMILIES:
            what = "the embedded target (LLaVA-1.5)" if o.target is None else f"the target ({family or 'unknown'})"
            raise MMSpecError(f"--video: {what} reads images only; a video needs a target of a video family "
                              f"({', '.join(VIDEO_FAMILIES)}), or pass its frames as --image")


def _other_vision_family(target: str, draft: str) -> bool:
    """The draft is a vision-language model of another family than the target, with a processor
    of its own saved beside it (then it reads the PIL images through it: ``draft_processor``)."""
    import json

    from mmspec.models.loading import PROCESSOR_FILES, locate

    path = Path(locate(draft, "--draft"))
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    own = any((path / f).is_file() for f in PROCESSOR_FILES)
    return own and "vision_config" in cfg and cfg.get("model_type") != model_type_of(target)


def _check_views(o: GenerateOptions) -> None:
    """Views that exist, one weight per view, a captioner only where a caption view reads it. With
    no draft model (``--draft lookup|suffix``, a head) there are no views to weigh: ``--weights``
    is refused by the model checks, not matched against ``--views`` (whose advice would be refused)."""
    from mmspec.checks import model_free_name
    from mmspec.drafting.views import parse_views
    from mmspec.heads.directory import is_head_dir

    try:
        kinds = [v.kind for v in parse_views(o.view_list)]
    except MMSpecError as e:
        raise MMSpecError(f"--views {o.views}: {e}") from None
    o.caption_view = "caption" in kinds
    if o.head is not None or model_free_name(o.draft) is not None or (o.draft is not None and is_head_dir(o.draft)):
        return
    if o.weight_list is not None and not isinstance(o.weight_list, list) and len(kinds) < 2:
        raise MMSpecError(f"--weights {o.weights}: adaptive weights weigh two views or more, --views {o.views} is "
                          "one; use e.g. --views MT --weights adaptive")
    if isinstance(o.weight_list, list) and len(o.weight_list) != len(kinds):
        raise MMSpecError(f"--weights gives {len(o.weight_list)} weight(s) for {len(kinds)} view(s) ({o.views}); "
                          "give one per view, e.g. --views MT --weights 1,0.5")


def _check_model_free(o: GenerateOptions) -> None:
    """``--draft lookup|suffix`` (no model), ``--model-free`` beside a draft, ``--lookup-options``:
    the settings in range, and no flag that only a draft model reads (SpecDecoder's own checks,
    spelled as flags)."""
    from mmspec.checks import check_model_free, model_free_name

    o.alone = model_free_name(o.draft)
    if o.lookup_options is not None:
        o.lookup_dict = {}
        for item in (x.strip() for x in o.lookup_options.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise MMSpecError(f"--lookup-options {o.lookup_options!r}: write KEY=VALUE pairs joined by commas, "
                                  "e.g. ngram_max=3,suffix_mb=32")
            try:
                o.lookup_dict[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                raise MMSpecError(f"--lookup-options: {key.strip()}={value.strip()!r} is not a number") from None
    if o.alone is not None and o.head is not None:
        raise MMSpecError(f"--draft {o.alone} and --head both give the draft; pass --head DIR --model-free {o.alone} "
                          "to add it to the head's tree")
    check_model_free(o.alone, o.model_free, o.lookup_dict, spelling="cli", views_shown=o.views,
                     views=o.view_list or ["M"], weights=o.weights, captioner=o.captioner, draft_processor=None,
                     substitute=None, draft_tokenizer=None, tree_children=o.tree_children)
    if o.model_free is not None and o.draft is None and o.head is None and o.target is not None:
        raise MMSpecError(f"--model-free {o.model_free} adds its proposals beside a draft; give --draft or --head, "
                          f"or draft with it alone: --draft {o.model_free}")


def _check_draft(o: GenerateOptions) -> None:
    """``--draft HEAD_DIR`` is ``--head HEAD_DIR``; a head takes no views, weights or captioner."""
    from mmspec.heads.directory import is_head_dir

    if o.draft is not None and is_head_dir(o.draft):
        if o.head is not None:
            raise MMSpecError("--draft and --head both give the draft; pass one of them")
        o.head, o.draft = o.draft, None
    if o.head is None:
        return
    if o.draft is not None:
        raise MMSpecError("--draft and --head both give the draft; pass one of them (a head drafts alone)")
    if not Path(o.head).is_dir():
        raise MMSpecError(f"--head {o.head!r} is not a directory; pass a head directory (mmspec train head's --out, "
                          "or an EAGLE / EAGLE-3 / speculators head)")
    try:
        head_variant(o.head, o.target)
    except MMSpecError as e:
        raise MMSpecError(f"--head {o.head}: {e}") from None
    letters = o.views.replace(",", "").strip()
    if letters.upper() not in ("M", "MULTIMODAL"):
        raise MMSpecError(f"--views {o.views} does not apply to a head: it drafts from the target's own hidden "
                          "states (one view). Drop --views, or pass --draft MODEL_DIR for the views")
    for flag, value in (("--weights", o.weights), ("--captioner", o.captioner)):
        if value is not None:
            raise MMSpecError(f"{flag} does not apply to a head (it drafts from the target's own hidden states); "
                              f"drop {flag}")


# ------------------------------------------------------------------------------- demo
def check_demo(methods: list[str], families: list[str], max_new_tokens: int, gamma: int, repeats: int,
               threads: int | None, heads: dict | None = None) -> None:
    """``mmspec demo``: numbers, family names, and every method (with its tree) in bench notation."""
    from mmspec.bench.config import parse_method
    from mmspec.drafting.views import parse_views
    from mmspec.world import FAMILIES

    at_least("--max-new-tokens", max_new_tokens)
    at_least("--gamma", gamma)
    at_least("--repeats", repeats)
    check_threads(threads)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise MMSpecError(f"--families: unknown family {', '.join(map(repr, unknown)) or '(none given)'}; "
                          f"use some of {', '.join(FAMILIES)}")
    if not methods:
        raise MMSpecError("--methods is empty; give drafting methods such as M,T,MT")
    heads = heads or {}
    for variant, path in heads.items():
        try:
            if head_variant(path) != variant:
                raise MMSpecError(f"that directory holds a {head_variant(path)} head, not the {variant} one named")
        except MMSpecError as e:
            raise MMSpecError(f"--head {variant}={path}: {e}") from None
    for m in methods:
        try:
            views_m, kw_m = parse_method(m)
            if "head" in kw_m:
                if kw_m["head"] not in heads:
                    raise MMSpecError(f"{m!r} drafts with a trained head: add --head {kw_m['head']}=DIR (no head "
                                      "ships with the embedded pack)")
                continue
            parse_views(views_m or ("M",))  # lookup / suffix alone: no views
        except MMSpecError as e:
            raise MMSpecError(f"--methods: {e}") from None
