"""Every random draw of a decode: counter-based uniforms, one stream per request.

A request's draws are a pure function of (its seed, the step, the slot of the draw in that
step): ``u = splitmix64(mix(seed) + (step * SLOTS + slot) * GAMMA)``, the top 53 bits as a
float64 in [0, 1). The engine keeps ``seed`` and ``step`` per row in device tensors, so a
whole batch draws its uniforms in a fixed number of tensor operations whatever the batch size,
with no generator object, no host round trip and nothing a CUDA graph cannot capture; a row's
draws never depend on its neighbours, its row index or the batch size, so a seeded request in a
batch returns what it returns alone, on the CPU as on a GPU (the integer arithmetic is exact and
the same on both: ``tests/core/test_rng.py`` checks it against a pure-Python reference).

Slots of one step: the drafter's draws (a drawn chain: one per depth) from :data:`DRAFT`, the
verification's (one per tree node, then one for the final token) from :data:`VERIFY`.

Seeded sampling's noise (:func:`gumbel`) is a second stream, keyed by the OUTPUT POSITION instead
of the step: ``g[t, v]``, a standard Gumbel variate per (seed, position t, token v), from the same
SplitMix64 with another key, so the token drawn at position t (``argmax(log p_t + g_t)``, the
Gumbel-max trick: an exact sample of p_t) depends on the seed and t only, never on how a step
was shaped, how deep it drafted or what batch it ran in.

SplitMix64: Steele, Lea, Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014
(the finaliser of Java's ``SplittableRandom``); its output passes BigCrush.
"""

from __future__ import annotations

import torch

SLOTS = 1 << 12  # draws one step may make per row
DRAFT = 0  # first slot of the drafter's draws
VERIFY = SLOTS // 2  # first slot of the verification's draws


def _signed(x: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on negative numbers)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (products wrap modulo 2**64, as on every device)."""
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def uniforms(seed: torch.Tensor, step: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64: seed, step [B] int64 -> [B, n], row b's slots ``first ..
    first + n - 1`` of its step ``step[b]``."""
    slot = torch.arange(first, first + n, dtype=torch.long, device=seed.device)  # [n]
    counter = step[:, None] * SLOTS + slot  # [B, n]
    z = mix(mix(seed)[:, None] + counter * GAMMA)
    return _srl(z, 11).to(torch.float64) * (1.0 / (1 << 53))


GUMBEL_KEY = _signed(0xD1B54A32D192ED03)  # separates the noise's stream from the step's uniforms
TOKEN_BITS = 32  # a position's counters: position << 32 | token (vocabularies below 2**32)


def gumbel(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise per (seed, output position, token), float32: seed [B] int64,
    position [B, n] int64 (the output position each draw decides: 0 = the first new token)
    -> [B, n, vocab]. ``g = -log(-log(u))`` with u in (0, 1) from the counter
    ``position << 32 | token`` of the row's noise stream (a fixed number of whole-batch tensor
    operations; the uniforms are the same bits on every device, the logarithms float64's)."""
    v = torch.arange(vocab, dtype=torch.long, device=seed.device)  # [V]
    key = mix(seed ^ GUMBEL_KEY)[:, None, None]  # [B, 1, 1]
    counter = (position[..., None] << TOKEN_BITS) + v  # [B, n, V]
    z = mix(key + counter * GAMMA)
    u = (_srl(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))  # (0, 1): never 0 or 1
    return (-torch.log(-torch.log(u))).to(torch.float32)


_MASK = (1 << 64) - 1


def _mix_host(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def host_uniforms(seed: int, step: int, first: int, n: int) -> list[float]:
    """:func:`uniforms` of one row computed on the host, bit for bit (for a search that runs on
    the host: a model-free proposer drawing a chain from its counts)."""
    base = _mix_host(seed & _MASK)
    return [(_mix_host((base + (step * SLOTS + first + i) * 0x9E3779B97F4A7C15) & _MASK) >> 11) / float(1 << 53)
            for i in range(n)]
