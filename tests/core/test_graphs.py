"""The fixed-shape / CUDA-graph path: same tokens as eager, graphs captured once per shape and
reused across calls, a clear fallback when capture fails, one host sync per block on a GPU.
The CUDA tests are skipped on machines without a GPU (CI); the CPU tests run the same
bookkeeping with an emulated capture."""

from __future__ import annotations

import warnings

import pytest
import torch

from helpers.reference import captions, engine_of, reference, step_graphs
from helpers.tiny import VOCAB, make_llava, make_prompt, noisy_copy
from mmspec import SpecDecoder
from mmspec.errors import MMSpecError
from mmspec.models.base import adapter_for
from mmspec.models.rows import RowCache
from mmspec.runtime.forwards import RowForward
from mmspec.runtime.graphs import GraphPool, StepRunner, graph_mode
from mmspec.runtime.masks import causal, rows_mask

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graph_mode_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert graph_mode("auto", cpu, cpu) == "eager" and graph_mode(False, gpu, gpu) == "eager"
    assert graph_mode("auto", gpu, gpu) == "cuda" and graph_mode("auto", gpu, torch.device("cuda:1")) == "eager"
    with pytest.raises(MMSpecError, match="one CUDA device"):
        graph_mode(True, cpu, cpu)
    with pytest.raises(MMSpecError, match="'auto', True or False"):
        graph_mode("always", cpu, cpu)


def test_decoder_defaults_to_eager_on_cpu(target, draft_shared, tok):
    dec = SpecDecoder(target, draft_shared, tok, views="M")
    assert dec.engine == "eager" and not dec.static


def test_emulated_graphs_are_captured_once_and_reused(target, draft_shared, tok):
    ids, pv = make_prompt(2, 16, seed=21)
    ref = reference(target, ids, pv, 20)
    dec = SpecDecoder(target, draft_shared, tok, views="MTC", captioner=captions(2), tree="dynamic",
                      cuda_graphs="emulate")
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == ref
    shapes = step_graphs(dec)
    assert shapes and all(shapes.values())  # the whole step of each plan, captured
    assert dec.generate(ids, pv, max_new_tokens=20).token_ids == ref
    assert step_graphs(dec) == shapes  # nothing new captured


def test_capture_failure_falls_back_to_eager_with_one_warning(target, draft_shared, tok, monkeypatch):
    def broken(self, *a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepRunner, "_capture", broken)
    ids, pv = make_prompt(1, 16, seed=22)
    dec = SpecDecoder(target, draft_shared, tok, views="M", cuda_graphs="emulate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dec.generate(ids, pv, max_new_tokens=16).token_ids == reference(target, ids, pv, 16)
    msgs = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(msgs) == 1 and "running it eagerly" in msgs[0]  # once for the engine, not per step or plan
    assert engine_of(dec).graphs_failed


def test_a_pool_whose_graphs_are_all_gone_is_never_captured_into_again():
    """Issue 51: after a static cache grew, its runner dropped its graphs but kept their pool, and
    the next capture into it made the CUDA allocator assert (``use_count > 0``); the emulated pool
    asserts the same way, and a GraphPool opens a fresh pool once its last graph is gone."""
    pool = GraphPool("emulate")
    runner = StepRunner(lambda x: x * 2, mode="emulate", pool=pool)
    runner(x=torch.ones(2, 1))
    held = pool.handle
    runner.reset()  # the buffers were reallocated: every graph dropped
    assert pool.handle is None and pool.graphs == 0
    with pytest.raises(RuntimeError, match="use_count > 0"):
        held.use()  # the old pool: what the allocator refuses
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no capture falls back
        assert runner(x=torch.ones(2, 1)).tolist() == [[2.0], [2.0]]
    assert runner.graphs and pool.graphs == 1


@pytest.mark.parametrize("mode, fail_at, where", [
    ("emulate", 1, "layers.1"), ("emulate", 1, "norm"),
    pytest.param("cuda", 1, "layers.1", marks=cuda),  # a warm-up run fails
    pytest.param("cuda", 3, "layers.1", marks=cuda), pytest.param("cuda", 3, "norm", marks=cuda),  # the capture fails
])
@torch.inference_mode()
def test_capture_failing_part_way_falls_back_to_the_right_logits(target, mode, fail_at, where):
    """A REAL capture (emulated on the CPU; on a GPU a warm-up or the capture itself) that raises
    part-way, after the first layer wrote its keys ("layers.1") or after every layer did ("norm"):
    the eager fallback writes the same slots again, so its logits are the target's, and so are
    the next step's."""
    model = target if mode == "emulate" else make_llava(0, dtype=torch.float32).cuda()
    dev = next(model.parameters()).device
    adapter = adapter_for(model)
    cache = RowCache(model.config.text_config.num_hidden_layers)
    cache.ensure(1, 64)
    eager = RowForward(lambda mask, ids, pos: adapter.forward(cache=cache, attention_mask=mask, position_ids=pos,
                                                              input_ids=ids), cache, "target")
    runner = StepRunner(eager, mode=mode, name="step")
    ids = torch.randint(5, VOCAB, (1, 14), generator=torch.Generator().manual_seed(4)).to(dev)
    L = 8

    def run(start, n):
        committed = torch.full((1,), start, dtype=torch.long, device=dev)
        mask = rows_mask(committed, 64, causal(n, dev))
        pos = torch.arange(start, start + n, device=dev)[None]
        return runner(write=committed, mask=mask, ids=ids[:, start:start + n], pos=pos)

    committed0 = torch.zeros(1, dtype=torch.long, device=dev)
    eager(write=committed0, mask=rows_mask(committed0, 64, causal(L, dev)), ids=ids[:, :L],
          pos=torch.arange(L, device=dev)[None])  # prefill, eagerly
    calls = {"n": 0}

    def fail_once(module, args):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")

    hook = model.model.language_model.get_submodule(where).register_forward_pre_hook(fail_once)
    try:
        with pytest.warns(RuntimeWarning, match="running it eagerly"):
            first = run(L, 3).clone()
    finally:
        hook.remove()
    assert calls["n"] > fail_at and runner.failed  # the capture did fail part-way (then ran eagerly)
    second = run(L + 3, 3)
    full = model(input_ids=ids[:, :L + 6]).logits  # [1, L + 6, V]
    tol = {} if mode == "emulate" else dict(atol=1e-4, rtol=1e-4)  # float32 on a GPU: other kernels
    torch.testing.assert_close(torch.cat([first, second], 1), full[:, L:L + 6], **tol)


@cuda
@pytest.mark.parametrize("kw", [dict(), dict(tree="dynamic"), dict(tree=[[0], [1], [0, 0], [0, 1], [1, 0]])])
@pytest.mark.parametrize("method", ["M", "MTC"])
def test_cuda_graphs_match_target_on_gpu(kw, method, tok):
    target = make_llava(0, dtype=torch.float32).cuda()
    draft = noisy_copy(target, 1)
    for n_images in (1, 2):
        ids, pv = make_prompt(n_images, 16, seed=n_images)
        ids, pv = ids.cuda(), pv.float().cuda()
        ref = reference(target, ids, pv, 24)
        eager = SpecDecoder(target, draft, tok, views=method, captioner=captions(n_images), cuda_graphs=False, **kw)
        graphs = SpecDecoder(target, draft, tok, views=method, captioner=captions(n_images), cuda_graphs=True, **kw)
        assert graphs.engine == "cuda-graphs"
        assert eager.generate(ids, pv, max_new_tokens=24).token_ids == ref
        for _ in range(2):
            res = graphs.generate(ids, pv, max_new_tokens=24)
            assert res.token_ids == ref
        assert res.stats.capture_s == 0.0  # the second call replayed what the first captured
        assert not engine_of(graphs).graphs_failed


@cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["in turn", "overlapped"])
@pytest.mark.parametrize("kw, n_requests", [(dict(tree="dynamic"), 1), (dict(temperature=0.8), 4)],
                         ids=["greedy tree, one request", "sampling chain, a batch"])
def test_one_host_sync_per_step_on_gpu(tok, monkeypatch, kw, n_requests, overlap):
    """On a GPU every engine step (its graph's replay) synchronises with the host exactly once:
    its packed read, an event waited on after the outcomes' copy into pinned memory. Nothing in a
    launch or a read synchronises otherwise (CUDA's sync debug mode counts the rest; it does not
    see an event's wait, counted apart). Admission, prefills and the results' timing read values
    outside the steps."""
    from mmspec.engine.step import Engine

    target = make_llava(0, dtype=torch.float32).cuda()
    draft = noisy_copy(target, 1)
    temperature = kw.pop("temperature", 0.0)
    dec = SpecDecoder(target, draft, tok, views="M", cuda_graphs=True, **kw)
    reqs = []
    for i in range(n_requests):
        ids, pv = make_prompt(1, 16, seed=3 + i)
        reqs.append(dict(input_ids=ids.cuda(), pixel_values=pv.float().cuda(), max_new_tokens=32,
                         temperature=temperature, seed=i))
    ref = [r.token_ids for r in dec.generate_batch(reqs, overlap=False)]  # captures
    flagged, waits, launches, reads, inside = [], [], [], [], []
    event_sync = torch.cuda.Event.synchronize

    def counting(method, calls):
        orig = getattr(Engine, method)

        def counted(self, *a, **k):
            torch.cuda.set_sync_debug_mode("warn")
            inside.append(method)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = orig(self, *a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                inside.pop()
            flagged.append(sum("synchroniz" in str(w.message) for w in caught))
            calls.append(1)
            return out
        monkeypatch.setattr(Engine, method, counted)

    counting("launch", launches)
    counting("finish", reads)
    monkeypatch.setattr(torch.cuda.Event, "synchronize",
                        lambda ev: (inside and waits.append(1), event_sync(ev))[1])  # waits inside a step
    assert [r.token_ids for r in dec.generate_batch(reqs, overlap=overlap)] == ref
    assert launches and len(reads) == len(launches) == len(waits), (len(launches), len(reads), len(waits))
    assert not any(flagged), flagged
    assert not engine_of(dec).graphs_failed


@pytest.mark.parametrize("kw", [dict(), dict(tree="dynamic")])
def test_target_dispatched_by_accelerate_device_map(target, draft_shared, tok, tmp_path, kw):
    """A target loaded with device_map="auto" (accelerate's dispatch; here half its layers are
    offloaded to disk, so its hooks load them at each forward) decodes exactly like the target."""
    pytest.importorskip("accelerate")
    from transformers import LlavaForConditionalGeneration

    target.save_pretrained(tmp_path / "t")
    size = sum(p.numel() * p.element_size() for p in target.parameters())
    dispatched = LlavaForConditionalGeneration.from_pretrained(
        tmp_path / "t", device_map="auto", max_memory={"cpu": size // 2}, offload_folder=str(tmp_path / "off"),
        dtype=torch.float64)
    assert {"cpu", "disk"} <= set(dispatched.hf_device_map.values())
    ids, pv = make_prompt(2, 16, seed=23)
    dec = SpecDecoder(dispatched, draft_shared, tok, views="MT", **kw)
    assert dec.engine == "eager" and dec.target.device == torch.device("cpu")
    assert dec.generate(ids, pv, max_new_tokens=16).token_ids == reference(target, ids, pv, 16)
