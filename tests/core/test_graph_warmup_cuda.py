"""On a GPU (skipped without CUDA): the warm-up's CUDA graphs cover a mixed workload (no capture
after it, every output the eager decoder's on the same device), and a step allocates no pinned
memory after the warm-up (the outcome ring and the staging slots are reused). The CPU twins:
test_graph_warmup.py (emulated capture) and the ring's bookkeeping below, which runs anywhere."""

import pytest
import torch

from helpers.reference import engine_of
from helpers.tiny import make_llava, make_prompt, make_tokenizer, noisy_copy
from mmspec import SpecDecoder
from mmspec.batch import BatchScheduler
from mmspec.engine.warmup import captures
from mmspec.runtime import pinned
from mmspec.runtime.pinned import PinnedRing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def models():
    dev = torch.device("cuda")
    target = make_llava(0).to(dev)
    return target, noisy_copy(target, 1).to(dev), make_tokenizer()


def request(i, max_new, text_len=5, **kw):
    ids, pv = make_prompt(1, 16, seed=40 + i, text_len=text_len)
    return dict(input_ids=ids, pixel_values=pv, max_new_tokens=max_new, **kw)


REQS = [request(0, 24, text_len=245), request(1, 10, temperature=0.9, top_p=0.95, seed=3, logprobs=2),
        request(2, 6, logprobs=4), request(3, 12, temperature=1.1, top_k=5, seed=6)]


def run(dec, reqs, max_batch, speculate, during=None):
    sched = BatchScheduler(dec, max_batch=max_batch, speculate=speculate, stream_text=False)
    rids = [sched.submit(r) for r in reqs]
    done = {}
    while sched.has_work():
        if during is not None:
            with during():
                events = sched.step()
        else:
            events = sched.step()
        for ev in events:
            assert ev.error is None, ev.error
            if ev.finished:
                done[ev.rid] = ev.result
    sched.close()
    return [done[r] for r in rids]


@cuda
@pytest.mark.parametrize("speculate", ["always", "auto"])
def test_no_capture_after_warm_up_on_a_gpu(models, speculate):
    target, draft, tok = models
    dec = SpecDecoder(target, draft, tok, views="M", gamma=2, cuda_graphs=True)
    w = dec.warm_up(max_batch=2, speculate=speculate, max_context=600)
    engine = engine_of(dec)
    assert w.captured > 0 and engine.graphs_failed is None
    tried = captures(engine)
    got = run(dec, REQS, 2, speculate)
    assert captures(engine) == tried and engine.graphs_failed is None
    want = run(SpecDecoder(target, draft, tok, views="M", gamma=2, cuda_graphs=False), REQS, 2, speculate)
    for r, g, e in zip(REQS, got, want):
        if speculate == "always" or "temperature" not in r:  # auto: a seeded row's draws follow the policy's choices
            assert g.token_ids == e.token_ids
        if r.get("logprobs") is not None:
            assert all(len(t.top) == r["logprobs"] for t in g.logprobs)


class _PinCount:
    """Counts pinned allocations (torch.empty / zeros with pin_memory=True, Tensor.pin_memory)."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.on = False
        for name in ("empty", "zeros"):
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, self._wrap(real))
        real_pin = torch.Tensor.pin_memory

        def pin(t, *a, **kw):
            self.n += self.on
            return real_pin(t, *a, **kw)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)

    def _wrap(self, real):
        def f(*a, **kw):
            self.n += self.on and bool(kw.get("pin_memory"))
            return real(*a, **kw)
        return f

    def __call__(self):
        counter = self

        class During:
            def __enter__(self):
                counter.on = True

            def __exit__(self, *exc):
                counter.on = False
        return During()


@cuda
def test_no_pinned_allocation_per_step_after_warm_up(models, monkeypatch):
    target, draft, tok = models
    dec = SpecDecoder(target, draft, tok, views="M", gamma=2, cuda_graphs=True)
    dec.warm_up(max_batch=2, speculate="always", max_context=600)
    count = _PinCount(monkeypatch)
    run(dec, REQS, 2, "always", during=count)  # admissions, steps and reads, overlapped
    assert count.n == 0


def test_the_outcome_ring_alternates_and_grows_by_bucket(monkeypatch):
    """The ring's bookkeeping (pinned memory replaced by plain memory, so it runs on the CPU): two
    slots taken in turn, a slot reused (no allocation) while it fits, grown to a bucket when not."""
    monkeypatch.setattr(pinned, "_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    ring = PinnedRing(2)
    ring.reserve(8 * 10)
    assert ring.allocations == 2
    a, b, c = ring.take((8, 10), torch.long), ring.take((3, 10), torch.long), ring.take((5, 9), torch.long)
    assert ring.allocations == 2 and a.is_contiguous() and c.shape == (5, 9)
    assert a.data_ptr() == c.data_ptr() != b.data_ptr()  # slot 0, slot 1, slot 0 again
    assert ring.buffers[1].numel() == 128  # 80 elements reserved: a bucket of them
    ring.take((13, 10), torch.long)  # slot 1 grown: 130 -> 256 elements
    assert ring.allocations == 3 and ring.buffers[1].numel() == 256


class _FakeEvent:
    """A CUDA event stand-in: done once the test says so."""

    def __init__(self):
        self.done, self.waited = True, 0

    def record(self, stream=None):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_staging_reuses_free_slots_and_waits_only_when_all_are_busy(monkeypatch):
    """The staging slots' bookkeeping on the CPU (plain memory, fake events): a slot whose copy is
    done is reused (no allocation), a busy one never is (a new slot instead, up to STAGING_SLOTS),
    then the least recently used is waited for; each staged tensor arrives whole."""
    monkeypatch.setattr(pinned, "_pinned", lambda numel, dtype: torch.empty(numel, dtype=dtype))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    st, cpu = pinned.PinnedStaging(), torch.device("cpu")
    st.reserve(2, 64)
    assert st.allocations == 2
    x = torch.arange(6).view(2, 3)
    assert torch.equal(st.stage(x, cpu), x) and torch.equal(st.stage(x.double(), cpu), x.double())
    assert st.allocations == 2  # two free slots, both used; both copies now in flight
    st.stage(x, cpu)
    assert st.allocations == 3  # every slot busy: a new one, the busy ones untouched
    for s in st.slots:
        s[1].done = True
    for _ in range(5):
        st.stage(x, cpu)
        for s in st.slots:
            s[1].done = True
    assert st.allocations == 3  # copies done: slots reused
    for i in range(pinned.STAGING_SLOTS + 2):
        assert torch.equal(st.stage(x + i, cpu), x + i)
    assert len(st.slots) == pinned.STAGING_SLOTS and st.allocations == pinned.STAGING_SLOTS
    assert sum(s[1].waited for s in st.slots) == 2  # past the bound: the oldest copy waited for, twice
    big = torch.arange(1000, dtype=torch.float64)  # 8,000 bytes: past a 4 KiB slot
    for s in st.slots:
        s[1].done = True
    assert torch.equal(st.stage(big, cpu), big) and st.allocations == pinned.STAGING_SLOTS + 1  # a free slot grown
