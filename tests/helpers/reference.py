"""What the tests check outputs against: the target's own ``generate``, its own seeded sampling
(:func:`seeded_reference`), its own log-probabilities of an answer, and a chi-square test."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from helpers.tiny import IMG
from mmspec.models.base import cache_argument
from mmspec.models.captioner import FixedCaptioner
from mmspec.runtime import rng
from mmspec.runtime.verify import SamplingParams, filtered_logits


def reference(target, ids, pv, n):
    out = target.generate(input_ids=ids, pixel_values=pv, attention_mask=torch.ones_like(ids),
                          do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def seeded_reference(target, inputs: dict, n: int, params: SamplingParams, seed: int, eos: int) -> list[int]:
    """The target ALONE sampling a seeded answer: a plain loop, one forward per token on its own
    cache, token t = ``argmax(filtered_logits_t + g_t)`` with g_t the seed's noise at output
    position t (:func:`mmspec.runtime.rng.gumbel`), until ``eos`` or ``n`` tokens. What a
    speculative decode of the same request and seed must return token for token, whatever its
    drafter. inputs: the processor's output (``input_ids`` [1, L], ...)."""
    ids = inputs["input_ids"]
    out = target(**{**inputs, "attention_mask": torch.ones_like(ids)}, use_cache=True)
    seed_t = torch.tensor([seed])
    tokens: list[int] = []
    for t in range(n):
        x = filtered_logits(out.logits[0, -1], params)  # [V]
        g = rng.gumbel(seed_t, torch.tensor([[t]]), x.shape[-1])[0, 0]
        tokens.append(int((x + g.to(x.dtype)).argmax()))
        if tokens[-1] == eos or t == n - 1:
            break
        mask = torch.ones(1, ids.shape[1] + len(tokens), dtype=ids.dtype)
        out = target(input_ids=torch.tensor([tokens[-1:]]), attention_mask=mask, use_cache=True,
                     **{cache_argument(target): out.past_key_values})
    return tokens


def rejection_generate(dec, **kwargs) -> list[int]:
    """``dec.generate(**kwargs)``'s tokens with the request sampled by rejection sampling
    (``Request.coupled = False``) instead of the Gumbel-max coupling every sampling request uses:
    the sampler the coupling was measured against (``perf/seed_coupling.py``), kept exact."""
    return rejection_batch(dec, [kwargs], max_batch=1)[0].token_ids


def sample_seeds(dec, n: int, coupled: bool = True, max_batch: int = 128, **request) -> list[tuple[int, ...]]:
    """The answers of one request (``request``: a ``generate_batch`` request dict's keys) with
    seeds 0 .. n - 1, decoded ``max_batch`` at a time: a seeded request decodes the same alone
    or in any batch (``tests/core/test_batch.py``), so the samples an exact-distribution test
    draws are the lone decodes' at a fraction of their cost. ``coupled``: by the Gumbel-max
    coupling every sampling request uses, else by rejection sampling (:func:`rejection_batch`)."""
    reqs = [dict(request, seed=s) for s in range(n)]
    res = dec.generate_batch(reqs, max_batch=max_batch) if coupled else rejection_batch(dec, reqs, max_batch)
    return [tuple(r.token_ids) for r in res]


def rejection_batch(dec, requests: list[dict], max_batch: int) -> list:
    """``dec.generate_batch(requests, max_batch=...)``'s results with every request sampled by
    rejection sampling (:func:`rejection_generate`)."""
    from mmspec.batch import BatchScheduler
    from mmspec.request import prepare

    sched = BatchScheduler(dec, max_batch=max_batch, stream_text=False)
    rids = [sched.submit(replace(prepare(dec, r), coupled=False)) for r in requests]
    results = {}
    while sched.has_work():
        for ev in sched.step():
            assert ev.error is None, ev.error
            if ev.finished:
                results[ev.rid] = ev.result
    sched.close()
    return [results[r] for r in rids]


@torch.inference_mode()
def target_logprobs(target, inputs: dict, answer: list[int]) -> torch.Tensor:
    """The target's own ``log_softmax`` before each token of ``answer`` -> [n, V]: a forward over the
    prompt (``inputs``: its processor's output, ``input_ids`` [1, L]), then one over the answer on
    that cache (so an answer token that happens to be a placeholder id is read as text, as the
    engine reads it); raw logits, temperature 1, in float32 or wider."""
    ids = inputs["input_ids"]
    L = ids.shape[1]
    first = target(**{**inputs, "attention_mask": torch.ones_like(ids)}, use_cache=True)
    logits = [first.logits[0, -1:]]
    if len(answer) > 1:
        rest = torch.tensor([answer[:-1]], dtype=ids.dtype, device=ids.device)
        mask = torch.ones(1, L + rest.shape[1], dtype=ids.dtype, device=ids.device)
        cache = {cache_argument(target): first.past_key_values}
        logits.append(target(input_ids=rest, attention_mask=mask, **cache).logits[0])
    x = torch.cat(logits)  # [n, V]
    return torch.log_softmax(x.float() if x.dtype in (torch.float16, torch.bfloat16) else x, -1)


def captions(n):
    return FixedCaptioner([f"w{10 + i} w{20 + i} w30" for i in range(n)])


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (Wilson-Hilferty normal approximation, cells pooled < 5)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    c = torch.cat([counts[big], counts[~big].sum().view(1)])
    e = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_sequence_probs(target, ids, pv, eos=2, n_new: int = 3, temp: float = 1.0):
    """P(x1..x_n_new) under the target at temperature ``temp``, EOS ending a sequence early
    (exactly, by enumeration over a tiny vocabulary; ids [1, L] with one image pv [1, 3, H, W])."""
    V, N_NEW, TEMP = target.config.text_config.vocab_size, n_new, temp
    seqs, probs = [], []

    feats = torch.cat(list(target.get_image_features(pixel_values=pv).pooler_output))  # [16, H]

    def next_probs(prefix):
        # embeddings built by hand: a generated token may be the <image> id, which must not
        # be treated as an image slot (generate() embeds it as a plain token too)
        full = torch.cat([ids, torch.tensor([prefix], dtype=torch.long)], 1) if prefix else ids
        emb = target.get_input_embeddings()(full)
        emb[0, : ids.shape[1]][ids[0] == IMG] = feats
        logits = target(inputs_embeds=emb).logits[0, -1]
        return torch.softmax(logits / TEMP, -1)

    with torch.no_grad():
        frontier = [((), 1.0)]
        for _ in range(N_NEW):
            new = []
            for prefix, pr in frontier:
                p = next_probs(list(prefix))
                for t in range(V):
                    seq, q = prefix + (t,), pr * float(p[t])
                    (seqs.append(seq), probs.append(q)) if (t == eos or len(seq) == N_NEW) else new.append((seq, q))
            frontier = new
    return {s: p for s, p in zip(seqs, probs)}


def pvalues(samples, exact, V: int = 8) -> list[float]:
    """Chi-square p-values: the joint over whole sequences, and the marginal of each position
    (category V = the sequence ended earlier). Marginals carry most of the power."""
    seqs = list(exact)
    N_NEW = max(len(s) for s in seqs)
    probs = torch.tensor([exact[s] for s in seqs])
    index = {s: i for i, s in enumerate(seqs)}
    joint = torch.zeros(len(seqs))
    for s in samples:
        joint[index[s]] += 1
    out = [chi2_pvalue(joint, probs)]
    for pos in range(N_NEW):
        m_exact, m_obs = torch.zeros(V + 1), torch.zeros(V + 1)
        for s, pr in exact.items():
            m_exact[s[pos] if len(s) > pos else V] += pr
        for s in samples:
            m_obs[s[pos] if len(s) > pos else V] += 1
        out.append(chi2_pvalue(m_obs, m_exact))
    return out


def engine_of(dec):
    """The engine a static decoder keeps (its lease): its buffers and graphs."""
    return dec.static_pool.leased["engine"][0]


def step_graphs(dec) -> dict:
    """The whole-step graphs the kept engine captured: plan -> the input shapes captured for it."""
    return {plan: frozenset(r.graphs) for plan, r in engine_of(dec).step_graphs_by_plan.items()}
