"""Loading models and tokenizers from a local directory or a hub id through transformers'
Auto classes, with errors that say what to do instead of deep transformers stack traces; and
:func:`read_sidecar`, the ``mmspec.json`` an ``mmspec train`` checkpoint keeps beside its weights."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from mmspec.errors import MMSpecError

SIDECAR = "mmspec.json"  # written by mmspec.train.checkpoint.save_checkpoint


def read_sidecar(directory: str | Path) -> dict:
    """The ``mmspec.json`` of a checkpoint directory (role, pooled token count, captioner prompt,
    training record); {} when absent."""
    path = Path(directory) / SIDECAR
    return json.loads(path.read_text()) if path.exists() else {}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """A --dtype string (or torch dtype) -> torch dtype, or "auto" (the checkpoint's own); unknown: a clear error."""
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float64": torch.float64}
    if dtype not in table:
        raise MMSpecError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def compute_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None) -> torch.dtype | str:
    """The dtype to load in on ``device``: "auto" is float32 on the CPU (where fp16 and bf16
    matmuls run several times slower than float32), the checkpoint's own elsewhere."""
    resolved = resolve_dtype(dtype)
    if resolved == "auto" and torch.device(device or "cpu").type == "cpu":
        return torch.float32
    return resolved


def _looks_like_hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and name.count("/") == 1 and "\\" not in name


def _offline_flag() -> bool:
    from huggingface_hub import constants

    env = any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(constants.HF_HUB_OFFLINE)


@functools.cache
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers one request now: no retries, ``timeout_s`` at most
    (transformers' own downloads retry with back-off for minutes on a machine without network)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - any failure to connect means: not reachable from here
        return False


def _cached_snapshot(repo_id: str) -> str | None:
    """The local snapshot directory of a hub id in the Hugging Face cache, if its config is there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id: not cached
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def locate(name: str, what: str = "model path") -> str:
    """What to pass to ``from_pretrained`` for ``name``, found fast and local files first: a local
    directory as given; a hub id as given when the hub answers, else its copy in the Hugging
    Face cache (the snapshot directory, read without network). Anything else is refused in one
    line: a file ("not a directory"), a missing path, a hub id with neither hub nor cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        return name
    if path.exists():
        hint = f" (its directory {str(path.parent)!r} holds a config.json)" if (path.parent / "config.json").is_file() else ""
        raise MMSpecError(f"{what} {name!r} is a file, not a directory; pass the directory save_pretrained() "
                          f"wrote, the one holding config.json{hint}")
    if not _looks_like_hub_id(name):
        raise MMSpecError(
            f"{what} {name!r} does not exist; pass a local directory saved with "
            "save_pretrained() or a hub id such as 'llava-hf/llava-1.5-7b-hf'"
        )
    if not _offline_flag() and hub_reachable():
        return name
    cached = _cached_snapshot(name)
    if cached is not None:
        return cached
    why = "HF_HUB_OFFLINE is set" if _offline_flag() else "the Hugging Face hub cannot be reached from here"
    raise MMSpecError(
        f"{what} {name!r} is not a local directory, {why} and the Hugging Face cache has no copy; download it "
        f"once where there is network (`hf download {name} --local-dir DIR`, then copy DIR here) and pass DIR"
    )


def load_model(name_or_path: str, *, dtype: str | torch.dtype | None = "auto", device: str | None = None):
    """Load a VLM (image-text-to-text) or a causal LM; returns the model in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    name_or_path = locate(str(name_or_path))
    local = Path(name_or_path).exists()
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        if local:
            raise MMSpecError(
                f"{name_or_path!r} is not a model directory transformers can read: {_first_line(e)}. "
                "Pass a directory written by save_pretrained() (config.json with a model_type, and the weights)"
            ) from None
        raise MMSpecError(
            f"could not read a model config from {name_or_path!r} ({e.__class__.__name__}: {_first_line(e)}). "
            "Without network access only local directories work: download the model once "
            "elsewhere and pass its directory."
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    vlm = config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or hasattr(config, "vision_config")
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(name_or_path, dtype=resolve_dtype(dtype))
    except ValueError as e:  # a config class neither Auto mapping knows
        raise MMSpecError(
            f"{name_or_path!r} (model_type={config.model_type!r}) is neither an image-text-to-text "
            f"model nor a causal LM that transformers can load: {e}"
        ) from None
    except OSError as e:  # a config but no (readable) weights
        raise MMSpecError(
            f"could not load the weights of {name_or_path!r}: {_first_line(e)}. The directory needs the "
            "weights save_pretrained() writes (model.safetensors, or its shards and index)"
        ) from None
    if device:
        model = model.to(resolve_device(device))
    return model.eval()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [e.__class__.__name__])[0]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A --device string -> torch.device, refusing one this machine does not have (a typo, CUDA
    on a CPU-only torch build or machine, a GPU index past the last) with the fix."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MMSpecError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise MMSpecError(f"device {device!r} asked for, but this torch build or machine has no CUDA GPU; "
                              "use --device cpu (or install a CUDA build of torch on a GPU machine)")
        if dev.index is not None and dev.index >= n:
            raise MMSpecError(f"device {device!r} asked for, but this machine has {n} CUDA GPU(s): "
                              f"use cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise MMSpecError(f"device {device!r} asked for, but MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):  # xpu, npu, hpu...: where torch has the backend
        backend = getattr(torch, dev.type, None)
        if not (backend is not None and hasattr(backend, "is_available") and backend.is_available()):
            raise MMSpecError(f"device {device!r} asked for, but this torch build or machine has no "
                              f"{dev.type} device; use --device cpu")
    return dev


def _load_auto(cls_name: str, what: str, name_or_path: str):
    import transformers

    name_or_path = locate(str(name_or_path))
    try:
        return getattr(transformers, cls_name).from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise MMSpecError(f"could not load a {what} from {name_or_path!r}: {e}") from None


def load_tokenizer(name_or_path: str):
    return _load_auto("AutoTokenizer", "tokenizer", name_or_path)


# files a saved tokenizer has at least one of (AutoTokenizer builds a stand-in for some model
# types when there are none, e.g. Qwen2's one-token vocabulary, so their absence must be seen)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "spm.model", "tekken.json")


def _has_tokenizer_files(name_or_path: str) -> bool:
    if Path(name_or_path).is_dir():
        return any((Path(name_or_path) / f).is_file() for f in TOKENIZER_FILES)
    from transformers.utils import cached_file

    return any(cached_file(name_or_path, f, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False) for f in TOKENIZER_FILES)


def load_tokenizer_if_any(name_or_path: str):
    """The tokenizer saved with a draft checkpoint, or None where it has none (many drafts ship
    weights only) or it cannot be read: the vocabulary comparison it serves is advisory, and the
    draft is usable without it (the target verifies every token)."""
    import warnings

    try:
        name_or_path = locate(name_or_path)
    except MMSpecError:
        return None  # loading the draft's weights says what is wrong with the path
    try:
        if not _has_tokenizer_files(name_or_path):
            return None
        return load_tokenizer(name_or_path)
    except Exception as e:  # noqa: BLE001 - a tokenizer we cannot read is one we cannot compare
        warnings.warn(f"could not read the draft's tokenizer from {name_or_path!r} ({_first_line(e)}); "
                      "its vocabulary is not compared with the target's", stacklevel=2)
        return None


def load_saved_tokenizer(name_or_path: str):
    """The tokenizer saved at ``name_or_path``, refusing a checkpoint without tokenizer files
    (where AutoTokenizer would build a stand-in for some model types and compare as wrong)."""
    name_or_path = locate(name_or_path)
    if not _has_tokenizer_files(name_or_path):
        raise MMSpecError(f"{name_or_path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                          "pass the directory the tokenizer was saved to")
    return load_tokenizer(name_or_path)


def check_same_vocabulary(target_tok, draft_tok) -> None:
    """Refuse a draft whose tokenizer maps an id of the base vocabulary to another token than the
    target's. The same size is not the same vocabulary: the draft's proposals would mean other
    words and nearly all be rejected (lossless still, but slower than the target alone). Tokens
    added on top of a base vocabulary (llava-hf's <image>, a fine-tune's <pad>) are not compared:
    a draft never needs to propose them, and the target verifies every token anyway."""
    if draft_tok is None or draft_tok is target_tok:
        return
    n = min(target_tok.vocab_size, draft_tok.vocab_size)  # base vocabularies, added tokens excluded
    t = target_tok.convert_ids_to_tokens(list(range(n)))
    d = draft_tok.convert_ids_to_tokens(list(range(n)))
    for i, (a, b) in enumerate(zip(t, d)):
        if a != b:
            raise MMSpecError(
                f"draft and target have different vocabularies: id {i} is {a!r} in the target's "
                f"tokenizer but {b!r} in the draft's. Speculative decoding needs the draft to use "
                "the target's tokenizer; pick a draft trained with it")


# families whose processor imports torchvision (their video processor): (name, the extra that brings it)
TORCHVISION_FAMILIES = {"qwen2_vl": ("Qwen2-VL", "qwen"), "qwen2_5_vl": ("Qwen2.5-VL", "qwen"),
                        "llava_onevision": ("LLaVA-OneVision", "video"), "video_llava": ("Video-LLaVA", "video")}
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "image_processor_config.json")


def _model_type(path: str) -> str:
    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


_PROCESSOR_FIX = ("save the target's processor beside its weights (processor.save_pretrained(DIR)), or copy its "
                  "files from the original checkpoint")


def check_processor_files(path: str) -> None:
    """A local checkpoint directory holds a processor: tokenizer files and an image processor's
    config (a hub id is left to transformers). Reads no file, loads nothing."""
    if not Path(path).is_dir():
        return
    has_tok = _has_tokenizer_files(path)
    has_proc = any((Path(path) / f).is_file() for f in PROCESSOR_FILES)
    if not (has_tok or has_proc):
        raise MMSpecError(f"{path!r} has no processor or tokenizer (none of {', '.join(PROCESSOR_FILES)}, "
                          f"{', '.join(TOKENIZER_FILES[:3])}, ...); {_PROCESSOR_FIX}")
    if not has_tok:
        raise MMSpecError(f"{path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); {_PROCESSOR_FIX}")
    if not has_proc:
        raise MMSpecError(f"{path!r} has no image processor ({' or '.join(PROCESSOR_FILES)}); {_PROCESSOR_FIX}")


def load_processor(name_or_path: str):
    """The target's processor (tokenizer + image/video processors). A local directory without
    one, and a processor that needs torchvision where it is missing, are refused in one line."""
    import transformers

    name_or_path = locate(str(name_or_path))
    local = Path(name_or_path).is_dir()
    check_processor_files(name_or_path)
    try:
        return transformers.AutoProcessor.from_pretrained(name_or_path)
    except ImportError as e:
        if "torchvision" in str(e).lower():
            family, extra = TORCHVISION_FAMILIES.get(_model_type(name_or_path) if local else "", ("this model", "video"))
            raise MMSpecError(f"{family}'s processor needs torchvision: pip install 'mmspec[{extra}]' "
                              "(or torchvision)") from None
        raise MMSpecError(f"could not load a processor from {name_or_path!r}: {_first_line(e)}") from None
    except (OSError, ValueError, TypeError) as e:
        raise MMSpecError(f"could not load a processor from {name_or_path!r}: {_first_line(e)}; {_PROCESSOR_FIX}") from None


def check_model_flags(target: str | None, draft: str | None, captioner: str | None,
                      captioner_prompt: str | None) -> None:
    """Refuse model flags that would be ignored, naming the flag and the fix: a draft without a
    target, a target without a draft, a captioner or captioner prompt with the embedded models
    (which bring their own), a captioner prompt without a captioner."""
    if target is None:
        if draft is not None:
            raise MMSpecError("--draft needs --target too (or pass neither to use the embedded models)")
        for flag, value in (("--captioner", captioner), ("--captioner-prompt", captioner_prompt)):
            if value is not None:
                raise MMSpecError(f"{flag} applies to --target/--draft checkpoints; the embedded models bring "
                                  f"their own captioner. Drop {flag}, or pass --target and --draft too")
        return
    if draft is None:
        raise MMSpecError("--target was given without --draft; pass a draft checkpoint too")
    if captioner_prompt is not None and captioner is None:
        raise MMSpecError("--captioner-prompt was given without --captioner; pass the captioner it prompts, "
                          "or drop it")
