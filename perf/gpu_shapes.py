"""Latency of real-shaped models on a GPU, and mmspec's engine end to end at those shapes.

Owns: building randomly initialised LLaVA models with REAL shapes from configs (decode latency
does not depend on weight values), and timing on them, through mmspec's own decode path
(:class:`~mmspec.models.rows.RowCache` + :class:`~mmspec.runtime.graphs.StepRunner`):

- T_p (target one-token decode) against the memory-bandwidth floor: bytes the decode must read
  (LM weights + lm_head, plus the KV cache) / measured device-to-device copy bandwidth;
- T_q / T_p (draft one-token decode), T_V(gamma) / T_p (target forward over gamma + 1 tokens)
  and T_V(tree of N nodes) / T_p (N tokens under a tree mask);
- draft step latency for batch 1..8 (IbED Fig. 9: a batch of views costs the draft almost
  nothing extra because decode is memory-bound);

each in mode ``eager`` (the engine's eager path: its rows, attention over the filled slots) and
``graph`` (the engine's GPU path: attention over the whole buffer under the mask, captured as a
CUDA graph per shape). ``--compile`` also times T_p side by side without and with ``torch.compile``, each
compile mode with its compile time (``--compile-modes``): ``engine``, what ``SpecDecoder(compile=True)``
does (the forward compiled in mode "default", inductor's kernels captured by mmspec's own graph),
per-layer compilation, and ``reduce-overhead`` (torch's own CUDA graphs); and adds a
``chain+compile`` row to every engine run beside the uncompiled chain (its step time and compile
seconds).

``--engine`` then runs :class:`mmspec.SpecDecoder` itself at these shapes. Random models
never agree, so the pair is built to: every layer's output projections are zeroed (the
residual stream is the token embedding), the draft's embedding and LM head are copied into
the target's first 768 dimensions, so the target's logits are the draft's times a constant;
``--engine-noise`` perturbs the draft's head to lower the acceptance. The forwards cost what
real ones cost. Reported: tau, decode-only tokens/s of the target alone and of mmspec (eager
and graphs, chain and tree), and the engine efficiency: measured speed-up over the same-mode
target divided by IbED eq. 2's prediction from the measured T_p, T_q, T_V at the measured tau.

Shapes: target = LLaVA-1.5-7B (CLIP ViT-L/14-336, Llama-2-7B LM: hidden 4096, 32 layers, 32
heads, intermediate 11008, vocab 32064); draft = LLaVA-68M-shaped (Llama hidden 768, 2 layers,
12 heads, intermediate 3072, same vocab and vision tower). ``--small`` swaps in tiny configs in
float32 so the same code path runs on CPU in seconds (tests; graphs are emulated there).

Results are written (``gpu_shapes.json`` / ``.md``) after each section and each engine run; a
section that raises (an out-of-memory capacity, a failed compile) is recorded under ``errors``
and the run goes on to the next (exit status 3).

Run ``python perf/gpu_shapes.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mmspec.provenance import machine_info, now
from mmspec.timing import median_time, sync

IMAGE_TOKEN = 32000  # llava-hf/llava-1.5-7b-hf


@dataclass
class ShapesConfig:
    """One run; the CLI only maps flags onto these fields."""

    small: bool = False  # tiny configs (CPU tests); default: real 7B / 68M shapes
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # default: bfloat16 on cuda, float32 otherwise
    context: int = 640  # tokens already in the KV cache (one 576-token image + text)
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    trees: tuple[int, ...] = (16, 32, 64)  # T_V over a tree of N nodes
    batches: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    repeats: int = 30
    warmup: int = 3
    modes: tuple[str, ...] = ("eager", "graph")
    compile: bool = False  # also T_p and the engine with torch.compile (minutes of compiling at 7B)
    compile_modes: tuple[str, ...] = ("engine", "layers+mmspec-graph", "reduce-overhead")
    capacities: tuple[int, ...] = ()  # T_p (graph) with the same context in caches this large
    kernels: bool = False  # a profiler's kernel table of one eager T_p step
    engine: bool = True  # SpecDecoder end to end at these shapes
    engine_modes: tuple[str, ...] = ()  # modes of the engine runs (empty: those of ``modes``)
    engine_gamma: int = 5
    engine_new_tokens: int = 128
    engine_noise: tuple[float, ...] = (0.0, 0.5)  # draft-head perturbations (0: always agree)
    engine_repeats: int = 3
    copy_mib: int = 1024  # buffer for the bandwidth probe
    out: str = "runs/gpu_shapes"
    command: str = ""


# --------------------------------------------------------------------------- model shapes
def llava_config(small: bool, role: str):
    """LlavaConfig of the target ("target") or the draft ("draft"); real or tiny shapes."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    if small:
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8, projection_dim=32)
        h, layers, heads, inter, vocab = (64, 2, 4, 128, 160) if role == "target" else (32, 1, 4, 64, 160)
        image_token, n_img = 150, 16
    else:
        vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                  num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
        h, layers, heads, inter, vocab = (4096, 32, 32, 11008, 32064) if role == "target" else (768, 2, 12, 3072, 32064)
        image_token, n_img = IMAGE_TOKEN, 576
    text = LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-5)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                      projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=n_img)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(cfg, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Random-initialised model created directly on ``device`` (no CPU copy of 7B weights)."""
    from transformers import LlavaForConditionalGeneration

    with torch.device(device):
        model = LlavaForConditionalGeneration._from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None  # random text: never stop early
    return model.eval()


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must read: LM + lm_head weights (one embedding row is negligible)."""
    emb = model.get_input_embeddings().weight
    lm = model.model.language_model
    n = sum(p.numel() * p.element_size() for p in lm.parameters() if p is not emb)
    head = model.get_output_embeddings().weight
    return n + (0 if head is emb else head.numel() * head.element_size())


def kv_bytes(cfg, context: int, batch: int, dtype: torch.dtype) -> int:
    t = cfg.text_config
    head_dim = t.hidden_size // t.num_attention_heads
    return 2 * t.num_hidden_layers * context * batch * t.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


# --------------------------------------------------------------------------- timing
def copy_bandwidth(device: torch.device, mib: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device, repeats, 2)
    return 2 * n / t


def random_tree(n: int, depth: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [n] (parents first, root -1) and depth [n] of a random tree at most ``depth`` deep."""
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for i in range(1, n):
        while True:
            p = int(torch.randint(0, i, (1,), generator=g))
            if depths[p] < depth:
                break
        parents.append(p)
        depths.append(depths[p] + 1)
    order = sorted(range(n), key=lambda i: (depths[i], i))
    inv = {o: k for k, o in enumerate(order)}
    return (torch.tensor([-1 if parents[o] < 0 else inv[parents[o]] for o in order]),
            torch.tensor([depths[o] for o in order]))


def _graph_mode(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "emulate"


def tree_attention_mask(anc: torch.Tensor, past: int, total: int) -> torch.Tensor:
    """The target's 4-D mask for verifying a tree of N nodes written at slots past..past+N-1 of a
    cache whose attention spans ``total`` slots: [1, 1, N, total] bool, True = attend."""
    n = anc.shape[0]
    mask = torch.zeros(1, 1, n, total, dtype=torch.bool, device=anc.device)
    mask[..., :past] = True
    mask[0, 0, :, past:past + n] = anc
    return mask


class _Probe:
    """One model prefilled with ``context`` random tokens on mmspec's cache, and steps over it."""

    def __init__(self, model, batch: int, context: int, room: int, mode: str, capacity: int = 0):
        from mmspec.models.base import adapter_for
        from mmspec.models.rows import RowCache
        from mmspec.runtime.graphs import StepRunner

        self.model, self.batch, self.context, self.mode = model, batch, context, mode
        self.adapter = adapter_for(model)
        dev = self.adapter.device
        self.static = mode != "eager"  # attention over the whole buffer (fixed shapes), else the filled slots
        self.capacity = max(context + room, capacity)
        self.cache = RowCache(model.config.text_config.num_hidden_layers)
        self.cache.ensure(batch, self.capacity)
        hi = min(model.config.text_config.vocab_size, model.config.image_token_index)
        g = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(5, hi, (batch, context), generator=g).to(dev)
        self.tokens = torch.randint(5, hi, (batch, room), generator=g).to(dev)
        pos = torch.arange(context, device=dev)[None].expand(batch, -1)
        span = self.capacity if self.static else context
        mask = torch.ones(context, span, dtype=torch.bool, device=dev).tril()[None, None].expand(batch, 1, -1, -1)
        with torch.inference_mode():
            self.cache.begin(0, torch.zeros(batch, dtype=torch.long, device=dev), span)
            self.adapter.forward(cache=self.cache, attention_mask=mask, position_ids=pos, input_ids=self.prompt,
                                 logits_to_keep=1)
        adapter, cache = self.adapter, self.cache

        def fn(ids, pos, mask):
            # each row writes from the slot of its first position (a run's or a tree's root), over the mask's span
            cache.begin(0, pos[:, 0], mask.shape[-1])
            return adapter.forward(cache=cache, attention_mask=mask, position_ids=pos, input_ids=ids)
        self.runner = StepRunner(fn, mode=_graph_mode(dev) if mode == "graph" else "eager")

    def step_fn(self, n: int, parents: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> Callable:
        """A step over n new tokens (a causal run, or a tree given parents/depth) at slots
        context .. context + n - 1, every repeat (the rows keep no length to rewind)."""
        from mmspec.drafting.tree import ancestors

        dev, B, C = self.adapter.device, self.batch, self.context
        if parents is None:
            parents, depth = torch.arange(n) - 1, torch.arange(n)
        anc = ancestors(parents.to(dev), int(depth.max()))
        span = self.capacity if self.static else C + n
        mask = tree_attention_mask(anc, C, span).expand(B, -1, -1, -1).contiguous()
        pos = (C + depth.to(dev))[None].expand(B, -1).contiguous()
        ids = self.tokens[:, :n].contiguous()

        def step():
            return self.runner(ids=ids, pos=pos, mask=mask)
        return step


def step_time(probe: _Probe, n: int, repeats: int, warmup: int, parents=None, depth=None) -> dict:
    with torch.inference_mode():
        step = probe.step_fn(n, parents, depth)
        s = median_time(step, probe.adapter.device, repeats, warmup)
    r = probe.runner
    return {"s": s, "graph": r.mode == "cuda" and not r.failed, **({"graph_error": r.failed} if r.failed else {})}


@torch.inference_mode()
def graph_vs_eager(model, context: int, n: int) -> float:
    """Max |logit difference| between the graph path (replayed twice: checks the rewind) and eager."""
    ref = _Probe(model, 2, context, n + 4, "eager").step_fn(n)().float()
    step = _Probe(model, 2, context, n + 4, "graph").step_fn(n)
    step()
    return float((step().float() - ref).abs().max())


COMPILE_MODES = ("engine", "layers+mmspec-graph", "reduce-overhead")


def compile_times(model, context: int, repeats: int, warmup: int, modes: Sequence[str]) -> dict:
    """T_p with torch.compile beside the same probe uncompiled (``plain_s``, mmspec's graph),
    each with its compile (first calls) time:

    - ``engine``: ``SpecDecoder(compile=True)``'s path: the forward through the engine's
      :class:`~mmspec.runtime.forwards.Compiler` (mode "default": inductor fuses norms, rotary,
      casts), captured by mmspec's graph;
    - ``layers+mmspec-graph``: each decoder layer compiled (default mode; one compilation shared
      by the layers), the step captured by mmspec's graph;
    - ``reduce-overhead``: the whole model compiled with torch's own CUDA graphs.
    """
    from mmspec.runtime.forwards import Compiler

    out = {}
    for name in modes:
        if name not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {name!r}; one of {COMPILE_MODES}")
        layers = model.model.language_model.layers
        try:
            torch._dynamo.reset()
            probe = _Probe(model, 1, context, 8, "static" if name == "reduce-overhead" else "graph")
            with torch.inference_mode():
                plain = median_time(probe.step_fn(1), probe.adapter.device, repeats, warmup)
            probe = _Probe(model, 1, context, 8, "static" if name == "reduce-overhead" else "graph")
            compiler = None
            if name == "engine":
                compiler = Compiler()
                probe.runner.fn = compiler.wrap(probe.runner.fn, "target")
            elif name.startswith("layers"):
                for layer in layers:
                    layer.compile(dynamic=False)
            else:
                probe.adapter.model = torch.compile(model, mode="reduce-overhead", dynamic=False)
            step = probe.step_fn(1)
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(3):
                    step()
                sync(probe.adapter.device)
                first = time.perf_counter() - t0
                s = median_time(step, probe.adapter.device, repeats, warmup)
            out[name] = {"s": s, "plain_s": plain, "speedup": plain / s, "compile_and_first_calls_s": first}
            if compiler is not None:
                out[name] |= {"compile_s": compiler.compile_s, "fell_back": compiler.failed}
        except Exception as e:  # noqa: BLE001 - report what failed, keep the run
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            for layer in layers:  # undo Module.compile
                layer._compiled_call_impl = None
    torch._dynamo.reset()
    return out


@torch.inference_mode()
def kernel_table(model, context: int, top: int = 25) -> dict:
    """The device kernels of one eager T_p step (torch.profiler, 3 steps averaged): count and
    microseconds per kernel name, and their sum, which a captured graph cannot beat. On the CPU
    (dry runs): the aten ops and their self time instead."""
    from torch.profiler import ProfilerActivity, profile

    probe = _Probe(model, 1, context, 4, "eager")
    step = probe.step_fn(1)
    for _ in range(3):
        step()
    dev = probe.adapter.device
    sync(dev)
    steps = 3
    on_cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    agg: dict[str, list[float]] = {}
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type == kind:
            a = agg.setdefault(e.name, [0, 0.0])
            a[0] += 1
            a[1] += e.device_time if on_cuda else e.self_cpu_time_total
    rows = sorted(([n, c / steps, us / steps] for n, (c, us) in agg.items()), key=lambda r: -r[2])
    return {"device": dev.type, "kernels_per_step": sum(r[1] for r in rows), "kernel_us_per_step": sum(r[2] for r in rows),
            "top": [{"name": n[:120], "count": c, "us": us} for n, c, us in rows[:top]]}


# --------------------------------------------------------------------------- engine end to end
def make_agreeing(target, draft, noise: float, seed: int = 0) -> None:
    """Make the target's logits the draft's times a constant (module docstring), then perturb the
    draft's head by ``noise`` standard deviations. In place, on the models' device."""
    g = torch.Generator(device=target.device).manual_seed(seed)
    with torch.no_grad():
        for m in (target, draft):
            lm = m.model.language_model
            for layer in lm.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            lm.norm.weight.fill_(1.0)
        ed, et = draft.get_input_embeddings().weight, target.get_input_embeddings().weight  # [V, 768], [V, 4096]
        wd, wt = draft.get_output_embeddings().weight, target.get_output_embeddings().weight
        et.zero_()
        et[:, : ed.shape[1]] = ed
        wt.zero_()
        wt[:, : wd.shape[1]] = wd
        if noise:
            wd.add_(torch.randn(wd.shape, generator=g, device=wd.device, dtype=wd.dtype) * noise * wd.float().std())


def word_tokenizer(vocab: int):
    """A stand-in tokenizer with ``vocab`` word tokens (SpecDecoder only needs its size and ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


@torch.inference_mode()
def target_alone(target, prompt: torch.Tensor, n_new: int, mode: str) -> float:
    """Seconds per token of greedy decoding by the target alone, on mmspec's cache (eager or
    graph), decode only (after the prefill); tokens stay on the device (no sync per token)."""
    probe = _Probe(target, 1, prompt.shape[1], n_new + 2, mode)
    dev = probe.adapter.device
    C, cap = probe.context, probe.capacity
    nxt = probe.tokens[:, :1].clone()
    mask_full = torch.zeros(1, 1, 1, cap, dtype=torch.bool, device=dev)
    sync(dev)
    t0 = time.perf_counter()
    for i in range(n_new):
        pos = torch.full((1, 1), C + i, dtype=torch.long, device=dev)
        if probe.static:
            mask_full[..., C + i] = True
            mask_full[..., :C] = True
            mask = mask_full
        else:
            mask = torch.ones(1, 1, 1, C + i + 1, dtype=torch.bool, device=dev)
        nxt = probe.runner(ids=nxt, pos=pos, mask=mask)[:, -1:].argmax(-1)
    sync(dev)
    return (time.perf_counter() - t0) / n_new


def engine_run(cfg: ShapesConfig, target, draft, result: dict, log) -> dict:
    """SpecDecoder at these shapes: target alone vs mmspec, eager vs graphs, chain vs tree (and
    with ``--compile`` the chain compiled, beside)."""
    from mmspec import SpecDecoder

    dev = target.device
    tok = word_tokenizer(target.config.text_config.vocab_size)
    hi = min(target.config.text_config.vocab_size, target.config.image_token_index)
    prompt = torch.randint(5, hi, (1, cfg.context), generator=torch.Generator().manual_seed(1)).to(dev)
    out = result["engine"] = {"new_tokens": cfg.engine_new_tokens, "gamma": cfg.engine_gamma, "runs": {}}
    modes = cfg.engine_modes or cfg.modes
    for mode in modes:
        out.setdefault("target_alone_s_per_token", {})[mode] = statistics.median(
            target_alone(target, prompt, cfg.engine_new_tokens, mode) for _ in range(cfg.engine_repeats))
    for noise in cfg.engine_noise:
        make_agreeing(target, draft, noise)
        for mode in modes:
            graphs = mode == "graph"
            variants = [("chain", {}), ("tree", {"tree": "dynamic"})] + ([("chain+compile", {"compile": True})]
                                                                         if cfg.compile else [])
            for label, kw in variants:
                kw = kw if "tree" in kw else {"gamma": cfg.engine_gamma, **kw}  # a tree has a shape of its own
                dec = SpecDecoder(target, draft, tok, views="M", prefix_cache_mb=0,
                                  cuda_graphs=("emulate" if dev.type != "cuda" else True) if graphs else False, **kw)
                warm = dec.generate(prompt, max_new_tokens=cfg.engine_new_tokens)  # captures the graphs (compiles)
                runs = [dec.generate(prompt, max_new_tokens=cfg.engine_new_tokens) for _ in range(cfg.engine_repeats)]
                decode = [r.stats.total_s - r.stats.prefill_s - r.stats.vision_s for r in runs]
                st = runs[0].stats
                s_tok = statistics.median(d / r.stats.n_tokens for d, r in zip(decode, runs))
                base = out["target_alone_s_per_token"][mode]
                rec = {"noise": noise, "mode": mode, "tree": st.tree, "engine": st.engine, "tau": st.tau,
                       "n_blocks": st.n_blocks, "step_s": statistics.median(d / r.stats.n_blocks for d, r in
                                                                           zip(decode, runs)),
                       "capture_s": warm.stats.capture_s, "compile_s": warm.stats.compile_s,
                       "decode_s_per_token": s_tok, "speedup_vs_target_same_mode": base / s_tok,
                       "speedup_vs_eager_target": out["target_alone_s_per_token"].get("eager", base) / s_tok,
                       "identical_runs": all(r.token_ids == runs[0].token_ids for r in runs + [warm])}
                m = result["modes"].get(mode)
                g = str(cfg.engine_gamma)
                if m and label == "chain" and g in m["T_V"]:  # eq. 2 at the measured tau, from this run's probes
                    t_p, t_q, t_v = m["T_p"]["s"], m["T_q"][str(min(cfg.batches))]["s"], m["T_V"][g]["s"]
                    pred = st.tau / (cfg.engine_gamma * t_q / t_p + t_v / t_p)
                    rec.update(predicted_speedup=pred, engine_efficiency=rec["speedup_vs_target_same_mode"] / pred)
                out["runs"][f"noise{noise:g}-{mode}-{label}"] = rec
                write_report(result, cfg.out)
                log(f"[engine] noise {noise:g} {mode:5s} {label:13s}: tau {st.tau:.2f}, step {rec['step_s'] * 1e3:.2f} "
                    f"ms, {1 / s_tok:.1f} tok/s, x{rec['speedup_vs_target_same_mode']:.2f} vs same-mode target"
                    + (f", compiled in {rec['compile_s']:.1f} s" if kw.get("compile") else "")
                    + (f", efficiency {rec['engine_efficiency']:.2f}" if "engine_efficiency" in rec else ""))
    return out


# --------------------------------------------------------------------------- the run
def mode_probes(cfg: ShapesConfig, target, draft, mode: str, floor_s: float, log) -> dict:
    """T_p (and its ratio to ``floor_s``), T_V(gamma), T_V(tree) and T_q(batch) in one mode."""
    room = max(max(cfg.gammas) + 1, max(cfg.trees, default=1)) + 2
    r: dict = {}
    tp = _Probe(target, 1, cfg.context, room, mode)
    log(f"[{mode}] T_p ...")
    r["T_p"] = step_time(tp, 1, cfg.repeats, cfg.warmup)
    t_p = r["T_p"]["s"]
    r["T_p_over_floor"] = t_p / floor_s
    log(f"[{mode}] T_V(gamma) for gamma {list(cfg.gammas)}, T_V(tree) for {list(cfg.trees)} nodes ...")
    r["T_V"] = {str(g): step_time(tp, g + 1, cfg.repeats, cfg.warmup) for g in cfg.gammas}
    r["T_V_over_T_p"] = {g: v["s"] / t_p for g, v in r["T_V"].items()}
    r["T_V_tree"] = {str(n): step_time(tp, n, cfg.repeats, cfg.warmup, *random_tree(n, 6, seed=n))
                     for n in cfg.trees}
    r["T_V_tree_over_T_p"] = {n: v["s"] / t_p for n, v in r["T_V_tree"].items()}
    del tp
    log(f"[{mode}] draft step for batch {list(cfg.batches)} ...")
    r["T_q"] = {str(b): step_time(_Probe(draft, b, cfg.context, 4, mode), 1, cfg.repeats, cfg.warmup)
                for b in cfg.batches}
    t_q1 = r["T_q"][str(min(cfg.batches))]["s"]
    r["T_q_over_T_p"] = t_q1 / t_p
    r["T_q_batch_over_batch1"] = {b: v["s"] / t_q1 for b, v in r["T_q"].items()}
    return r


def capacity_time(cfg: ShapesConfig, target, mode: str, capacity: int) -> dict:
    """{cache slots: T_p} at ``cfg.context`` in a cache of at least ``capacity`` slots."""
    probe = _Probe(target, 1, cfg.context, 4, mode, capacity=capacity)
    return {str(probe.capacity): step_time(probe, 1, cfg.repeats, cfg.warmup)}


def compile_row(cfg: ShapesConfig, target, name: str, result: dict, log) -> None:
    """One torch.compile mode's T_p into ``result["compile"]``."""
    result["compile"] |= compile_times(target, cfg.context, cfg.repeats, cfg.warmup, [name])
    v = result["compile"][name]
    if "s" in v:
        v["T_p_over_floor"] = v["s"] / result["T_p_floor_weights_kv_s"]
    log(f"[compile] {name}: {v}")


def run(cfg: ShapesConfig, log: Callable[[str], None] = print) -> dict:
    """Build both models, time every probe in every mode, write JSON + markdown under ``cfg.out``."""
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tcfg, dcfg = llava_config(cfg.small, "target"), llava_config(cfg.small, "draft")
    log(f"building {'small' if cfg.small else 'real-shaped'} target and draft on {device} ({dtype}) ...")
    target, draft = build_model(tcfg, device, dtype), build_model(dcfg, device, dtype)
    bw = copy_bandwidth(device, cfg.copy_mib, max(5, cfg.repeats // 3))
    w_t = decode_weight_bytes(target)
    result = {"date": now(), "machine": machine_info(str(device)), "config": asdict(cfg), "dtype": str(dtype),
              "target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters()),
              "copy_bandwidth_GBps": bw / 1e9, "target_decode_weight_bytes": w_t,
              "target_kv_bytes": kv_bytes(tcfg, cfg.context, 1, dtype),
              "T_p_floor_weights_s": w_t / bw,
              "T_p_floor_weights_kv_s": (w_t + kv_bytes(tcfg, cfg.context, 1, dtype)) / bw, "modes": {}}
    def section(name: str, fn: Callable[[], None]) -> None:
        """Run one section; its failure goes to ``result["errors"]``, never past it; then save."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the sections after it still run
            result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"[:6000]
            log(f"!!! {name} failed ({type(e).__name__}: {str(e)[:300]}); going on")
        write_report(result, cfg.out)  # results written as they are produced

    if "graph" in cfg.modes:  # the graph path must compute what the eager one does
        section("graph vs eager", lambda: result.update(graph_vs_eager_max_abs_logit_diff={
            "target": graph_vs_eager(target, cfg.context, 6), "draft": graph_vs_eager(draft, cfg.context, 1)}))
    for mode in cfg.modes:
        section(f"{mode} probes", lambda mode=mode: result["modes"].update(
            {mode: mode_probes(cfg, target, draft, mode, result["T_p_floor_weights_kv_s"], log)}))
    if cfg.kernels:
        log("[kernels] profiling one eager T_p step ...")
        section("kernels", lambda: result.update(kernels=kernel_table(target, cfg.context)))
    if cfg.capacities:
        mode = "graph" if "graph" in cfg.modes else cfg.modes[0]
        log(f"[capacity] T_p ({mode}) at context {cfg.context} in caches of {list(cfg.capacities)} ...")
        result["capacity"] = {"mode": mode, "T_p": {}}
        for cap in cfg.capacities:
            section(f"capacity {cap}", lambda cap=cap: result["capacity"]["T_p"].update(capacity_time(
                cfg, target, mode, cap)))
    if cfg.engine:
        log("[engine] SpecDecoder end to end ...")
        section("engine", lambda: engine_run(cfg, target, draft, result, log))
    if cfg.compile:
        log("[compile] T_p with torch.compile beside it uncompiled (compiling takes a while) ...")
        result["compile"] = {}
        for name in cfg.compile_modes:  # one at a time, each written as it ends
            section(f"compile {name}", lambda name=name: compile_row(cfg, target, name, result, log))
    jp, mp = write_report(result, cfg.out)
    log(markdown(result))
    log(f"wrote {jp} and {mp}")
    return result


def markdown(res: dict) -> str:
    m = res["machine"]
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    lines = [f"# Real-shape latency ({res['date']})", "",
             f"- command: `{res['config']['command']}`",
             f"- machine: {m.get('gpu', m['device'])}, torch {m['torch']}, transformers {m.get('transformers', '?')}, "
             f"{res['dtype']}, context {res['config']['context']} tokens; target {res['target_params'] / 1e6:,.1f} M "
             f"params, draft {res['draft_params'] / 1e6:,.1f} M params; graph vs eager max |logit diff| "
             f"{res.get('graph_vs_eager_max_abs_logit_diff', '-')}",
             f"- copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s; T_p floor (weights) "
             f"{ms(res['T_p_floor_weights_s'])} ms, (weights + KV) {ms(res['T_p_floor_weights_kv_s'])} ms"]
    lines += [f"- **{name} failed**: `{err.splitlines()[0]}` (the traceback is in gpu_shapes.json)"
              for name, err in res.get("errors", {}).items()]
    lines += ["", "| mode | T_p ms | T_p / floor | T_q(1) / T_p | graph |", "|---|---|---|---|---|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | {ms(r['T_p']['s'])} | {r['T_p_over_floor']:.2f} | {r['T_q_over_T_p']:.3f} | "
                     f"{r['T_p']['graph']}{' (' + r['T_p']['graph_error'] + ')' if 'graph_error' in r['T_p'] else ''} |")
    for name, v in res.get("compile", {}).items():
        if "s" in v:
            lines.append(f"| torch.compile {name} | {ms(v['s'])} (uncompiled {ms(v['plain_s'])}: "
                         f"{v['speedup']:.2f}x) | {v['T_p_over_floor']:.2f} | - | "
                         f"compiling + first calls {v['compile_and_first_calls_s']:.1f} s |")
        else:
            lines.append(f"| torch.compile {name} | - | - | - | {v.get('error')} |")
    gam = list(next(iter(res["modes"].values()))["T_V_over_T_p"]) if res["modes"] else []
    lines += ["", "T_V(gamma) / T_p (target verifies gamma + 1 tokens):", "",
              "| mode | " + " | ".join(f"γ={g}" for g in gam) + " |", "|---" * (len(gam) + 1) + "|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{r['T_V_over_T_p'][g]:.2f}" for g in gam) + " |")
    trees = list(next(iter(res["modes"].values()))["T_V_tree_over_T_p"]) if res["modes"] else []
    if trees:
        lines += ["", "T_V(tree) / T_p (target verifies a tree of N nodes under a tree mask, depth <= 6):", "",
                  "| mode | " + " | ".join(f"N={n}" for n in trees) + " |", "|---" * (len(trees) + 1) + "|"]
        for mode, r in res["modes"].items():
            lines.append(f"| {mode} | " + " | ".join(f"{r['T_V_tree_over_T_p'][n]:.2f}" for n in trees) + " |")
    bs = list(next(iter(res["modes"].values()))["T_q"]) if res["modes"] else []
    lines += ["", "Draft step latency by batch (= number of views), ms and ratio to batch 1 (IbED Fig. 9):", "",
              "| mode | " + " | ".join(f"b={b}" for b in bs) + " |", "|---" * (len(bs) + 1) + "|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{ms(r['T_q'][b]['s'])} ({r['T_q_batch_over_batch1'][b]:.2f}x)"
                                                 for b in bs) + " |")
    cap = res.get("capacity")
    if cap:
        lines += ["", f"T_p ({cap['mode']}) at context {res['config']['context']} by cache capacity (attention reads "
                  "the whole buffer under a dense mask):", "", "| capacity | T_p ms | T_p / floor |", "|---|---|---|"]
        for c, v in cap["T_p"].items():
            lines.append(f"| {c} | {ms(v['s'])} | {v['s'] / res['T_p_floor_weights_kv_s']:.2f} |")
    kt = res.get("kernels")
    if kt:
        what = "kernels" if kt.get("device", "cuda") == "cuda" else "aten ops (CPU, self time)"
        lines += ["", f"Kernels of one eager T_p step: {kt['kernels_per_step']:.0f} {what}, "
                  f"{kt['kernel_us_per_step'] / 1e3:.3f} ms of kernel time (the floor of any graph of them):", "",
                  "| kernel | per step | us |", "|---|---|---|"]
        for r in kt["top"]:
            lines.append(f"| `{r['name']}` | {r['count']:.0f} | {r['us']:.1f} |")
    eng = res.get("engine")
    if eng:
        base = eng.get("target_alone_s_per_token", {})
        lines += ["", f"SpecDecoder end to end (M view, γ={eng['gamma']}, {eng['new_tokens']} new tokens, decode only; "
                  "target alone: " + ", ".join(f"{k} {1 / v:.1f} tok/s" for k, v in base.items()) + "):", "",
                  "| draft noise | mode | engine | blocks | τ | step ms | tok/s | vs same-mode target | vs eager target "
                  "| eq.-2 predicted | engine efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in eng["runs"].values():
            eng_name = r.get("engine", "") + (f" (compiled in {r['compile_s']:.1f} s)" if r.get("compile_s") else "")
            lines.append(f"| {r['noise']:g} | {r['mode']} | {eng_name} | {r['tree']} | {r['tau']:.2f} | "
                         f"{r.get('step_s', float('nan')) * 1e3:.2f} | {1 / r['decode_s_per_token']:.1f} "
                         f"| {r['speedup_vs_target_same_mode']:.2f}x | {r['speedup_vs_eager_target']:.2f}x | "
                         f"{r.get('predicted_speedup', float('nan')):.2f}x | {r.get('engine_efficiency', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "gpu_shapes.json", out / "gpu_shapes.md"
    for path, text in ((jp, json.dumps(result, indent=1)), (mp, markdown(result))):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a run killed mid-write leaves the previous report whole
    return jp, mp


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def parse_args(argv: Sequence[str] | None = None) -> ShapesConfig:
    d = ShapesConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny float32 configs (CPU smoke test)")
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--context", type=int, default=d.context)
    ap.add_argument("--gammas", default=",".join(map(str, d.gammas)))
    ap.add_argument("--trees", default=",".join(map(str, d.trees)), help="tree sizes N for T_V(tree)")
    ap.add_argument("--batches", default=",".join(map(str, d.batches)))
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--modes", default=",".join(d.modes), help="eager,graph")
    ap.add_argument("--compile", action="store_true", help="also T_p and the engine's chain with torch.compile, "
                    "beside them uncompiled")
    ap.add_argument("--compile-modes", default=",".join(d.compile_modes), help=f"of {','.join(COMPILE_MODES)}")
    ap.add_argument("--capacities", default="", help="T_p at the same context in caches this large")
    ap.add_argument("--kernels", action="store_true", help="profile one eager T_p step's kernels (CUDA only)")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="skip the SpecDecoder runs")
    ap.add_argument("--engine-modes", default="", help="modes of the SpecDecoder runs (default: --modes)")
    ap.add_argument("--engine-gamma", type=int, default=d.engine_gamma)
    ap.add_argument("--engine-new-tokens", type=int, default=d.engine_new_tokens)
    ap.add_argument("--engine-noise", default=",".join(map(str, d.engine_noise)))
    ap.add_argument("--engine-repeats", type=int, default=d.engine_repeats)
    ap.add_argument("--copy-mib", type=int, default=d.copy_mib)
    ap.add_argument("--out", default=d.out)
    a = ap.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    engine_modes = tuple(m for m in a.engine_modes.split(",") if m)
    if not modes or set(modes + engine_modes) - {"eager", "graph"}:
        ap.error(f"--modes and --engine-modes take eager and/or graph, got {a.modes!r} and {a.engine_modes!r}")
    if set(a.compile_modes.split(",")) - set(COMPILE_MODES) - {""}:
        ap.error(f"--compile-modes takes {','.join(COMPILE_MODES)}, got {a.compile_modes!r}")
    kw = vars(a) | {"gammas": _ints(a.gammas), "trees": _ints(a.trees), "batches": _ints(a.batches), "modes": modes,
                    "engine_modes": engine_modes,
                    "capacities": _ints(a.capacities), "compile_modes": tuple(x for x in a.compile_modes.split(",") if x),
                    "engine_noise": tuple(float(x) for x in a.engine_noise.split(",") if x)}
    return ShapesConfig(**kw, command=" ".join(["python", "perf/gpu_shapes.py",
                                                 *(argv if argv is not None else sys.argv[1:])]))


def main(argv: Sequence[str] | None = None) -> int:
    """0, or 3 when a section failed (its error is in the report; the other sections ran)."""
    return 3 if run(parse_args(argv)).get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
