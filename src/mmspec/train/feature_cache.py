"""The frozen target's features for head training, dumped once to disk and reused across epochs
(``mmspec train head --cache-features DIR``).

Owns: one file per training sequence (``DIR/<sequence key>.pt``: the feature layers' outputs
[L, F] and the final post-norm state [L, H], unpadded, in the target's dtype), written atomically
the first time a batch holds that sequence and read back every later time; the target's LM head
turns the final state back into its logits (``lm_head(final)`` is exactly how the target scores).
``DIR/cache.json`` names what the files were made with (target weights, feature layers, dtype):
a cache of another target or layers is refused, never mixed in. A size limit (``max_bytes``)
bounds the directory: once it is full, the remaining sequences are computed on the fly each time.
A rerun reuses every file already there (resumable; an interrupted write leaves no file).

Does not decide what to train on or how (:mod:`mmspec.train.head`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from mmspec.errors import MMSpecError

MANIFEST = "cache.json"


def sequence_key(seq) -> str:
    """24 hex digits of sha256 over a sequence's ids and its processor tensors: its file name."""
    h = hashlib.sha256(seq.input_ids.numpy().tobytes())
    for k, v in sorted(seq.inputs().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def target_identity(target) -> str:
    """16 hex digits over the target's config and a sample of its weights (every tensor's shape,
    and the sum of its first 4096 values): another checkpoint gives another identity."""
    h = hashlib.sha256(target.config.to_json_string(use_diff=False).encode())
    for name, p in target.state_dict().items():
        h.update(f"{name}{tuple(p.shape)}{float(p.detach().reshape(-1)[:4096].double().sum()):.9e}".encode())
    return h.hexdigest()[:16]


class FeatureCache:
    """Features of training sequences under ``root`` (at most ``max_bytes`` of files)."""

    def __init__(self, root: str | Path, target, layers: tuple[int, ...], max_bytes: float, main: bool = True):
        self.root, self.layers, self.max_bytes = Path(root), tuple(layers), max_bytes
        self.dtype = next(target.parameters()).dtype
        want = {"target": target_identity(target), "layers": list(self.layers), "dtype": str(self.dtype)}
        manifest = self.root / MANIFEST
        if manifest.is_file():
            have = json.loads(manifest.read_text())
            differ = [k for k in want if have.get(k) != want[k]]
            if differ:
                raise MMSpecError(f"--cache-features {self.root} holds features made with another "
                                  f"{' and '.join(differ)} ({', '.join(f'{have.get(k)} there, {want[k]} now' for k in differ)}); "
                                  "give another directory, or empty this one")
        self.root.mkdir(parents=True, exist_ok=True)
        if main and not manifest.is_file():
            manifest.write_text(json.dumps(want, indent=1))
        self.used = sum(f.stat().st_size for f in self.root.glob("*.pt")) if self.root.is_dir() else 0
        self.hits = self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def features(self, target, batch: dict, keys: list[str]):
        """(logits [B, L, V], features [B, L, F], final [B, L, H]) of ``batch`` (right-padded rows
        whose sequences have ``keys``): from the files when every row has one, else one target
        forward (whose rows are then written, room permitting)."""
        paths = [self._path(k) for k in keys]
        B, L = batch["input_ids"].shape
        dev = batch["input_ids"].device
        if all(p.is_file() for p in paths):
            self.hits += B
            rows = [torch.load(p, map_location=dev, weights_only=True) for p in paths]
            feats = rows[0]["features"].new_zeros(B, L, rows[0]["features"].shape[-1])
            final = rows[0]["final"].new_zeros(B, L, rows[0]["final"].shape[-1])
            for b, r in enumerate(rows):
                n = r["features"].shape[0]
                feats[b, :n], final[b, :n] = r["features"], r["final"]
            return target.get_output_embeddings()(final), feats, final
        self.misses += B
        logits, feats, final = target_features(target, batch, self.layers, final=True)
        lengths = batch["attention_mask"].sum(1).tolist()
        for b, p in enumerate(paths):
            if p.is_file():
                continue
            row = {"features": feats[b, :lengths[b]].detach().to("cpu", self.dtype).clone(),
                   "final": final[b, :lengths[b]].detach().to("cpu", self.dtype).clone()}
            size = sum(t.numel() * t.element_size() for t in row.values()) + 1024
            if self.used + size > self.max_bytes:
                continue  # full: this sequence stays on the fly
            tmp = p.with_suffix(f".tmp{os.getpid()}")
            torch.save(row, tmp)
            os.replace(tmp, p)
            self.used += size
        return logits, feats, final


def target_features(target, batch: dict, layers: tuple[int, ...], final: bool):
    """One frozen target forward -> (logits [B, L, V], features [B, L, F], final feature [B, L, H] | None).
    The features are the outputs of ``layers`` (-1: the final post-norm state), read by hooks."""
    from mmspec.models.base import adapter_for

    adapter = adapter_for(target)
    want = tuple(layers) + ((-1,) if final and -1 not in layers else ())
    captured: dict[int, torch.Tensor] = {}
    hooks = [adapter._layer(i).register_forward_hook(
        lambda m, a, o, i=i: captured.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in want]
    try:
        kw = {k: v for k, v in batch.items() if v is not None and k != "loss_mask"}
        logits = target(**kw, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat([captured[i] for i in layers], dim=-1)
    return logits, feats, captured.get(-1) if final else None
