"""The counter-based uniforms (mmspec.runtime.rng): exact against a pure-Python SplitMix64, per-row
streams independent of the batch, and uniform."""

import math

import torch

from mmspec.runtime import rng

MASK = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _u_ref(seed: int, step: int, slot: int) -> float:
    z = _mix_ref((_mix_ref(seed & MASK) + (step * rng.SLOTS + slot) * 0x9E3779B97F4A7C15) & MASK)
    return (z >> 11) / float(1 << 53)


def test_uniforms_equal_the_reference_bit_for_bit():
    seeds = [0, 1, 11, 2**62 + 12345, 2**63 - 1]
    steps = [0, 3, 1000, 7, 2**20]
    u = rng.uniforms(torch.tensor(seeds), torch.tensor(steps), 5, 4)
    for b, (s, t) in enumerate(zip(seeds, steps)):
        assert u[b].tolist() == [_u_ref(s, t, 5 + i) for i in range(4)]


def test_a_rows_draws_do_not_depend_on_its_neighbours():
    alone = rng.uniforms(torch.tensor([42]), torch.tensor([9]), rng.VERIFY, 6)
    batch = rng.uniforms(torch.tensor([1, 42, 7, 42]), torch.tensor([9, 9, 9, 10]), rng.VERIFY, 6)
    assert torch.equal(batch[1], alone[0])
    assert not torch.equal(batch[3], alone[0]) and not torch.equal(batch[0], alone[0])


def test_uniforms_are_uniform_and_in_range():
    n = 20000
    u = rng.uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long), 0, 2).flatten()
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Kolmogorov-Smirnov against U(0, 1): the 0.1% critical value is 1.95 / sqrt(n)
    s = u.sort().values
    i = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    d = max(float((i / s.numel() - s).max()), float((s - (i - 1) / s.numel()).max()))
    assert d < 1.95 / math.sqrt(s.numel())
    # consecutive draws of one stream are not correlated
    seq = rng.uniforms(torch.tensor([5]), torch.tensor([0]), 0, 4000)[0]
    c = torch.corrcoef(torch.stack([seq[:-1], seq[1:]]))[0, 1]
    assert abs(float(c)) < 0.06


def _g_ref(seed: int, position: int, token: int) -> float:
    key = _mix_ref((seed ^ (rng.GUMBEL_KEY & MASK)) & MASK)
    z = _mix_ref((key + ((position << rng.TOKEN_BITS) + token) * 0x9E3779B97F4A7C15) & MASK)
    u = ((z >> 11) + 0.5) / float(1 << 53)
    return -math.log(-math.log(u))


def test_gumbel_noise_equals_the_reference_and_depends_on_seed_and_position_only():
    seeds, pos = torch.tensor([3, 2**63 - 1, 3]), torch.tensor([[0, 5], [7, 2**20], [5, 9]])
    g = rng.gumbel(seeds, pos, 11)  # [3, 2, 11]
    assert g.shape == (3, 2, 11) and g.dtype == torch.float32
    for b in range(3):
        for j in range(2):
            ref = torch.tensor([_g_ref(int(seeds[b]), int(pos[b, j]), v) for v in range(11)], dtype=torch.float32)
            assert torch.equal(g[b, j], ref)
    assert torch.equal(g[0, 1], g[2, 0])  # one (seed, position): one noise, wherever it is asked for
    alone = rng.gumbel(torch.tensor([3]), torch.tensor([[5]]), 11)
    assert torch.equal(alone[0, 0], g[0, 1])
    assert not torch.equal(g[0, 0], g[0, 1]) and not torch.equal(g[1, 0], g[0, 0])


def test_gumbel_noise_is_standard_gumbel():
    g = rng.gumbel(torch.arange(40), torch.zeros(40, 1, dtype=torch.long), 500).flatten().double()  # 20,000 draws
    # KS against the Gumbel CDF exp(-exp(-x)); the 0.1% critical value is 1.95 / sqrt(n)
    s = g.sort().values
    cdf = torch.exp(-torch.exp(-s))
    i = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    d = max(float((i / s.numel() - cdf).max()), float((cdf - (i - 1) / s.numel()).max()))
    assert d < 1.95 / math.sqrt(s.numel())
