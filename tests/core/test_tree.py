"""Token trees are lossless: greedy output equals target.generate(do_sample=False) for static and
dynamic trees of many shapes, every view and ensemble, 1/2/5 images, EOS inside a tree and the
token limit cutting a branch; one target forward per block; the vectorised sampling rule is the
sequential recursive rejection, and it reproduces the target's distribution exactly."""

from __future__ import annotations

import pytest
import torch

from helpers.reference import captions, reference
from helpers.tiny import make_llava, make_prompt, noisy_copy
from helpers.verify_ref import accept_or_residual
from mmspec import SpecDecoder
from mmspec.drafting.tree import TreeSpec, ancestors, parse_tree
from mmspec.errors import MMSpecError
from mmspec.models.captioner import FixedCaptioner
from mmspec.runtime import verify
from mmspec.runtime.verify import residual, verify_tree_greedy, verify_tree_sampling

STATIC = {
    "d1w1": [[0]],
    "d1w4": [[0], [1], [2], [3]],
    "chain6": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    "medusa": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
    "w3d4": [[0], [1], [2], [0, 0], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
}
DYNAMIC = {
    "k1d1": dict(tree="dynamic", tree_depth=1, tree_topk=1, tree_budget=1),
    "k2d3": dict(tree="dynamic", tree_depth=3, tree_topk=2, tree_budget=5),
    "k4d4": dict(tree="dynamic", tree_depth=4, tree_topk=4, tree_budget=20),
    "k3d6all": dict(tree="dynamic", tree_depth=6, tree_topk=3, tree_budget=1000),
    "views": dict(tree="dynamic", tree_depth=4, tree_topk=2, tree_budget=8, tree_children="views"),
}
SHAPES = {**{f"static-{k}": dict(tree=v) for k, v in STATIC.items()}, **{f"dynamic-{k}": v for k, v in DYNAMIC.items()}}


@pytest.mark.parametrize("n_images", [1, 2, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["M", "MTCP"])
def test_trees_match_target(target, draft_shared, tok, shape, method, n_images):
    ids, pv = make_prompt(n_images, 16, seed=n_images)
    dec = SpecDecoder(target, draft_shared, tok, views=method, captioner=captions(n_images), **SHAPES[shape])
    res = dec.generate(ids, pv, max_new_tokens=24)
    assert res.token_ids == reference(target, ids, pv, 24)
    assert 1.0 <= res.stats.tau <= dec.tree.max_depth + 1


@pytest.mark.parametrize("method", ["T", "C", "P", "MT", "MC", "MTC"])
@pytest.mark.parametrize("shape", ["static-medusa", "dynamic-k2d3", "dynamic-views"])
def test_every_view_and_ensemble_with_trees(target, draft_shared, tok, method, shape):
    ids, pv = make_prompt(2, 16, seed=12)
    dec = SpecDecoder(target, draft_shared, tok, views=method, captioner=captions(2), **SHAPES[shape])
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)


@pytest.mark.parametrize("method", ["M", "MTCP"])
def test_tree_with_a_draft_of_its_own_vision_and_a_text_draft(target, draft_small, draft_text, tok, method):
    ids, pv = make_prompt(2, 16, seed=14)
    dec = SpecDecoder(target, draft_small, tok, views=method, captioner=captions(2), tree="dynamic")
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)
    dec = SpecDecoder(target, draft_text, tok, views="TC", captioner=captions(2), tree=STATIC["medusa"])
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == reference(target, ids, pv, 20)


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 7, 13])
@pytest.mark.parametrize("shape", ["static-w3d4", "dynamic-k3d6all"])
def test_limit_cuts_a_branch_exactly(target, draft_shared, tok, max_new, shape):
    ids, pv = make_prompt(1, 16, seed=4)
    res = SpecDecoder(target, draft_shared, tok, views="MT", **SHAPES[shape]).generate(ids, pv, max_new_tokens=max_new)
    assert res.token_ids == reference(target, ids, pv, max_new) and len(res.token_ids) == max_new


@pytest.mark.parametrize("eos_at", [0, 2, 5, 9])
@pytest.mark.parametrize("shape", ["static-medusa", "dynamic-k4d4"])
def test_eos_inside_the_tree(tok, eos_at, shape):
    base = make_llava(0)
    ids, pv = make_prompt(1, 16, seed=5)
    free = reference(base, ids, pv, 30)
    target = make_llava(0, eos=free[eos_at])
    draft = noisy_copy(target, 1, scale=0.05)  # close draft: EOS is usually inside an accepted path
    ref = reference(target, ids, pv, 30)
    assert ref[-1] == free[eos_at]
    dec = SpecDecoder(target, draft, tok, views="M", **SHAPES[shape])
    assert dec.generate(ids, pv, max_new_tokens=30).token_ids == ref


def test_static_engine_path_matches_with_trees(target, draft_shared, tok):
    """The fixed-shape path (full-buffer caches, 4-D masks) and its emulated graph capture give
    the same tokens as the eager path, with the caches and runners reused across calls."""
    for n_images, shape in [(1, "dynamic-k4d4"), (2, "static-medusa"), (5, "dynamic-views")]:
        ids, pv = make_prompt(n_images, 16, seed=30 + n_images)
        ref = reference(target, ids, pv, 24)
        for kw in (dict(static_cache=True), dict(cuda_graphs="emulate")):
            dec = SpecDecoder(target, draft_shared, tok, views="MT", **SHAPES[shape], **kw)
            for _ in range(2):
                assert dec.generate(ids, pv, max_new_tokens=24).token_ids == ref
            assert dec.engine == "static"


def test_one_target_forward_per_block_and_no_draft_reprefill(target, draft_shared, tok):
    t_calls, d_calls = [], []
    h1 = target.model.language_model.register_forward_hook(lambda m, a, k, o: t_calls.append(1), with_kwargs=True)
    h2 = draft_shared.model.language_model.register_forward_hook(
        lambda m, a, k, o: d_calls.append(int((k.get("inputs_embeds") if k.get("inputs_embeds") is not None
                                               else k["input_ids"]).shape[1])), with_kwargs=True)
    try:
        ids, pv = make_prompt(2, 16, seed=9)
        dec = SpecDecoder(target, draft_shared, tok, views="M", tree="dynamic", tree_depth=4, tree_topk=3,
                          tree_budget=10)
        res = dec.generate(ids, pv, max_new_tokens=25)
    finally:
        h1.remove()
        h2.remove()
    blocks = res.stats.n_blocks
    assert len(t_calls) == 1 + blocks  # one prefill, then one verify forward per block
    assert d_calls[0] == ids.shape[1] - 1  # one draft prefill of the prompt less the pending token
    # each later draft forward feeds 1-2 pending tokens or one frontier of topk nodes: never a re-prefill
    assert all(n <= 3 for n in d_calls[1:]) and len(d_calls) - 1 <= blocks * 4


def test_dynamic_draft_length_stops_early_and_stays_lossless(target, draft_shared, tok):
    ids, pv = make_prompt(1, 16, seed=6)
    full = SpecDecoder(target, draft_shared, tok, views="M", gamma=8).generate(ids, pv, max_new_tokens=30)
    short = SpecDecoder(target, draft_shared, tok, views="M", gamma=8, stop_below=0.9).generate(ids, pv, max_new_tokens=30)
    assert short.token_ids == full.token_ids == reference(target, ids, pv, 30)
    assert sum(b.n_drafted for b in short.stats.blocks) < sum(b.n_drafted for b in full.stats.blocks)


# --------------------------------------------------------------------------- the maths alone
def _random_tree(n: int, width: int, g: torch.Generator) -> torch.Tensor:
    """parents [n] of a random tree in parents-first order, at most ``width`` children a node."""
    parents = [-1]
    for i in range(1, n):
        while True:
            p = int(torch.randint(0, i, (1,), generator=g))
            if parents.count(p) < width:
                break
        parents.append(p)
    order = sorted(range(n), key=lambda i: (_depth(parents, i), parents[i], i))  # siblings stay in order
    inv = {old: new for new, old in enumerate(order)}
    return torch.tensor([-1 if parents[i] < 0 else inv[parents[i]] for i in order])


def _depth(parents, i):
    d = 0
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d


def _sequential(tokens, parents, p, q, sampled, u):
    """Recursive rejection sampling node by node with accept_or_residual (the definition)."""
    n = tokens.shape[0]
    node, path = 0, [0]
    dist = p[0]
    while True:
        kids = [i for i in range(n) if int(parents[i]) == node]
        moved = False
        for c in kids:
            qc = q[c] if bool(sampled[c]) else torch.nn.functional.one_hot(tokens[c], p.shape[-1]).to(p.dtype)
            ok, dist2 = accept_or_residual(int(tokens[c]), dist, qc, float(u[c]))
            if ok:
                node, moved = c, True
                path.append(c)
                dist = p[c]
                break
            dist = dist2
        if not moved:
            return path, int(verify.sample(dist, u[n]))


def test_closed_form_sampling_is_the_sequential_algorithm():
    g = torch.Generator().manual_seed(0)
    V = 6
    for trial in range(300):
        n = int(torch.randint(2, 12, (1,), generator=g))
        parents = _random_tree(n, 1 if trial % 3 == 0 else 3, g)
        depth = torch.tensor([_depth(parents.tolist(), i) for i in range(n)])
        anc = ancestors(parents, int(depth.max()))
        p = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, -1)
        tokens = torch.zeros(n, dtype=torch.long)
        for a in range(n):  # distinct siblings
            kids = (parents == a).nonzero().flatten()
            tokens[kids] = torch.randperm(V, generator=g)[: len(kids)]
        chain = trial % 3 == 0
        sampled = torch.tensor([chain and i > 0 for i in range(n)])
        u = torch.rand(n + 1, generator=g, dtype=torch.float64)
        out = verify_tree_sampling(tokens, parents, depth, anc, p, q, sampled if chain else None, u, int(depth.max()))
        path, nxt = _sequential(tokens, parents, p, q, sampled, u)
        assert int(out.n_accepted) == len(path) - 1 and int(out.next_token) == nxt
        assert out.path[: len(path)].tolist() == path


def test_greedy_tree_takes_the_matching_branch():
    # root -> a (1) | b (2); a -> c (3); b -> d (4) | e (5); the target wants 2 then 5 then 0
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    tokens = torch.tensor([9, 1, 2, 3, 4, 5])
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    logits = torch.full((6, 10), -5.0)
    for node, want in {0: 2, 1: 3, 2: 5, 3: 7, 4: 8, 5: 0}.items():
        logits[node, want] = 5.0
    out = verify_tree_greedy(tokens, parents, depth, ancestors(parents, 2), logits, 2)
    assert (int(out.n_accepted), int(out.next_token), out.path.tolist()) == (2, 0, [0, 2, 5])


P3 = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])


def _first_token_counts(n_draws, seed):
    """Root with three point-mass children (tokens 0, 3, 4): the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    parents, tokens, depth = torch.tensor([-1, 0, 0, 0]), torch.tensor([1, 0, 3, 4]), torch.tensor([0, 1, 1, 1])
    anc = ancestors(parents, 1)
    p = torch.stack([P3] * 4).double()
    counts = torch.zeros(5)
    for _ in range(n_draws):
        out = verify_tree_sampling(tokens, parents, depth, anc, p, None, None,
                                   torch.rand(5, generator=g, dtype=torch.float64), 1)
        first = int(tokens[out.path[1]]) if int(out.n_accepted) else int(out.next_token)
        counts[first] += 1
    return counts


def test_siblings_reproduce_p_and_a_wrong_residual_is_caught(monkeypatch):
    from helpers.reference import chi2_pvalue

    assert chi2_pvalue(_first_token_counts(6000, 1), P3.double()) > 1e-3
    monkeypatch.setattr(verify, "remaining_mass", lambda p_elder: torch.ones(p_elder.shape[0], dtype=p_elder.dtype))
    monkeypatch.setattr(verify, "remove_tokens", lambda p, removed: p)
    assert chi2_pvalue(_first_token_counts(6000, 1), P3.double()) < 1e-6


def test_residual_is_still_the_chain_rule():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))


# --------------------------------------------------------------------------- specs
def test_tree_specs_parse_and_refuse_bad_ones():
    assert parse_tree(None, gamma=4) == TreeSpec("chain", depth=4)
    assert parse_tree("[[0], [1], [0, 0]]", gamma=4).paths == ((0,), (1,), (0, 0))
    d = parse_tree("dynamic", gamma=4, device_type="cuda")
    assert d.kind == "dynamic" and d.n_nodes - 1 == d.budget
    assert TreeSpec("dynamic", depth=3, topk=2).n_generated == 2 + 2 * 4
    for bad, msg in [([[0, 0]], "no parent path"), ([[0], [2]], "skips rank 1"), ([[0], [0]], "listed twice"),
                     ([[]], "non-empty"), ("bushy", "unknown tree"), ("[[0]", "JSON")]:
        with pytest.raises(MMSpecError, match=msg):
            parse_tree(bad, gamma=4)
    with pytest.raises(MMSpecError, match="stop_below"):
        TreeSpec("dynamic", stop_below=0.5)
    with pytest.raises(MMSpecError, match="budget"):
        TreeSpec("dynamic", budget=0)


def test_one_tree_notation_and_options_never_silently_ignored():
    """chain, dynamic, DxKxB, static JSON; a zero, a shape flag without a dynamic tree, stop_below
    with a tree, children for a chain: refused, in SpecDecoder's words or the CLI's."""
    assert parse_tree("6x4x16", gamma=4) == TreeSpec("dynamic", depth=6, topk=4, budget=16)
    assert parse_tree("chain", gamma=3, stop_below=0.5) == TreeSpec("chain", depth=3, stop_below=0.5)
    assert parse_tree("dynamic", gamma=4, budget=7).budget == 7
    assert parse_tree("[[0],[1]]", gamma=4, children="views").children == "views"
    for kw, msg in [(dict(tree="dynamic", stop_below=0.3), "stop_below .* applies to chains only"),
                    (dict(tree="dynamic", depth=0), "tree_depth must be a whole number >= 1"),
                    (dict(tree="dynamic", budget=0), "tree_budget must be"),
                    (dict(tree="dynamic", topk=0), "tree_topk must be"),
                    (dict(tree="0x4x16"), "the depth in tree '0x4x16' must be >= 1"),
                    (dict(tree=None, depth=4), "tree_depth needs tree=.dynamic. \\(a chain.s length is gamma\\)"),
                    (dict(tree="chain", children="views"), "shapes a tree's children"),
                    (dict(tree="6x4x16", budget=3), "already sets depth, top-k and budget"),
                    (dict(tree=[[0]], topk=2), "a static tree's paths fix its shape"),
                    (dict(tree=[["a"]]), "child ranks >= 0"),
                    (dict(tree="bushy"), "DEPTHxTOPKxBUDGET such as '6x4x16'")]:
        with pytest.raises(MMSpecError, match=msg):
            parse_tree(gamma=4, **kw)
    with pytest.raises(MMSpecError, match="--tree-budget needs --tree dynamic .* --gamma"):
        parse_tree(None, gamma=4, budget=8, spelling="cli")
    assert parse_tree("[[0],[1],[2],[0,0]]", gamma=4).width == 3 and parse_tree("6x4x16", gamma=4).width == 4
    from mmspec.checks import check_tree_fits_vocab

    with pytest.raises(MMSpecError, match="tree_topk=4 is more children per node than the draft's 3 tokens"):
        check_tree_fits_vocab(parse_tree("6x4x16", gamma=4), 3)


def test_decoder_refuses_trees_on_models_with_sliding_windows(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    target = make_llava(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, layer_types=["sliding_attention", "full_attention"],
                      sliding_window=8)
    draft = LlamaForCausalLM(cfg).double().eval()
    with pytest.raises(MMSpecError, match="full attention"):
        SpecDecoder(target, draft, tok, views="T", tree="dynamic")
    SpecDecoder(target, draft, tok, views="T")  # a chain is fine


def test_captioned_tree_method_name(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="MTC", captioner=FixedCaptioner(["w5"]), tree="dynamic")
    assert dec.method == "MTC+tree"


# --------------------------------------------------------------------------- relaxed acceptance (lossy, opt-in)
def test_relaxed_acceptance_is_opt_in_named_lossy_and_accepts_more(tok):
    """MSD's relaxed acceptance accepts any draft token the target finds likely enough: more
    tokens per block, and outputs that are no longer the target's. Never the default."""
    target = make_llava(0)
    with torch.no_grad():
        target.lm_head.weight.div_(6.0)  # flatter target distributions: likely non-argmax tokens exist
    draft = noisy_copy(target, 1, scale=0.3)
    exact_dec = SpecDecoder(target, draft, tok, views="M")
    relaxed = SpecDecoder(target, draft, tok, views="M", acceptance="relaxed", relaxed_thresholds=(0.01, 0.01))
    assert exact_dec.acceptance is None and exact_dec.method == "M" and relaxed.method == "M+relaxed"
    differs, taus = 0, {"exact": [], "relaxed": []}
    for seed in range(6):
        ids, pv = make_prompt(1, 16, seed=60 + seed)
        ref = reference(target, ids, pv, 24)
        e, r = exact_dec.generate(ids, pv, max_new_tokens=24), relaxed.generate(ids, pv, max_new_tokens=24)
        assert e.token_ids == ref and r.stats.acceptance == "relaxed (lossy)"
        differs += r.token_ids != ref
        taus["exact"].append(e.stats.tau)
        taus["relaxed"].append(r.stats.tau)
    assert differs >= 1 and sum(taus["relaxed"]) > sum(taus["exact"])
    with pytest.raises(MMSpecError, match="greedy decoding only"):
        relaxed.generate(*make_prompt(1, 16, seed=1), max_new_tokens=4, temperature=1.0)
    for bad, msg in [(dict(acceptance="loose"), "exact"), (dict(acceptance="relaxed", relaxed_thresholds=(0, 2)),
                                                           "two probabilities")]:
        with pytest.raises(MMSpecError, match=msg):
            SpecDecoder(target, draft, tok, views="M", **bad)


def test_relaxed_thresholds_follow_the_modality_of_the_context(target, draft_shared, tok):
    """Each row's threshold: the vision one within ``relaxed_window`` slots after its prompt's last
    image, the text one past it and in a row with no image."""
    from mmspec.batch import BatchScheduler

    dec = SpecDecoder(target, draft_shared, tok, views="M", acceptance="relaxed", relaxed_window=10)
    sched = BatchScheduler(dec, max_batch=2)
    for n_img in (1, 0):
        ids, pv = make_prompt(n_img, 16, seed=2, text_len=3)
        sched.submit(dict(input_ids=ids, pixel_values=pv, max_new_tokens=4))
    sched.admit()
    st = sched.engine.state
    vision, text = torch.tensor([0.6, 0.4], dtype=torch.float32).tolist()  # as float32 holds them
    assert sched.engine._thresholds(2).tolist() == [vision, text]  # 3 text tokens after the image: near it
    with torch.inference_mode():
        st.length[0] = st.last_image[0] + 10
        assert sched.engine._thresholds(2).tolist() == [vision, text]
        st.length[0] += 1
        assert sched.engine._thresholds(2).tolist() == [text, text]
    for rid in (0, 1):
        sched.cancel(rid)


def test_outcome_is_read_once_and_unpacked_to_named_fields():
    """The engine's one host read per block: packed() -> .tolist() -> unpack(), named fields cut
    to the accepted path (no slicing by offsets in the loop)."""
    from mmspec.runtime.verify import TreeOutcome

    out = TreeOutcome(path=torch.tensor([0, 2, 5, 5]), n_accepted=torch.tensor(2), next_token=torch.tensor(9))
    tokens, fed = torch.arange(10, 16), torch.tensor([3, -1, 4, -1, -1, -1])
    acc = out.unpack(out.packed(tokens, fed).tolist())
    assert (acc.n_accepted, acc.next_token, acc.path) == (2, 9, [0, 2, 5])
    assert acc.along == ([10, 12, 15], [3, 4, -1]) and not acc.is_first_branch
    chain = TreeOutcome(path=torch.tensor([0, 1, 1]), n_accepted=torch.tensor(1), next_token=torch.tensor(4))
    assert chain.unpack(chain.packed().tolist()).is_first_branch
