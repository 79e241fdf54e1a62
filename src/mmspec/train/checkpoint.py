"""Checkpoints as plain Hugging Face directories (what vLLM / transformers load unchanged).

Owns: :func:`save_half` (fp16 safetensors, the model in memory untouched) and
:func:`save_checkpoint` (model + tokenizer + processor + ``mmspec.json``, our sidecar with the
role, the pooled token count, the captioner prompt and the training summary). A directory
written here loads offline with ``LlavaForConditionalGeneration.from_pretrained(dir)`` and
``AutoProcessor.from_pretrained(dir)``; :func:`mmspec.models.loading.read_sidecar` reads the sidecar
back (the loaders need it without importing ``mmspec.train``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from mmspec.models.loading import SIDECAR  # read back by mmspec.models.loading.read_sidecar


def save_half(model, directory: str | Path) -> Path:
    """Save ``model`` as fp16 safetensors + config in ``directory`` (load upcasts with ``dtype=``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    half = copy.deepcopy(model).to(torch.float16)
    half.save_pretrained(directory, safe_serialization=True)
    return directory


def save_checkpoint(model, directory: str | Path, processor=None, tokenizer=None, half: bool = True,
                    meta: dict | None = None) -> Path:
    """Model (fp16 if ``half``) + processor/tokenizer + ``mmspec.json`` with ``meta``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if half:
        save_half(model, directory)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(directory)
    elif tokenizer is not None:
        tokenizer.save_pretrained(directory)
    (directory / SIDECAR).write_text(json.dumps(meta or {}, indent=2, sort_keys=True) + "\n")
    for path in directory.iterdir():  # safetensors land 0600; package data must be world-readable
        if path.is_file():
            path.chmod(0o644)
    return directory
