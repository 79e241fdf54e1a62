"""Fixed-shape decode forwards, run eagerly or captured once as CUDA graphs and replayed.

At 7B shapes an eager decode step is launch-bound: Python and ~1,000 kernel launches per step
cost 5.8x the memory-bandwidth floor (docs/perf.md §5). A CUDA graph replays the same kernels
with one launch. A graph fixes every address and shape, so the forwards it captures run on the
engine's fixed buffers (:class:`~mmspec.models.rows.RowCache`: each row's write slots a device
tensor, attention over a bucket of slots under a 4-D mask) and read their inputs from buffers
this module owns: per input shape ``(rows, new tokens, span)`` one graph, captured on first use
(after two warm-up runs on a side stream) or before traffic (:meth:`StepRunner.prepare`, from
:mod:`mmspec.engine.warmup`) and replayed for every later call of the same shape, for as long as
its :class:`StepRunner` lives; every graph of an engine in one :class:`GraphPool`.

Why explicit ``torch.cuda.CUDAGraph`` capture rather than ``torch.compile(mode="reduce-overhead")``:
measured in ``perf/gpu_shapes.py`` (docs/perf.md, "GPU path"); the short version is that
capture costs milliseconds per shape where compiling costs tens of seconds per shape, and the
engine needs a graph per verify size and per draft row count.

Modes: ``"eager"`` (no capture), ``"cuda"`` (capture), ``"emulate"`` (CPU tests: the same
buffer and cursor bookkeeping; the capture runs the forward's Python side once, as a CUDA capture
does, and each replay re-runs it). Anything that fails to capture falls back to eager with one
clear warning: the tokens are the same, only slower. :class:`StaticPool` keeps a decoder's engine
(buffers and graphs) across calls.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmspec import config
from mmspec.errors import MMSpecError

MODES = ("eager", "cuda", "emulate")
MIN_CAPACITY = 512  # the smallest static cache, in positions
MAX_LOGPROBS = config.MAX_LOGPROBS  # the most log-probability alternatives an engine serves by default (the config's)


def canonical_flags(flags: dict) -> dict:
    """A step's sampling flags (:func:`mmspec.runtime.verify.flags`) as one of two sets, so that graphs
    are few and can be captured before traffic: every flag off (greedy rows only), or the
    general path (every filter on, greedy and sampling verification both run: ``all_sampling``
    off; the coupling's and rejection sampling's both, ``all_coupled`` off). The general path gives each row exactly the bits its own flags give it: a greedy row's
    outcome is selected from the greedy verification, a filter a row does not use (top-k 0,
    top-p 1, a temperature above float32's tiny) leaves its logits as they were, and the random
    draws come from the row's own stream whatever its neighbours (tests/core/test_graph_warmup.py)."""
    if not flags.get("any_sampling"):
        return {k: False for k in flags}
    return {k: k not in ("all_sampling", "all_coupled") for k in flags}  # coupled and rejection rows both


def bucket(n: int) -> int:
    """The shape bucket of ``n`` rows or new tokens: the next power of two (1, 2, 4, 8, ...), as
    vLLM and SGLang capture a few batch sizes and pad to the next one."""
    return 1 << max(0, int(n) - 1).bit_length()


def capacity_bucket(needed: int) -> int:
    """A static cache's positions for ``needed``: a power of two, at least :data:`MIN_CAPACITY`."""
    return max(MIN_CAPACITY, bucket(needed))


class GraphPool:
    """The memory pool the CUDA graphs of one engine are captured into (its target's and its
    drafter's, every bucket), alive as long as any of its graphs: captures share one pool, and
    once every graph of it has been dropped (their buffers were reallocated) the next capture
    opens a fresh one. Capturing into a pool whose graphs are all gone is what made the CUDA
    caching allocator assert (``use_count > 0``) after a static cache grew; the emulated pool of
    the CPU tests refuses it the same way, so the CPU tests see that defect too."""

    def __init__(self, mode: str):
        self.mode = mode
        self.handle = None  # torch.cuda.graph_pool_handle(), or an _EmulatedPool
        self.graphs = 0  # live graphs captured into it

    def acquire(self):
        """The handle to capture one more graph into."""
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle() if self.mode == "cuda" else _EmulatedPool()
        if isinstance(self.handle, _EmulatedPool):
            self.handle.use()
        self.graphs += 1
        return self.handle

    def release(self, n: int) -> None:
        """``n`` graphs of this pool were dropped; with the last one the pool goes."""
        self.graphs -= n
        if isinstance(self.handle, _EmulatedPool):
            self.handle.drop(n)
        if self.graphs <= 0:
            self.graphs, self.handle = 0, None


class _EmulatedPool:
    """A CUDA graph pool's lifetime as the caching allocator keeps it: graphs hold it; capturing
    into it once it was emptied is the allocator's internal assert."""

    def __init__(self):
        self.count = 0
        self.emptied = False

    def use(self) -> None:
        if self.emptied:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp "
                               "(emulated): a capture into a graph pool whose graphs were all freed")
        self.count += 1

    def drop(self, n: int) -> None:
        self.count -= n
        if self.count <= 0:
            self.emptied = True


@dataclass
class _Graph:
    inputs: dict[str, torch.Tensor]  # input buffers, by keyword
    outputs: object = None  # what the captured call returned (a tensor or a tuple of them): rewritten by each replay
    graph: object = None  # torch.cuda.CUDAGraph in "cuda" mode


class StepRunner:
    """Runs one model's decode forwards on fixed buffers: ``runner(**inputs) -> outputs``,
    where ``fn(**inputs)`` is the eager forward (it writes the cache at the device slots its
    inputs name) and returns a tensor or a tuple of tensors, e.g. ``ids=[B, n], pos=[B, n], mask=[B, 1, n,
    capacity]`` -> logits [B, n, V]. The outputs of a replay live in the graph's memory: read
    them before the next call. A forward on the engine's :class:`~mmspec.models.rows.RowCache`
    leaves no host state (its rows' lengths are the engine's to set), so the runner keeps none."""

    def __init__(self, fn: Callable[..., object], mode: str = "eager", name: str = "model",
                 warmup: int = 2, pool=None, keep: Callable[[], Callable[[], None]] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.fn, self.mode, self.name = fn, mode, name
        self.warmup = warmup
        self.pool = pool if pool is not None else GraphPool(mode)
        self.keep = keep  # snapshots the state fn writes (a whole step); -> the function that restores it
        self.on_failure: Callable[[str], None] | None = None
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: str | None = None  # why capture was given up, if it was
        self.capture_s = 0.0  # time spent warming up and capturing (first calls of each shape)
        self.captures = 0  # captures attempted (a warm-up's, then any first use after it)

    def __call__(self, **inputs: torch.Tensor):
        if self.mode == "eager" or self.failed:
            return self.fn(**inputs)
        g = self._graph(inputs)
        if g is None:  # capture failed: eager from now on
            return self.fn(**inputs)
        for k, v in inputs.items():
            g.inputs[k].copy_(v)
        if self.mode == "cuda":
            g.graph.replay()  # writes K/V at the device cursor and advances it
        else:
            self._replay_emulated(g)
        return g.outputs

    def prepare(self, **inputs: torch.Tensor) -> bool:
        """Capture the graph of these inputs' shapes now, replaying nothing (a warm-up before
        traffic: the state is left as it was). -> whether a graph was captured."""
        if self.mode == "eager" or self.failed or _key(inputs) in self.graphs:
            return False
        return self._graph(inputs) is not None

    def _graph(self, inputs: dict[str, torch.Tensor]) -> _Graph | None:
        """The graph of these inputs' shapes, captured on first use (None: capture failed, said once)."""
        key = _key(inputs)
        g = self.graphs.get(key)
        if g is not None:
            return g
        self.captures += 1
        t0 = time.perf_counter()
        try:
            g = self._capture(inputs)
        except Exception as e:  # noqa: BLE001 - any capture failure: say it once, run eagerly
            self.failed = f"{type(e).__name__}: {str(e)[:200]}"
            if self.on_failure is not None:
                self.on_failure(self.failed)
            warnings.warn(f"mmspec: could not capture the {self.name}'s decode step as a CUDA graph "
                          f"({self.failed}); running it eagerly instead (same tokens, slower)",
                          RuntimeWarning, stacklevel=3)
            return None
        finally:
            self.capture_s += time.perf_counter() - t0
        self.graphs[key] = g
        return g

    def reset(self) -> None:
        """Drop every captured graph (the buffers they were captured on were reallocated)."""
        self.pool.release(len(self.graphs))
        self.graphs.clear()

    def _replay_emulated(self, g: _Graph) -> None:
        """Run the forward on the graph's buffers and write its results INTO the outputs of the
        capture, as a replay does (so a caller that kept an output past the next call reads it
        overwritten here too)."""
        out = self.fn(**g.inputs)
        for mine, new in zip(_tensors(g.outputs), _tensors(out)):
            mine.copy_(new)

    def _capture(self, inputs: dict[str, torch.Tensor]) -> _Graph:
        """Warm up and capture ``fn`` on fresh input buffers. Whatever happens, the state ``keep``
        names is left as it was found: a capture executes nothing, and an attempt that fails
        part-way has still run some of it, which the eager fallback must not inherit."""
        g = _Graph(inputs={k: v.clone() for k, v in inputs.items()})
        restore = self.keep() if self.keep is not None else None
        try:
            if self.mode == "emulate":  # the CPU stand-in: the capture's one run of the Python side
                self.pool.acquire()
                try:
                    g.outputs = self.fn(**g.inputs)
                except BaseException:
                    self.pool.release(1)
                    raise
                g.graph = "emulated"
            else:
                g.graph, g.outputs = self._capture_cuda(g.inputs)
        finally:
            if restore is not None:  # the capture's runs wrote state the replay writes again
                restore()
        return g

    def _capture_cuda(self, buffers: dict[str, torch.Tensor]) -> tuple[object, object]:
        dev = next(iter(buffers.values())).device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):  # kernels choose their algorithms outside the capture
                    restore = self.keep() if self.keep is not None else None
                    self.fn(**buffers)
                    if restore is not None:
                        restore()
        finally:  # the eager fallback must not race a warm-up that is still running on the side stream
            torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        handle = self.pool.acquire()
        try:
            with torch.cuda.graph(graph, pool=handle):
                outputs = self.fn(**buffers)
        except BaseException:
            self.pool.release(1)
            raise
        return graph, outputs


def _key(inputs: dict[str, torch.Tensor]) -> tuple:
    """A graph's key: its inputs' names, shapes and dtypes."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(inputs.items()))


def _nobody() -> None:
    """A lease's holder reference once the holder gave it back."""
    return None


def _tensors(out) -> list[torch.Tensor]:
    """A forward's outputs (a tensor, or a tuple / list of them, possibly nested) as a flat list."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)]


class StaticPool:
    """What a decoder on static caches / CUDA graphs keeps across calls: its engine (the static
    buffers and every graph captured on them), leased to one scheduler at a time."""

    def __init__(self, mode: str):
        self.mode = mode  # a MODES entry, for every runner
        self.leased: dict[str, tuple[object, object]] = {}  # role -> (an engine, weakref to its holder)

    def lease(self, role: str, holder: object, make: Callable[[], object]) -> object:
        """The static ``role`` object (``make()``: the engine, its buffers and graphs) kept across
        schedulers, so the next ``generate`` or ``generate_batch`` reuses the buffers and the graphs
        captured on them. One holder at a time: while another live holder has it, ``make()`` gives
        a fresh one of its own."""
        entry = self.leased.get(role)
        if entry is not None:
            kept, ref = entry
            other = ref()
            if other is None or other is holder:
                self.leased[role] = (kept, weakref.ref(holder))
                return kept
            return make()
        kept = make()
        self.leased[role] = (kept, weakref.ref(holder))
        return kept

    def give_back(self, holder: object) -> None:
        """``holder`` is done with what it leased: the next holder gets it (its buffers and graphs),
        even while ``holder`` itself is still referenced (a server renewing its scheduler)."""
        for role, (kept, ref) in list(self.leased.items()):
            if ref() is holder:
                self.leased[role] = (kept, _nobody)


def graph_mode(requested, *devices: torch.device) -> str:
    """``cuda_graphs`` of :class:`~mmspec.SpecDecoder` -> a :data:`MODES` entry.

    "auto": "cuda" when every model sits on one and the same CUDA device, else "eager".
    True: "cuda", refused without CUDA. False: "eager". "emulate": tests.
    """
    if requested == "emulate":
        return "emulate"
    if requested is False or requested is None:
        return "eager"
    on_cuda = all(d.type == "cuda" for d in devices) and len({str(d) for d in devices}) == 1
    if requested == "auto":
        return "cuda" if on_cuda else "eager"
    if requested is True:
        if not on_cuda:
            raise MMSpecError(f"cuda_graphs=True needs the target and draft on one CUDA device, they are on "
                              f"{sorted({str(d) for d in devices})}; use cuda_graphs='auto' or False")
        return "cuda"
    raise MMSpecError(f"cuda_graphs must be 'auto', True or False, got {requested!r}")
