"""Drafting with no model (:mod:`mmspec.drafting.lookup`): prompt lookup and suffix decoding, alone and
beside a draft, are lossless (greedy equal to the target's generate; sampling exactly the
target's distribution, with a negative control that must fail), and their bad settings are
refused before anything loads."""

import pytest
import torch

from helpers.reference import exact_sequence_probs, pvalues, reference, sample_seeds
from helpers.tiny import BOS, IMG, make_llava, make_prompt, make_tokenizer
from mmspec import MMSpecError, SpecDecoder
from mmspec.drafting.lookup import NODE_BYTES, SEP, LookupConfig, PromptLookup, SuffixStore, SuffixTrie, pick
from mmspec.drafting.tree import TreeSpec
from mmspec.runtime import verify


# --------------------------------------------------------------------------- the proposers
def test_prompt_lookup_proposes_what_followed_the_longest_match():
    pl = PromptLookup(LookupConfig(ngram_min=1, ngram_max=3))
    pl.extend([5, 6, 7, 8, SEP, 9, 6, 7, 9, 5, 6, 7])  # "6 7" followed by 8 and by 9; "5 6 7" by 8
    root, _ = pl.propose(3)
    assert list(root.kids) == [8]  # the 3-gram "5 6 7" wins over the 2-gram
    assert pick(root, TreeSpec("chain", depth=3), 0.0).tokens == [8]  # cut at the separator
    pl2 = PromptLookup(LookupConfig(ngram_min=1, ngram_max=2))
    pl2.extend([6, 7, 8, 6, 7, 9, 6, 7, 9, 6, 7])
    root, _ = pl2.propose(2)
    assert {t: c.count for t, c in root.kids.items()} == {9: 2, 8: 1}  # counts: the proposal's distribution
    tree = pick(root, TreeSpec("dynamic", depth=2, topk=2, budget=3), 0.0)
    assert (tree.tokens, tree.parents) == ([9, 6, 8], [0, 1, 0])  # best-first: 9 (2/3), 9 6 (2/3), 8 (1/3)


def test_history_puts_captions_first_and_never_matches_placeholders():
    from mmspec.drafting.lookup import history

    ids = torch.tensor([BOS, 5, IMG, IMG, 6, 7])
    assert history(ids, [IMG], [torch.tensor([9, 8])]) == [9, 8, SEP, BOS, 5, SEP, SEP, 6]  # 7: pending
    pl = PromptLookup(LookupConfig(ngram_min=1, ngram_max=2))
    pl.extend([SEP, SEP, 4, SEP, SEP])
    assert pl.propose(3) == (None, 0.0)  # a run of images proposes nothing


def test_suffix_trie_counts_and_removes_exactly():
    trie = SuffixTrie(4)
    trie.add([1, 2, 3, 1, 2, 4])
    node, k = trie.match([7, 1, 2])
    assert k == 2 and {t: c.count for t, c in node.kids.items()} == {3: 1, 4: 1}
    before = trie.nodes
    trie.add([1, 2, 3])
    trie.remove([1, 2, 3])
    assert trie.nodes == before
    trie.remove([1, 2, 3, 1, 2, 4])
    assert trie.nodes == 0 and not trie.root.kids


def test_incremental_trie_equals_a_whole_one():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    a, b = SuffixTrie(5), SuffixTrie(5)
    a.add(seq)
    b.extend(seq[:7]), b.extend(seq[7:])

    def dump(n):
        return {t: (c.count, dump(c)) for t, c in n.kids.items()}

    assert dump(a.root) == dump(b.root) and a.nodes == b.nodes


def test_suffix_store_drops_the_oldest_request_within_its_budget():
    cfg = LookupConfig(suffix_depth=4, suffix_mb=30 * NODE_BYTES / 2**20)  # 30 nodes
    store = SuffixStore(cfg)
    store.add(list(range(10)))  # 4 + 3 + ... suffixes of depth <= 4: 34 nodes > 30: alone too large
    assert not store.requests and store.trie.nodes == 0
    store.add([1, 2, 3])
    store.add([4, 5, 6])
    store.add([7, 8, 9, 10, 11, 12, 13])  # 6 + 6 + 22 nodes > 30: the first goes
    assert list(store.requests.values())[0] == (4, 5, 6) and store.nbytes <= store.budget


def test_node_bytes_estimate_holds():
    import tracemalloc

    tracemalloc.start()
    trie = SuffixTrie(8)
    base = tracemalloc.get_traced_memory()[0]
    g = torch.Generator().manual_seed(0)
    trie.add(torch.randint(0, 1000, (2000,), generator=g).tolist())
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert used / trie.nodes <= NODE_BYTES


# --------------------------------------------------------------------------- greedy: lossless
def repetitive_prompt(seed: int = 0, n_images: int = 1):
    """A prompt whose text repeats itself, so lookup finds matches in it."""
    ids, pv = make_prompt(n_images, 16, seed=seed)
    text = ids[0, -6:].tolist()
    return torch.cat([ids, torch.tensor([text * 3 + text[:2]])], 1), pv


@pytest.mark.parametrize("tree", [None, "dynamic", "4x2x6", [[0], [1], [0, 0], [0, 1], [1, 0]]])
@pytest.mark.parametrize("draft", ["lookup", "suffix"])
def test_model_free_greedy_equals_target(target, tok, draft, tree):
    dec = SpecDecoder(target, draft, tok, tree=tree, lookup_options={"ngram_min": 1}, **({"gamma": 4} if tree is None else {}))
    blocks = 0
    for seed in range(3):  # suffix: later requests draft from the earlier ones
        ids, pv = repetitive_prompt(seed, n_images=1 + seed)
        res = dec.generate(ids, pv, max_new_tokens=30)
        assert res.token_ids == reference(target, ids, pv, 30)
        assert sum(res.stats.tokens_per_block) == len(res.token_ids)
        blocks += len(res.stats.blocks)
    assert blocks < 90  # something was accepted
    if draft == "suffix":
        assert len(dec.suffix_store.requests) == 3
    assert dec.method == draft + ("" if tree is None else "+tree")


@pytest.mark.parametrize("method", ["lookup", "suffix"])
@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_beside_a_draft_greedy_equals_target(target, draft_shared, tok, method, tree):
    dec = SpecDecoder(target, draft_shared, tok, views="MT", model_free=method, tree=tree)
    for seed in range(2):
        ids, pv = repetitive_prompt(10 + seed)
        assert dec.generate(ids, pv, max_new_tokens=40).token_ids == reference(target, ids, pv, 40)
    assert dec.method == f"MT+{method}" + ("" if tree is None else "+tree")


def test_beside_a_head_greedy_equals_target(target, tok):
    from mmspec.heads import build_head

    dec = SpecDecoder(target, build_head(target, "eagle", seed=1), tok, model_free="suffix", tree="dynamic")
    for seed in range(2):
        ids, pv = repetitive_prompt(20 + seed)
        assert dec.generate(ids, pv, max_new_tokens=30).token_ids == reference(target, ids, pv, 30)


def test_the_added_branches_are_verified(target, draft_shared, tok):
    """Beside a weak draft, lookup's branches are accepted: fewer blocks than the draft alone."""
    weak = make_llava(99)
    ids, pv = make_prompt(1, 16, seed=3)
    ref = reference(target, ids, pv, 40)
    # the target's own answer is in the prompt: lookup can copy it, the unrelated draft cannot
    ids = torch.cat([ids, torch.tensor([ref + ids[0, -6:].tolist()])], 1)
    ref = reference(target, ids, pv, 40)
    alone = SpecDecoder(target, weak, tok).generate(ids, pv, max_new_tokens=40)
    both = SpecDecoder(target, weak, tok, model_free="lookup").generate(ids, pv, max_new_tokens=40)
    assert alone.token_ids == both.token_ids == ref
    assert len(both.stats.blocks) < len(alone.stats.blocks)


def test_prefix_cache_and_turns_with_suffix(target, tok):
    """A conversation's turn 2 (extending turn 1's prompt and answer) reuses turn 1's target
    cache and stays exact; the store holds both turns."""
    dec = SpecDecoder(target, "suffix", tok)
    ids, pv = repetitive_prompt(5)
    first = dec.generate(ids, pv, max_new_tokens=12).token_ids
    ids2 = torch.cat([ids, torch.tensor([first + [7, 8, 9]])], 1)
    res = dec.generate(ids2, pv, max_new_tokens=20)
    assert res.token_ids == reference(target, ids2, pv, 20)
    assert res.stats.prompt_tokens_reused > 0 and len(dec.suffix_store.requests) == 2


def test_embedded_pack_lossless():
    from mmspec.embedded import load_embedded
    from mmspec.inputs import processor_inputs
    from mmspec.world import make_sample

    m = load_embedded()
    decs = [SpecDecoder(m.target, "lookup", m.tokenizer), SpecDecoder(m.target, "suffix", m.tokenizer, gamma=8),
            SpecDecoder(m.target, m.draft, m.tokenizer, model_free="suffix", tree="dynamic")]
    for fam in ("chartqa", "spot_the_diff", "vist"):
        s = make_sample(fam, "test", 0)
        inp = processor_inputs(m.processor, s.prompt, s.images)
        n = inp["input_ids"].shape[1]
        ref = m.target.generate(**inp, do_sample=False, max_new_tokens=48)[0, n:].tolist()
        for dec in decs:
            assert dec.generate(inp["input_ids"], inp["pixel_values"], max_new_tokens=48).token_ids == ref


# --------------------------------------------------------------------------- sampling: exact
V = 8
N_NEW, TEMP, N_SAMPLES, N_CONTROL = 3, 1.0, 1200, 600


@pytest.fixture(scope="module")
def setup():
    target = make_llava(41, vocab=V, eos=2)
    draft = make_llava(42, vocab=V, hidden=32, layers=1, eos=2)
    tok = make_tokenizer(V)
    g = torch.Generator().manual_seed(5)
    # the text repeats with different continuations: lookup's counts make a real distribution
    ids = torch.tensor([[BOS, 5, 6, 5, 7, 5, 6] + [IMG] * 16 + [7, 5]])
    pv = torch.randn(1, 3, 32, 32, generator=g, dtype=torch.float64)
    return target, draft, tok, ids, pv


def sampled(dec, ids, pv, n: int = N_SAMPLES, coupled: bool = False):
    """n sequences, seeds 0 .. n - 1: by rejection sampling (what tests the proposals' q), or by
    the Gumbel-max coupling every sampling request uses (``coupled``)."""
    return sample_seeds(dec, n, coupled, input_ids=ids, pixel_values=pv, max_new_tokens=N_NEW, temperature=TEMP)


ONE_GRAM = {"ngram_min": 1, "ngram_max": 1}


@pytest.mark.parametrize("kind", ["lookup chain (drawn from counts)", "suffix tree (point masses)",
                                  "M + lookup chain (a drawn draft token with siblings)", "MT + suffix tree",
                                  "MT + suffix tree, coupled"])
def test_sampling_matches_target_distribution(setup, kind):
    target, draft, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    kw = {"lookup_options": ONE_GRAM if "lookup" in kind else None}
    if "tree" in kind:
        kw.update(tree="dynamic", tree_depth=2, tree_topk=2, tree_budget=4)
    else:
        kw["gamma"] = 2
    name = "lookup" if "lookup" in kind else "suffix"
    if kind.startswith("M"):
        dec = SpecDecoder(target, draft, tok, views=kind.split()[0], model_free=name, **kw)
    else:
        dec = SpecDecoder(target, name, tok, **kw)
    assert min(pvalues(sampled(dec, ids, pv, coupled="coupled" in kind), exact)) > 1e-3


def test_lookup_draws_from_its_counts(setup):
    """A lookup chain under sampling is drawn (its q: the counts), and a seed reproduces it."""
    target, _, tok, ids, pv = setup
    dec = SpecDecoder(target, "lookup", tok, gamma=2, lookup_options=ONE_GRAM)
    a = [dec.generate(ids, pv, max_new_tokens=6, temperature=1.0, seed=s).token_ids for s in range(5)]
    assert a == [dec.generate(ids, pv, max_new_tokens=6, temperature=1.0, seed=s).token_ids for s in range(5)]


def test_wrong_residual_is_caught(setup, monkeypatch):
    """Negative control: a recovered token that ignores the counts q it was drawn from biases
    the output; the same test must reject it."""
    target, _, tok, ids, pv = setup
    exact = exact_sequence_probs(target, ids, pv)
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    dec = SpecDecoder(target, "lookup", tok, gamma=2, lookup_options=ONE_GRAM)
    assert min(pvalues(sampled(dec, ids, pv, N_CONTROL), exact)) < 1e-5


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("options, says", [
    ({"ngram_max": 0}, "ngram_max must be a whole number from 1 to 32"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min (3) is above ngram_max (2)"),
    ({"candidates": 0}, "candidates must be a whole number from 1 to 256"),
    ({"suffix_depth": 1}, "suffix_depth must be a whole number from 2 to 256"),
    ({"suffix_mb": 0}, "a suffix budget of 0 keeps no history"),
    ({"suffix_mb": -1}, "suffix_mb must be a number of MiB > 0"),
    ({"suffix_factor": 0}, "suffix_factor must be a number in (0, 64]"),
    ({"suffix_min_prob": 1.0}, "suffix_min_prob must be a probability in [0, 1)"),
    ({"ngram": 3}, "unknown setting(s) ['ngram']"),
    ("ngram_max=3", "lookup_options must be a dict"),
])
def test_bad_settings_refused_before_loading(options, says):
    with pytest.raises(MMSpecError, match=None) as e:
        SpecDecoder("/nonexistent/target", "suffix", "/nonexistent/tok", lookup_options=options)
    assert says in str(e.value)


@pytest.mark.parametrize("kw, says", [
    ({"views": "MT"}, "views='MT' was given with draft='lookup'"),
    ({"weights": [1.0]}, "weights= was given with draft='lookup'"),
    ({"captioner": "x"}, "pass captions=[...] to generate()"),
    ({"draft_processor": "x"}, "draft_processor= was given with draft='lookup'"),
    ({"substitute": "x"}, "substitute= was given with draft='lookup'"),
    ({"tree_children": "views"}, "tree_children='views' makes each view's top tokens siblings"),
    ({"model_free": "suffix"}, "draft='lookup' already drafts with no model"),
])
def test_draft_model_options_refused_with_a_lookup_draft(kw, says):
    with pytest.raises(MMSpecError) as e:
        SpecDecoder("/nonexistent/target", "lookup", "/nonexistent/tok", **kw)
    assert says in str(e.value)


def test_model_free_name_and_options_without_it_refused():
    with pytest.raises(MMSpecError, match="model_free must be one of lookup, suffix"):
        SpecDecoder("/nonexistent/target", "/nonexistent/draft", "/nonexistent/tok", model_free="ngram")
    with pytest.raises(MMSpecError, match="lookup_options= sets the model-free drafters"):
        SpecDecoder("/nonexistent/target", "/nonexistent/draft", "/nonexistent/tok", lookup_options={})


def test_bench_method_notation():
    from mmspec.bench.config import parse_method

    assert parse_method("suffix") == ((), {"draft": "suffix"})
    assert parse_method("lookup+tree:6x2x8") == ((), {"draft": "lookup", "tree": "6x2x8"})
    assert parse_method("M+suffix+tree") == (("M",), {"model_free": "suffix", "tree": "dynamic"})
    assert parse_method("eagle+lookup") == ((), {"model_free": "lookup", "head": "eagle"})
    with pytest.raises(MMSpecError, match="two model-free drafts"):
        parse_method("M+lookup+suffix")
    with pytest.raises(MMSpecError, match="no views to weigh"):
        parse_method("suffix+adaptive")


@pytest.mark.parametrize("method", ["lookup", "suffix", "MT+suffix"])
def test_generate_batch_equals_target(target, draft_shared, tok, method):
    """generate_batch (one block over every request) with a model-free draft, alone or beside a
    draft model: each request's tokens are the target's; suffix's store learns every request."""
    if method.startswith("MT"):
        dec = SpecDecoder(target, draft_shared, tok, views="MT", model_free="suffix")
    else:
        dec = SpecDecoder(target, method, tok, lookup_options={"ngram_min": 1})
    prompts = [repetitive_prompt(30 + i, n_images=1 + i % 2) for i in range(3)]
    out = dec.generate_batch([{"input_ids": ids, "pixel_values": pv, "max_new_tokens": 20} for ids, pv in prompts])
    for (ids, pv), res in zip(prompts, out):
        assert res.token_ids == reference(target, ids, pv, 20)
    if dec.suffix_store is not None:
        assert len(dec.suffix_store.requests) == 3


@pytest.mark.parametrize("alongside", [False, True], ids=["suffix alone", "M + suffix"])
def test_a_seed_reproduces_a_sampled_answer_with_suffix_decoding(target, draft_shared, tok, alongside):
    """Issue 51 (a user's report): the same request with the same seed, four times, with suffix
    decoding, gave different answers, because each finished request joins the decoder's suffix
    store and the next one's trees (and so the draws they consume) changed. A sampled request's
    suffix proposals now come from its own text: the seed alone decides its answer, in a batch
    too. Greedy requests still search the store (their answer is the target's whatever it holds)."""
    draft = draft_shared if alongside else "suffix"
    kw = dict(model_free="suffix") if alongside else {}
    dec = SpecDecoder(target, draft, tok, gamma=4, **kw)
    ids, pv = make_prompt(1, 16, seed=77)
    runs = [dec.generate(ids, pv, max_new_tokens=24, temperature=0.9, seed=11).token_ids for _ in range(4)]
    assert len(dec.suffix_store.trie.root.kids) > 0  # the store did fill up between the runs
    assert all(r == runs[0] for r in runs), runs
    batch = dec.generate_batch([dict(input_ids=ids, pixel_values=pv, max_new_tokens=24, temperature=0.9, seed=11),
                                dict(input_ids=make_prompt(1, 16, seed=78)[0], pixel_values=pv, max_new_tokens=24,
                                     temperature=0.9, seed=5)])
    assert batch[0].token_ids == runs[0]
