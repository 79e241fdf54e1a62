"""Automatic prefix caching: a decoder keeps the KV caches of its recent prompts (and their
encoded images) so that a prompt extending one of them prefills only its new suffix.

Owns: the content key of a prompt (token ids, each image / video placeholder replaced by a value
derived from the segment's pixel content, so an edited history or another picture never matches),
the stored entries (per layer keys/values of the target, of every draft view's row and of a
head, each with its own key, since a text-view row holds other tokens than the multimodal row),
their LRU eviction by bytes. A stored entry is never written after it is made: admission copies
it into the request's row of the engine's :class:`~mmspec.models.rows.RowCache`
(``RowCache.write_prefix``) and a finished row is copied out (``RowCache.snapshot``), so a
decode's writes and roll-backs cannot reach it.

Knows nothing of drafting, acceptance or the loop: :class:`mmspec.SpecDecoder` calls
:meth:`PrefixCache.match` when it prepares a prompt (``engine/admission.py`` then writes the
matched prefix into the row) and the scheduler (``engine/scheduler.py``) makes an entry of a
finished row (:func:`make_entry`) and calls :meth:`PrefixCache.store`.

Exactness: a reused prefix is the target's own keys/values of the same tokens (computed by a
prefill or by the verify forwards of the decode that produced them), so greedy output still
equals ``target.generate`` on the whole conversation; in float32 / half precision a chunked
prefill differs from a whole one in the last bits, as any chunked prefill does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

import torch

from mmspec.errors import MMSpecError
from mmspec.models.rows import KV

_MASK62 = (1 << 62) - 1


def check_budget(mb) -> float:
    """``prefix_cache_mb``: a number of MiB >= 0 (0: off)."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0 or mb == float("inf"):
        raise MMSpecError(f"prefix_cache_mb must be a number of MiB >= 0 (0 turns prefix caching off), got {mb!r}")
    return float(mb)


# ----------------------------------------------------------------------------------- content keys
def tensor_digest(*parts) -> int:
    """A 62-bit digest of tensors (their dtype, shape and bytes) and plain values."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(p).encode())
    return int.from_bytes(h.digest(), "little") & _MASK62


def segment_digests(mm: dict, kinds: list[str]) -> list[int]:
    """One digest per image / video segment, in prompt order (``kinds``), from its own pixel
    inputs (a row of ``pixel_values``, or its patches by ``*_grid_thw``) and its per-segment
    extras (grid, image size). When the inputs cannot be split per segment, every segment gets
    the digest of all of them (a changed picture then invalidates every image, never none)."""
    per_kind = {}
    for kind, pix_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
        n = kinds.count(kind)
        pix, grid = mm.get(pix_key), mm.get(grid_key)
        pieces = _split(pix, grid, n)
        if pieces is None:
            per_kind[kind] = None
            continue
        extras = [[grid[i] if isinstance(grid, torch.Tensor) else None,
                   _row(mm.get("image_sizes"), i) if kind == "image" else _row(mm.get("second_per_grid_ts"), i)]
                  for i in range(n)]
        per_kind[kind] = [tensor_digest(kind, p, *e) for p, e in zip(pieces, extras)]
    if any(per_kind[k] is None for k in set(kinds)):
        whole = tensor_digest(*[v for k, v in sorted(mm.items()) if isinstance(v, torch.Tensor)])
        return [tensor_digest(whole, i) for i in range(len(kinds))]
    taken = {"image": 0, "video": 0}
    out = []
    for k in kinds:
        out.append(per_kind[k][taken[k]])
        taken[k] += 1
    return out


def _row(x, i):
    return x[i] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] > i else None


def _split(pix, grid, n: int) -> list[torch.Tensor] | None:
    if n == 0:
        return []
    if not isinstance(pix, torch.Tensor):
        return None
    if isinstance(grid, torch.Tensor) and pix.dim() == 2:  # Qwen2-VL: patches of all segments, by grid
        sizes = grid.prod(-1).tolist()
        if len(sizes) != n or sum(sizes) != pix.shape[0]:
            return None
        return list(pix.split(sizes))
    return list(pix) if pix.shape[0] == n else None  # [n, ...]: one entry per segment


def content_key(ids: torch.Tensor, placeholder_mask: torch.Tensor, counts: list[int], digests: list[int]) -> torch.Tensor:
    """ids [L] -> the prompt's content key [L] int64: text positions keep their token id, the
    j-th placeholder of a segment with digest h becomes ``-1 - ((h + j) mod 2^62)``. ``counts``:
    placeholders per segment in prompt order. Placeholders the counts do not cover (a family
    whose features and placeholders differ in number) get the digest of all segments."""
    key = ids.detach().cpu().long().clone()
    pos = placeholder_mask.cpu().nonzero().flatten()
    if pos.numel() == 0:
        return key
    if sum(counts) == pos.numel():
        vals = torch.cat([torch.arange(c, dtype=torch.long) + h for c, h in zip(counts, digests)])
    else:
        vals = torch.arange(pos.numel(), dtype=torch.long) + tensor_digest(*digests)
    key[pos] = -1 - (vals & _MASK62)
    return key


BLOCK = 16  # positions a block of the entries' index covers: a prompt reuses a prefix that shares >= one block
CANDIDATES = 8  # the most recent entries sharing a prompt's deepest indexed block that are compared exactly


def block_hashes(key: torch.Tensor) -> list[int]:
    """Chained hashes of a content key's whole blocks (``BLOCK`` positions): entry b is the hash
    of ``key[:BLOCK * (b + 1)]``, so two keys share block b's hash when (hash collisions aside)
    they share that whole prefix. A collision costs nothing but a compare: a candidate's prefix
    is always measured exactly (:func:`common_prefix`)."""
    a = key.detach().cpu().numpy()
    out, h = [], 0
    for b in range(a.shape[0] // BLOCK):
        h = hash((h, a[b * BLOCK:(b + 1) * BLOCK].tobytes()))
        out.append(h)
    return out


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D keys."""
    m = min(a.shape[0], b.shape[0])
    diff = (a[:m] != b[:m]).nonzero()
    return int(diff[0, 0]) if diff.numel() else m


# ----------------------------------------------------------------------------------- stored prefixes
@dataclass
class RowPrefix:
    """One cache row's stored prefix: its content key [n] and per-layer keys/values [1, H, n, D]."""

    key: torch.Tensor
    kv: KV

    @property
    def nbytes(self) -> int:
        return _storage_bytes(t for pair in self.kv for t in pair)


@dataclass
class PrefixEntry:
    target: RowPrefix
    rows: list[RowPrefix] = field(default_factory=list)  # one per draft view, in the decoder's view order
    head: RowPrefix | None = None  # a head's slots: slot t pairs the target feature t with token t + 1
    digests: tuple = ()  # the prompt's segment digests: `encoded` is reused for the same images
    encoded: object = None  # the prompt's EncodedPrompt (vision features, captions)

    @property
    def nbytes(self) -> int:
        """Bytes held: the storages its keys/values live in (a whole decode buffer when the entry
        took it over instead of copying), each counted once, and the encoded images."""
        parts = [self.target, *self.rows] + ([self.head] if self.head else [])
        return _storage_bytes(t for p in parts for pair in p.kv for t in pair) + _encoded_bytes(self.encoded)


@dataclass
class PrefixMatch:
    """What a new prompt reuses of a stored entry: ``target`` positions of the target's cache,
    ``rows[b]`` positions of draft row b (its own prompt row), ``head`` slots of a head."""

    entry: PrefixEntry
    target: int
    rows: list[int] = field(default_factory=list)
    head: int = 0

    def target_kv(self) -> KV:
        return [(k[..., :self.target, :], v[..., :self.target, :]) for k, v in self.entry.target.kv]

    def row_kv(self, b: int) -> KV:
        return [(k[..., :self.rows[b], :], v[..., :self.rows[b], :]) for k, v in self.entry.rows[b].kv]

    def head_kv(self) -> KV:
        return [(k[..., :self.head, :], v[..., :self.head, :]) for k, v in self.entry.head.kv]


class PrefixCache:
    """The stored prefixes of one decoder, least recently used evicted first once their bytes
    pass ``budget_mb`` (0: off). Not thread-safe: one decoder, one thread."""

    def __init__(self, budget_mb: float):
        self.budget = int(float(budget_mb) * 2**20)
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.sizes: dict[int, int] = {}  # entry id -> its bytes, counted once when stored (entries never change)
        self._bytes = 0  # their sum: storing is O(1) in the entries held, not a walk over all of them
        self._next = 0
        # what makes a lookup independent of the entries held: each whole block's chained hash -> the
        # entries whose target key has that prefix (oldest stored first), and images' digests -> entry
        self._index: dict[int, dict[int, None]] = {}
        self._hashes: dict[int, list[int]] = {}  # entry id -> its blocks' hashes (to unindex it)
        self._by_digests: dict[tuple, int] = {}

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored entries (each entry's :attr:`PrefixEntry.nbytes`, summed)."""
        return self._bytes

    def clear(self) -> None:
        self.entries.clear()
        self.sizes.clear()
        self._bytes = 0
        self._index.clear()
        self._hashes.clear()
        self._by_digests.clear()

    def encoded_for(self, digests: tuple):
        """A stored prompt's encoded images when they are exactly these (None: encode them): one
        dictionary lookup, whatever the entries held."""
        eid = self._by_digests.get(digests)
        if eid is None:
            return None
        self.entries.move_to_end(eid)
        return self.entries[eid].encoded

    def match(self, target_key: torch.Tensor, row_keys: list[torch.Tensor] | None = None,
              head: bool = False) -> PrefixMatch | None:
        """The entry sharing the longest prefix with a new prompt, and how much of it each cache
        reuses. ``target_key`` [L - 1]: the content key of the positions the target prefills (the
        prompt less its pending last token); ``row_keys``: the same for every draft row; ``head``:
        the drafter is a head (whose slots need the target features before them: the target then
        prefills from the head's first missing slot, one position more than it could reuse, so
        that the head gets the feature it needs; at least one position is always prefilled)."""
        if not self.enabled or not self.entries:
            return None
        deepest = None  # the entries sharing the prompt's deepest whole block: the longest prefixes
        for h in block_hashes(target_key):
            found = self._index.get(h)
            if found is None:
                break
            deepest = found
        if deepest is None:  # no entry shares a whole block (vLLM's prefix cache reuses whole blocks too)
            return None
        best, best_n = None, 0
        for eid in islice(reversed(deepest), CANDIDATES):  # the newest first, without copying the rest
            n = common_prefix(self.entries[eid].target.key, target_key)
            if n > best_n:
                best, best_n = eid, n
        if best is None:
            return None
        self.entries.move_to_end(best)
        e = self.entries[best]
        m = PrefixMatch(entry=e, target=best_n)
        if head:
            if e.head is None:
                return None
            n_slots = target_key.shape[0] - 1  # the head prefills slots 0 .. L - 3
            m.head = max(0, min(e.head.kv[0][0].shape[-2], common_prefix(e.head.key, target_key) - 1, n_slots))
            m.target = m.head
        if row_keys is not None:
            m.rows = [common_prefix(r.key, k) for r, k in zip(e.rows, row_keys)] if len(e.rows) == len(row_keys) \
                else [0] * len(row_keys)
        return m if (m.target or any(m.rows) or m.head) else None

    def store(self, entry: PrefixEntry) -> None:
        """Keep ``entry`` (its tensors already copies), evicting the least recently used ones
        until everything fits the budget; an entry larger than the whole budget is not kept."""
        size = entry.nbytes
        if not self.enabled or size > self.budget:
            return
        while self.entries and self._bytes + size > self.budget:
            eid, old = self.entries.popitem(last=False)
            self._bytes -= self.sizes.pop(eid)
            for h in self._hashes.pop(eid):
                held = self._index[h]
                held.pop(eid, None)
                if not held:
                    del self._index[h]
            if self._by_digests.get(old.digests) == eid:
                del self._by_digests[old.digests]
        eid = self._next
        self.entries[eid] = entry
        self.sizes[eid] = size
        self._bytes += size
        self._hashes[eid] = hashes = block_hashes(entry.target.key)
        for h in hashes:
            self._index.setdefault(h, {})[eid] = None
        if entry.encoded is not None:
            self._by_digests[entry.digests] = eid  # the newest entry with these images
        self._next += 1


# ----------------------------------------------------------------------------------- sizes
def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(st.device.type, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def _encoded_bytes(enc) -> int:
    if enc is None:
        return 0
    total = 0

    def add(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                add(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)

    for name in ("target_feats", "draft_feats", "draft_inputs", "caption_ids"):
        add(getattr(enc, name, None))
    return total


# ----------------------------------------------------------------------------------- one request
@dataclass
class PromptKeys:
    """A prompt's content keys: the target's [L] and every draft row's [len_b] (whole prompts,
    pending last token included), and its segment digests (with the captions given, if any)."""

    target: torch.Tensor
    rows: list[torch.Tensor]
    digests: tuple


def feature_counts(feats_by_kind: dict | None, kinds: list[str]) -> list[int]:
    """Feature rows per segment in prompt order, from {kind: [[n_i, H], ...]} ([] if they do not add up)."""
    if not feats_by_kind:
        return []
    queues = {k: [int(f.shape[0]) for f in v] for k, v in feats_by_kind.items()}
    out = []
    for k in kinds:
        if not queues.get(k):
            return []
        out.append(queues[k].pop(0))
    return out


def prompt_keys(ids: torch.Tensor, placeholders: dict, enc, rows: list, views: list, digests: tuple) -> PromptKeys:
    """The content keys of a prompt ``ids`` [L], its encoded images ``enc`` and draft ``rows``
    (one per view, whole): image placeholders and draft feature slots keyed by their segment's
    digest (``digests[0]``, one per segment), text by its token id."""
    seg = list(digests[0]) if digests else []
    kinds = enc.layout.kinds
    mask = torch.isin(ids.cpu(), torch.tensor(sorted(placeholders), dtype=ids.dtype)) if placeholders else \
        torch.zeros_like(ids, dtype=torch.bool)
    target = content_key(ids, mask, feature_counts(enc.target_feats, kinds), seg)
    row_keys = []
    for view, row in zip(views, rows):
        fmask = torch.zeros(row.token_ids.shape[0], dtype=torch.bool)
        fmask[row.feature_positions] = True
        counts = feature_counts((enc.draft_feats or {}).get(view), kinds)
        row_keys.append(content_key(row.token_ids, fmask, counts, seg))
    return PromptKeys(target=target, rows=row_keys, digests=digests)


def make_entry(keys: PromptKeys, enc, tokens: list[int], target: KV, rows: list[KV] | None = None,
               head: KV | None = None) -> PrefixEntry:
    """An entry from a request's keys, its new ``tokens`` and the keys/values its caches hold
    (already copied: each KV's length says how many positions it keeps): ``target`` [1, H, n, D]
    per layer holds the prompt + new tokens' first n positions; ``rows[b]`` draft row b's (its
    prompt row, then the new tokens); ``head`` a head's slots (slot t: feature t, token t + 1)."""
    new = torch.tensor(tokens, dtype=torch.long)
    seq = torch.cat([keys.target, new])
    entry = PrefixEntry(target=RowPrefix(seq[:_n(target)], target), digests=keys.digests, encoded=enc)
    if head is not None:
        entry.head = RowPrefix(seq[:_n(head) + 1], head)
    for rk, kv in zip(keys.rows, rows or []):
        entry.rows.append(RowPrefix(torch.cat([rk, new])[:_n(kv)], kv))
    return entry


def _n(kv: KV) -> int:
    return kv[0][0].shape[-2]
