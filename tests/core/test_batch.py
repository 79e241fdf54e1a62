"""Batched speculative decoding (mmspec.batch): every request of a batch decodes exactly as it
would alone, whatever its neighbours: greedy equals the target's own greedy output, a seeded
request equals solo ``generate`` with that seed, and a request sampled inside a batch follows
the target's exact distribution. Continuous batching: joins, cancels, failures alone."""

import pytest
import torch

from helpers.reference import exact_sequence_probs, pvalues, rejection_batch
from helpers.tiny import BOS, IMG, make_llava, make_prompt, make_qwen, make_tokenizer, noisy_copy, qwen_inputs
from mmspec import MMSpecError, SpecDecoder
from mmspec.batch import BatchScheduler, SpeculationPolicy
from mmspec.engine.policy import Action
from mmspec.models.captioner import FixedCaptioner


def reference(target, ids, pv, n, **mm):
    kw = dict(mm)
    if pv is not None:
        kw["pixel_values"] = pv
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
    return out[0, ids.shape[1]:].tolist()


NO_CAPTIONER = FixedCaptioner([])  # the caption view reads each request's captions=


def caps(n):
    return [f"w{10 + i} w{20 + i} w30" for i in range(n)]


# (images, max_new_tokens, text length): mixed prompt lengths, 0/1/2/5 images, limits 1, inside a block, long
MIX = [(1, 20, 6), (0, 7, 3), (2, 1, 5), (5, 13, 2), (1, 3, 9), (2, 24, 4), (0, 16, 8), (1, 9, 1)]


def requests(n, with_captions=False):
    reqs = []
    for i, (n_img, max_new, text_len) in enumerate(MIX[:n]):
        ids, pv = make_prompt(n_img, 16, seed=20 + i, text_len=text_len)
        r = dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new)
        if with_captions:
            r["captions"] = caps(n_img)
        reqs.append(r)
    return reqs


@pytest.fixture(scope="module")
def refs(target):
    return [reference(target, r["input_ids"], r["pixel_values"], r["max_new_tokens"]) for r in requests(8)]


@pytest.mark.parametrize("views", ["M", "T", "MT", "MTC"])
@pytest.mark.parametrize("n", [1, 4, 8])
def test_greedy_batch_equals_target(target, draft_shared, tok, refs, views, n):
    dec = SpecDecoder(target, draft_shared, tok, views=views, captioner=NO_CAPTIONER)
    res = dec.generate_batch(requests(n, with_captions=True))
    assert [r.token_ids for r in res] == refs[:n]
    for r in res:
        assert sum(r.stats.tokens_per_block) == len(r.token_ids)


@pytest.mark.parametrize("tree", [dict(tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6),
                                  dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                                  dict(tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=6, tree_children="views")])
def test_trees_in_a_batch(target, draft_shared, tok, refs, tree):
    dec = SpecDecoder(target, draft_shared, tok, views="MT", **tree)
    res = dec.generate_batch(requests(6))
    assert [r.token_ids for r in res] == refs[:6]
    assert any(max(r.stats.tokens_per_block) > 1 for r in res)


def test_own_vision_tower_and_text_draft(target, draft_small, draft_text, tok, refs):
    for draft, views in ((draft_small, "MP"), (draft_text, "TC")):
        dec = SpecDecoder(target, draft, tok, views=views, captioner=NO_CAPTIONER)
        assert [r.token_ids for r in dec.generate_batch(requests(5, with_captions=True))] == refs[:5]


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_head_in_a_batch(target, tok, refs, variant):
    from mmspec.heads import build_head

    dec = SpecDecoder(target, build_head(target, variant, seed=1), tok, tree="dynamic", tree_depth=3, tree_topk=2,
                      tree_budget=6)
    calls = []
    hook = dec.head.decoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        res = dec.generate_batch(requests(5))
    finally:
        hook.remove()
    assert [r.token_ids for r in res] == refs[:5]
    # the head's forwards are merged over the requests: 3 per block (pending, 2 frontiers), not per request
    assert len(calls) <= 5 + 3 * max(r.stats.n_blocks for r in res) < sum(3 * r.stats.n_blocks for r in res)
    dec = SpecDecoder(target, build_head(target, variant, seed=1), tok, gamma=3)
    assert [r.token_ids for r in dec.generate_batch(requests(5), speculate="auto")] == refs[:5]


def test_identical_draft_accepts_whole_blocks_per_request(target, tok):
    """Ragged acceptance: with the draft == the target every block of every request takes all
    gamma drafts and the bonus; no request is cut by a shorter neighbour."""
    dec = SpecDecoder(target, target, tok, views="M", gamma=4)
    reqs = requests(3)
    for r in reqs:
        r["max_new_tokens"] = 20
    res = dec.generate_batch(reqs)
    assert [r.stats.tokens_per_block for r in res] == [[5, 5, 5, 5]] * 3


def test_eos_at_different_blocks(tok):
    base = make_llava(0)
    reqs = requests(4)
    free = [reference(base, r["input_ids"], r["pixel_values"], 30) for r in reqs]
    eos = free[0][9]  # one EOS token, met at different places (or never) by the other requests
    target = make_llava(0, eos=eos)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok, views="MT")
    for r in reqs:
        r["max_new_tokens"] = 30
    res = dec.generate_batch(reqs)
    want = [reference(target, r["input_ids"], r["pixel_values"], 30) for r in reqs]
    assert [r.token_ids for r in res] == want
    assert want[0][-1] == eos and len({len(w) for w in want}) > 1


def test_policy_never_and_auto_are_lossless(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    for mode in ("never", "auto"):
        res = dec.generate_batch(requests(8), speculate=mode)
        assert [r.token_ids for r in res] == refs
    never = dec.generate_batch(requests(2), speculate="never")
    assert all(b.n_drafted == 0 for r in never for b in r.stats.blocks)


def test_auto_policy_carries_over_between_calls(target, draft_shared, tok, refs):
    """generate_batch(speculate="auto") calls on one decoder share its policy: the second call starts
    from the costs and acceptance the first measured instead of probing every batch size again."""
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    assert [r.token_ids for r in dec.generate_batch(requests(4), speculate="auto")] == refs[:4]
    pol = dec.speculation_policy
    assert pol.cost.n and pol.mode == "auto" and pol.acceptance is not None
    steps, timed = pol.steps, pol.cost.n
    assert [r.token_ids for r in dec.generate_batch(requests(4), speculate="auto")] == refs[:4]
    assert pol.steps > steps and pol.cost.n > timed  # the same policy went on learning


def test_seeded_sampling_equals_solo_generate(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    reqs = requests(6)
    for i, r in enumerate(reqs):
        r.update(seed=100 + i, temperature=[1.0, 0.7, 1.3, 1.0, 0.9, 1.0][i], max_new_tokens=12)
    reqs[3]["top_k"] = 5
    reqs[4]["top_p"] = 0.8
    solo = [dec.generate(**r).token_ids for r in reqs]
    assert [r.token_ids for r in dec.generate_batch(reqs)] == solo
    # the same request among other neighbours (and alone) gives the same tokens
    assert dec.generate_batch([reqs[2], reqs[0]])[0].token_ids == solo[2]
    assert dec.generate_batch([reqs[5], reqs[2], reqs[1]], max_batch=2)[0].token_ids == solo[5]


def test_seeded_tree_and_head_sampling_equal_solo(target, draft_shared, tok):
    from mmspec.heads import build_head

    reqs = requests(4)
    for i, r in enumerate(reqs):
        r.update(seed=7 + i, temperature=1.0, max_new_tokens=10)
    tree = dict(tree="dynamic", tree_depth=2, tree_topk=2, tree_budget=4)
    for dec in (SpecDecoder(target, draft_shared, tok, views="MT", **tree),
                SpecDecoder(target, build_head(target, "eagle", seed=3), tok, **tree)):
        solo = [dec.generate(**r).token_ids for r in reqs]
        assert [r.token_ids for r in dec.generate_batch(reqs)] == solo


V, N_SAMPLES, N_CONTROL = 8, 1200, 600


@pytest.fixture(scope="module")
def small():
    target = make_llava(41, vocab=V, eos=2)
    draft = make_llava(42, vocab=V, hidden=32, layers=1, eos=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([[BOS, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    other = torch.tensor([[BOS, 7] + [IMG] * 16 + [6, 6, 5, 7]])
    return target, draft, make_tokenizer(V), ids, pv, other


def batch_samples(dec, ids, pv, other, n, coupled: bool = True):
    """The request (ids, pv) with seeds 0..n-1, decoded in batches of 8 beside each other and
    another prompt (every 6th request: other lengths and temperatures); ``coupled``: by the
    Gumbel-max coupling (every sampling request's), else by rejection sampling."""
    reqs, mine = [], []
    for s in range(n):
        mine.append(len(reqs))
        reqs.append(dict(input_ids=ids, pixel_values=pv, max_new_tokens=3, temperature=1.0, seed=s))
        if s % 6 == 0:
            reqs.append(dict(input_ids=other, pixel_values=pv, max_new_tokens=1 + s % 5, temperature=0.5 + s % 3,
                             seed=10_000 + s))
    res = dec.generate_batch(reqs, max_batch=8) if coupled else rejection_batch(dec, reqs, max_batch=8)
    return [tuple(res[i].token_ids) for i in mine]


@pytest.mark.parametrize("coupled", [True, False], ids=["coupling", "rejection"])
def test_sampling_in_a_batch_matches_target_distribution(small, coupled):
    target, draft, tok, ids, pv, other = small
    exact = exact_sequence_probs(target, ids, pv)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)
    assert min(pvalues(batch_samples(dec, ids, pv, other, N_SAMPLES, coupled), exact)) > 1e-3


def test_wrong_residual_in_a_batch_is_caught(small, monkeypatch):
    """Negative control: the same test rejects a batch whose recovered token ignores q (rejection
    sampling's residual; the coupling's control: test_seed_promise.py)."""
    from mmspec.runtime import verify

    target, draft, tok, ids, pv, other = small
    exact = exact_sequence_probs(target, ids, pv)
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    dec = SpecDecoder(target, draft, tok, views="MT", gamma=2)
    assert min(pvalues(batch_samples(dec, ids, pv, other, N_CONTROL, coupled=False), exact)) < 1e-5


def test_qwen_mrope_in_a_batch(tok):
    target = make_qwen(0)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok, views="MT")
    reqs, want = [], []
    for k, (n_img, video, n) in enumerate([(1, False, 12), (2, True, 5), (0, True, 9)]):
        ids, mm = qwen_inputs(n_img, video, seed=k)
        reqs.append(dict(input_ids=ids, max_new_tokens=n, **mm))
        want.append(reference(target, ids, None, n, **mm))
    assert [r.token_ids for r in dec.generate_batch(reqs)] == want


# ---------------------------------------------------------------------------- the scheduler
def drain(sched, events=None):
    events = [] if events is None else events
    while sched.has_work():
        events += sched.step()
    return events


def test_join_mid_decode_and_one_target_forward_per_block(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    reqs = requests(4)
    calls, draft_calls = [], []
    hook = target.model.language_model.register_forward_hook(lambda *a: calls.append(1))
    dhook = draft_shared.model.language_model.register_forward_hook(lambda *a: draft_calls.append(1))
    try:
        sched = BatchScheduler(dec, max_batch=3)
        rids = [sched.submit(reqs[0]), sched.submit(reqs[1])]
        events = sched.step()
        assert sched.engine.active == 2  # both prefilled, each in its own row
        events += sched.step()
        rids += [sched.submit(reqs[2]), sched.submit(reqs[3])]  # join at the next block
        n_steps = 2
        while sched.has_work():
            events += sched.step()
            n_steps += 1
    finally:
        hook.remove()
        dhook.remove()
    # ONE prefill per admission (requests 0 and 1 together; 2 and 3 together once request 1, 7 tokens
    # long, has left), then ONE shared target forward per block
    assert len(calls) == 2 + n_steps
    # the draft too: its forwards are merged over the requests (gamma per block at most), not per request
    assert len(draft_calls) <= 4 + n_steps * dec.gamma
    out = {rid: [] for rid in rids}
    for ev in events:
        out[ev.rid] += ev.new_token_ids
        assert ev.error is None
    assert [out[r] for r in rids] == refs[:4]
    finished = {ev.rid: ev.result for ev in events if ev.finished}
    assert [finished[r].token_ids for r in rids] == refs[:4]
    texts = {rid: "".join(ev.text for ev in events if ev.rid == rid) for rid in rids}
    assert texts[rids[0]] == finished[rids[0]].text == tok.decode(refs[0], skip_special_tokens=True)
    assert sched.engine.active == 0


def test_cancel_frees_rows_and_others_go_on(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    reqs = [requests(8)[i] for i in (0, 5, 3)]  # long enough to be active after a block
    sched = BatchScheduler(dec)
    a, b, c = (sched.submit(r) for r in reqs)
    events = sched.step()
    sched.cancel(a)  # active: its row goes, the last row moves into it
    assert sched.engine.active == 2
    events = drain(sched)
    assert all(ev.rid != a for ev in events)
    got = {ev.rid: ev.result.token_ids for ev in events if ev.finished}
    assert got == {b: refs[5], c: refs[3]}
    sched.cancel(12345)  # unknown: ignored
    q = sched.submit(reqs[0])
    sched.cancel(q)  # queued: never starts
    assert not sched.has_work()


def test_a_bad_request_fails_alone(target, draft_shared, tok, refs):
    dec = SpecDecoder(target, draft_shared, tok, views="MTC", captioner=NO_CAPTIONER)
    reqs = requests(3, with_captions=True)
    sched = BatchScheduler(dec)
    with pytest.raises(MMSpecError, match="max_new_tokens"):
        sched.submit(dict(reqs[0], max_new_tokens=0))
    good = [sched.submit(reqs[0]), sched.submit(reqs[1])]
    bad = sched.submit(dict(reqs[2], captions=["one caption"]))  # 2 images: fails at its prefill
    events = drain(sched)
    errors = {ev.rid: ev.error for ev in events if ev.error}
    assert list(errors) == [bad] and "caption" in errors[bad]
    done = {ev.rid: ev.result.token_ids for ev in events if ev.finished and ev.result}
    assert [done[r] for r in good] == refs[:2]


def test_generate_batch_checks_every_request_first(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    reqs = requests(3)
    calls = []
    hook = target.model.language_model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(MMSpecError, match=r"^request 2: .*image slot"):
            dec.generate_batch([reqs[0], reqs[1], dict(reqs[2], pixel_values=reqs[0]["pixel_values"])])
        with pytest.raises(MMSpecError, match=r"^request 1: unsupported generate\(\) argument"):
            dec.generate_batch([reqs[0], dict(reqs[1], colour="red")])
        with pytest.raises(MMSpecError, match=r"^request 1: input_ids has batch size 2; .*generate_batch"):
            dec.generate_batch([reqs[0], dict(reqs[0], input_ids=reqs[0]["input_ids"].repeat(2, 1))])
        with pytest.raises(MMSpecError, match=r"^request 0: the request has no input_ids"):
            dec.generate_batch([{}])
        with pytest.raises(MMSpecError, match=r"^request 1: top_p must be in"):
            dec.generate_batch([reqs[0], dict(reqs[1], top_p=2.0)], temperature=1.0)
    finally:
        hook.remove()
    assert calls == []  # nothing decoded
    with pytest.raises(MMSpecError, match="requests must be a list"):
        dec.generate_batch(reqs[0])


def test_a_request_whose_proposer_fails_fails_alone(target, draft_shared, tok, refs, monkeypatch):
    """Drafting is one set of tensor operations for every row (a failure there is the step's);
    what runs per request is a model-free proposer's search on the host: one that raises fails
    its request alone, the others go on and their caches' memory goes back once idle."""
    dec = SpecDecoder(target, draft_shared, tok, views="MT", model_free="lookup")
    reqs = requests(3)
    sched = BatchScheduler(dec)
    rids = [sched.submit(r) for r in reqs]
    sched.step()
    broken = sched._active[0].proposer
    monkeypatch.setattr(broken, "propose", lambda *a: (_ for _ in ()).throw(RuntimeError("lookup broke")))
    events = drain(sched)
    errors = {ev.rid: ev.error for ev in events if ev.error}
    assert list(errors) == [rids[0]] and "lookup broke" in errors[rids[0]]
    done = {ev.rid: ev.result.token_ids for ev in events if ev.finished and ev.result}
    assert done == {rids[1]: refs[1]}  # (request 2 ended in the first block: one token)
    assert sched.engine.active == 0 and sched.engine.cache.store.kv is None
    assert sched.engine.drafting.rows.cache.store.kv is None


def test_static_cache_decoder_batches_eagerly(target, draft_shared, tok, refs):
    """A decoder set up for fixed shapes (static caches / CUDA graphs) decodes batches eagerly,
    and its own generate still runs on its static caches afterwards."""
    dec = SpecDecoder(target, draft_shared, tok, views="MT", static_cache=True)
    assert [r.token_ids for r in dec.generate_batch(requests(4))] == refs[:4]
    assert dec.static
    r = requests(1)[0]
    assert dec.generate(**r).token_ids == refs[0]


def test_auto_policy_decodes_plainly_where_drafting_was_measured_slower(target, draft_shared, tok, refs):
    pol = SpeculationPolicy("auto", probe_share=0.0)
    pol.cost.smoothing = 0.0  # the seeded costs stay (no timing flakes)
    for b in range(1, 4):  # measured: plain steps 100x cheaper than drafted ones at every batch size here
        for d in range(6):
            pol.record(b, Action(0, d, d + 1), seconds=1.0 if d else 0.01)
        pol.runs = {Action(0, 5, 6): 1, Action(0, 0, 1): 1}
    pol.alpha_prior, pol.prior_n = (1.0, 1.0), 1000
    sched = BatchScheduler(SpecDecoder(target, draft_shared, tok, views="MT"), speculate=pol)
    rids = [sched.submit(r) for r in [requests(8)[i] for i in (0, 5, 3)]]
    events = drain(sched)
    res = {ev.rid: ev.result for ev in events if ev.finished}
    assert [res[r].token_ids for r in rids] == [refs[0], refs[5], refs[3]]
    blocks = [b for r in res.values() for b in r.stats.blocks]
    plain = sum(b.n_drafted == 0 for b in blocks)
    assert plain == len(blocks)  # nothing re-probes drafting (probe_share 0; the start was spent)


def test_a_failed_shared_forward_ends_its_requests_and_the_scheduler_goes_on(target, draft_shared, tok, refs,
                                                                              monkeypatch):
    from mmspec.engine.step import Engine

    sched = BatchScheduler(SpecDecoder(target, draft_shared, tok, views="M"))
    first = [sched.submit(r) for r in requests(2)]
    with monkeypatch.context() as m:
        m.setattr(Engine, "_verify_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
        events = sched.step()
    assert sorted(ev.rid for ev in events if ev.error) == first and "out of memory" in events[0].error
    assert not sched.has_work() and sched.engine.active == 0
    later = sched.submit(requests(1)[0])
    done = {ev.rid: ev.result.token_ids for ev in drain(sched) if ev.finished}
    assert done == {later: refs[0]}


def test_without_stream_text_a_step_decodes_no_text(target, draft_shared, tok, refs):
    """generate and generate_batch read no per-step text: their scheduler decodes none (a
    server's stream does), and the result's text is the whole answer decoded once."""
    sched = BatchScheduler(SpecDecoder(target, draft_shared, tok, views="M"), stream_text=False)
    rid = sched.submit(requests(1)[0])
    events = drain(sched)
    assert all(ev.text == "" for ev in events)
    done = [ev.result for ev in events if ev.finished]
    assert done[0].token_ids == refs[0] and done[0].text == tok.decode(refs[0], skip_special_tokens=True)
    assert [ev.rid for ev in events] == [rid] * len(events)
