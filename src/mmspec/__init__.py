"""mmspec: lossless speculative decoding for multimodal LLMs (IbED in-batch ensemble drafting).

Public API: :class:`SpecDecoder` (the decoder), :class:`GenerationResult`, :class:`GenerationStats`,
:func:`load_embedded` (the tiny models of the embedded synthetic world). Imports are lazy so
``import mmspec`` stays cheap and has no side effects.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "SpecDecoder": ("mmspec.decoder", "SpecDecoder"),
    "DecoderConfig": ("mmspec.config", "DecoderConfig"),
    "DraftConfig": ("mmspec.config", "DraftConfig"),
    "TreeConfig": ("mmspec.config", "TreeConfig"),
    "RuntimeConfig": ("mmspec.config", "RuntimeConfig"),
    "AcceptanceOptions": ("mmspec.config", "AcceptanceOptions"),
    "GenerationResult": ("mmspec.results", "GenerationResult"),
    "GenerationStats": ("mmspec.stats", "GenerationStats"),
    "MMSpecError": ("mmspec.errors", "MMSpecError"),
    "load_embedded": ("mmspec.embedded", "load_embedded"),
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'mmspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (tab completion shows ``SpecDecoder`` before anything is imported)."""
    return sorted(set(__all__) | set(globals()))
