"""Head directories on disk, whatever wrote them: which kind a directory holds (by content, never
by name), what it claims about its target (read from its config and the weights' header, no
tensor loaded), and loading it against a target.

One detection for every caller: ``SpecDecoder(target, DIR)``, ``generate --head``, ``bench run
--head``, ``serve --head``, ``export head`` and ``check head`` all go through :func:`head_kind` /
:func:`describe_head` / :func:`load_head`. Kinds: ``"mmspec"`` (:meth:`FeatureHead.save`),
``"eagle"`` (EAGLE-1/2), ``"eagle3"`` (SafeAILab / SpecForge / SGLang) and ``"speculators-eagle3"``.

This module sits above :mod:`.model` (the head itself, mmspec's own format) and :mod:`.formats`
(the other projects' formats); neither imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmspec.errors import MMSpecError, article
from mmspec.heads.formats import (
    _aux_layers,
    _read_config,
    _tensor_names,
    _weight_files,
    detect_format,
    load_external_head,
)
from mmspec.heads.model import CONFIG_NAME, FeatureHead, check_head_dir, load_saved_head

KIND_NAMES = {"mmspec": "mmspec", "eagle": "EAGLE-1/2", "eagle3": "EAGLE-3", "speculators-eagle3": "speculators EAGLE-3"}


def head_kind(path) -> str | None:
    """``"mmspec"``, ``"eagle"``, ``"eagle3"``, ``"speculators-eagle3"``, or None: not a head."""
    return detect_format(path)


def is_head_dir(path) -> bool:
    """A directory holding a draft head of any kind mmspec reads."""
    return head_kind(path) is not None


@dataclass(frozen=True)
class HeadInfo:
    """What a head directory says about itself, read without building the head.

    feature_layers: the target decoder layers whose outputs it reads (-1: the final, post-norm
        state); None when it follows the engines' default, which depends on the target's depth.
    target_layers: the decoder-layer count of the target it was made for, where recorded.
    """

    path: str
    kind: str
    variant: str
    hidden_size: int
    vocab_size: int | None
    feature_layers: tuple[int, ...] | None
    target_layers: int | None = None

    @property
    def kind_name(self) -> str:
        return KIND_NAMES[self.kind]


def _positive(cfg: dict, name: str, file: Path) -> int:
    v = cfg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise MMSpecError(f"'{file}': {name} must be a whole number >= 1, got {v!r}; the head's config is damaged: "
                          "re-download or re-export it")
    return v


def describe_head(path) -> HeadInfo:
    """The kind, variant, width, vocabulary and feature layers of a head directory, its config
    parsed and its weights' header read (a damaged one is refused here, before any model loads)."""
    p = Path(path)
    if not p.is_dir():
        raise MMSpecError(f"'{p}' is not a directory; pass a head directory (mmspec train head's --out, or an "
                          "EAGLE / EAGLE-3 / speculators head)")
    if (p / CONFIG_NAME).is_file():
        c = check_head_dir(p)
        return HeadInfo(str(p), "mmspec", c.variant, c.hidden_size, c.vocab_size, tuple(c.feature_layers),
                        c.target_num_layers)
    kind = detect_format(p)  # a config.json that does not parse is refused here, naming the file
    if kind is None:
        has_cfg = (p / "config.json").is_file()
        why = ("its config.json describes no EAGLE / EAGLE-3 head (a model directory goes to --target or --draft)"
               if has_cfg and _weight_files(p) else
               "it has a config.json but no weights (model.safetensors or pytorch_model.bin)" if has_cfg else
               f"it holds neither {CONFIG_NAME} (mmspec) nor a config.json with weights (EAGLE, EAGLE-3, speculators)")
        raise MMSpecError(f"'{p}' is not a draft head directory: {why}; pass the --out of mmspec train head or a "
                          "downloaded EAGLE / EAGLE-3 head")
    cfg = _read_config(p)
    file = p / "config.json"
    try:
        names = _tensor_names(p)
    except MMSpecError:
        raise
    except Exception as e:  # a truncated safetensors header, a zip that is not one
        raise MMSpecError(f"cannot read the weights of the head in '{p}' ({type(e).__name__}); the file is damaged "
                          "or incomplete: re-download or re-export it") from None
    if kind == "eagle":
        if "fc.weight" not in names:
            raise MMSpecError(f"the EAGLE head in '{p}' lacks fc.weight; re-download or re-export it")
        return HeadInfo(str(p), kind, "eagle", _positive(cfg, "hidden_size", file),
                        cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None, (-1,))
    flat = {**(cfg.get("transformer_layer_config") or {}), **cfg} if kind == "speculators-eagle3" else cfg
    hidden = _positive(flat, "hidden_size", file)
    sgl = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    layers = _aux_layers(cfg, 0) if (sgl or vllm) else None
    vocab = flat.get("vocab_size") if isinstance(flat.get("vocab_size"), int) else None
    recorded = (cfg.get("mmspec") or {}).get("target_num_layers")
    return HeadInfo(str(p), kind, "eagle3", hidden, vocab, layers, recorded if isinstance(recorded, int) else None)


def load_head(path, target=None) -> FeatureHead:
    """A head directory of any kind as a :class:`FeatureHead`: mmspec's own (checked against
    ``target`` when given), or an EAGLE-1/2 / EAGLE-3 / speculators head, imported against
    ``target`` (which it then needs: its layers and vocabulary are read from it)."""
    path = Path(path)
    kind = head_kind(path)
    if kind is not None and kind != "mmspec":
        if target is None:
            name = KIND_NAMES[kind]
            raise MMSpecError(f"'{path}' is {article(name)} {name} head: it is read against its target; pass the target")
        return load_external_head(path, target)
    return load_saved_head(path, target)


def target_shape(target) -> tuple[int, int, int]:
    """(width, vocabulary, decoder layers) of a target, from its ``config.json`` alone: a
    directory or hub id (:func:`mmspec.models.loading.locate`), None for the embedded target."""
    import json

    if target is None:
        from mmspec.embedded import default_path

        path = default_path() / "target"
    else:
        from mmspec.models.loading import locate

        path = Path(locate(str(target), "--target"))
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MMSpecError(f"cannot read the target's config.json in '{path}' ({type(e).__name__}); pass the "
                          "directory save_pretrained() wrote") from None
    tc = cfg.get("text_config") or cfg
    return (int(tc.get("hidden_size") or 0), int(tc.get("vocab_size") or cfg.get("vocab_size") or 0),
            int(tc.get("num_hidden_layers") or 0))


def check_head_target(info: HeadInfo, target) -> None:
    """Refuse a head made for another target (width, vocabulary, the layers it reads) from the
    two configs alone, before any weight loads; ``target``: a path, hub id or None (embedded)."""
    hidden, vocab, layers = target_shape(target)
    problems = []
    if hidden and info.hidden_size != hidden:
        problems.append(f"width {info.hidden_size} vs the target's {hidden}")
    if vocab and info.vocab_size is not None and info.vocab_size != vocab:
        problems.append(f"vocabulary {info.vocab_size} vs the target's {vocab}")
    if layers and info.feature_layers and any(i >= layers or i < -1 for i in info.feature_layers):
        problems.append(f"it reads the outputs of layers {list(info.feature_layers)} of a target with {layers} "
                        "decoder layers")
    elif layers and info.target_layers and info.target_layers != layers:
        problems.append(f"it was made for a target with {info.target_layers} decoder layers, this one has {layers}")
    if problems:
        where = "the embedded target" if target is None else f"the target '{target}'"
        raise MMSpecError(f"the {info.kind_name} head in '{info.path}' does not fit {where} ("
                          + "; ".join(problems) + "); use a head trained for this target, or train one with "
                          "mmspec train head --target DIR")
