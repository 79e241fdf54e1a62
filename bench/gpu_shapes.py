"""Latency of real-shaped models on a GPU: the numbers behind IbED eq. 2 and Fig. 9.

Owns: building randomly initialised LLaVA models with REAL shapes from configs (no weights:
decode latency does not depend on weight values), and timing on them

- T_p (target one-token decode) against the memory-bandwidth floor: bytes the decode must read
  (LM weights + lm_head, plus the KV cache) / measured device-to-device copy bandwidth;
- T_q / T_p (draft one-token decode at batch 1) and T_V(gamma) / T_p (target forward over
  gamma + 1 tokens) for gamma in 1..8;
- draft per-step latency for batch 1..8 (IbED Fig. 9: a batch of views costs the draft almost
  nothing extra because decode is memory-bound);

each in two modes: ``eager`` (``DynamicCache``, what mmspec runs today) and ``static``
(``StaticCache``; on CUDA the step is captured once in a ``torch.cuda.CUDAGraph`` and replayed,
which removes the per-kernel launch overhead). Every timed step writes the same cache slots, so
all repeats see the same context; a precomputed 4-D mask keeps the step free of host syncs.

Shapes: target = LLaVA-1.5-7B (CLIP ViT-L/14-336, Llama-2-7B LM: hidden 4096, 32 layers, 32
heads, intermediate 11008, vocab 32064); draft = LLaVA-68M-shaped (Llama hidden 768, 2 layers,
12 heads, intermediate 3072, same vocab and vision tower). ``--small`` swaps in tiny configs in
float32 so the same code path runs on CPU in seconds (tests). It knows nothing about drafting.

Run ``python bench/gpu_shapes.py --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from mmspec.provenance import machine_info, now
from mmspec.timing import median_time

IMAGE_TOKEN = 32000  # llava-hf/llava-1.5-7b-hf


@dataclass
class ShapesConfig:
    """One run; the CLI only maps flags onto these fields."""

    small: bool = False  # tiny configs (CPU tests); default: real 7B / 68M shapes
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # default: bfloat16 on cuda, float32 otherwise
    context: int = 640  # tokens already in the KV cache (one 576-token image + text)
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    batches: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    repeats: int = 30
    warmup: int = 3
    modes: tuple[str, ...] = ("eager", "static")
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


def _rewind_static(cache, length: int) -> None:
    """Move a StaticCache's write cursor back to ``length`` (the next step rewrites the same slots).

    transformers 5 keeps the cursor per layer as a device tensor ``cumulative_length``; there is
    no public rewind for static caches, so this is the one place that touches that attribute.
    """
    for layer in cache.layers:
        cur = getattr(layer, "cumulative_length", None)
        if not isinstance(cur, torch.Tensor):
            raise RuntimeError("this transformers version keeps no StaticCache cursor tensor; update _rewind_static")
        cur.fill_(length)


def _step_inputs(model: torch.nn.Module, batch: int, context: int, n_new: int, seed: int = 0):
    """Random text ids (no image token): prompt [B, C], new tokens [B, n_new], positions [B, n_new]."""
    dev = next(model.parameters()).device
    hi = min(model.config.text_config.vocab_size, model.config.image_token_index)
    ids = torch.randint(5, hi, (batch, context + n_new), generator=torch.Generator().manual_seed(seed)).to(dev)
    pos = torch.arange(context, context + n_new, device=dev)[None].expand(batch, -1)
    return ids[:, :context], ids[:, context:], pos


def _static_step(model: torch.nn.Module, prompt: torch.Tensor, new: torch.Tensor, pos: torch.Tensor):
    """Prefill a StaticCache of exactly context + n_new slots; return a step rewriting the last n_new."""
    from transformers import StaticCache

    dev = prompt.device
    (batch, context), n_new = prompt.shape, new.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=context + n_new)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, position_ids=torch.arange(context, device=dev)[None])
    causal = torch.ones(n_new, n_new, dtype=torch.bool, device=dev).tril()  # [n_new, n_new]
    mask4 = torch.cat([torch.ones(n_new, context, dtype=torch.bool, device=dev), causal], 1)  # [n_new, C + n_new]
    mask4 = mask4[None, None].expand(batch, 1, -1, -1)  # [B, 1, n_new, C + n_new]: True = attend

    def step() -> torch.Tensor:
        logits = model(input_ids=new, past_key_values=cache, use_cache=True, position_ids=pos,
                       attention_mask=mask4).logits  # [B, n_new, V]
        _rewind_static(cache, context)  # device-side, so it is captured in the graph too
        return logits
    return step


@torch.inference_mode()
def static_matches_eager(model: torch.nn.Module, context: int, n_new: int) -> float:
    """Max |logit difference| between the static step (run twice: checks the rewind) and eager."""
    from transformers import DynamicCache

    prompt, new, pos = _step_inputs(model, 2, context, n_new)
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    ref = model(input_ids=new, past_key_values=cache, use_cache=True, position_ids=pos).logits.float()
    step = _static_step(model, prompt, new, pos)
    step()
    return float((step().float() - ref).abs().max())


@torch.inference_mode()
def step_time(model: torch.nn.Module, batch: int, context: int, n_new: int, mode: str, repeats: int,
              warmup: int) -> dict:
    """Median time of one forward over ``n_new`` tokens for ``batch`` rows on ``context`` cached ones.

    mode "eager": DynamicCache, cropped after each step. mode "static": StaticCache sized
    context + n_new, same slots rewritten each step; on CUDA captured as a CUDA graph.
    """
    from transformers import DynamicCache

    prompt, new, pos = _step_inputs(model, batch, context, n_new)
    dev = prompt.device
    if mode == "eager":
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        mask = torch.ones(batch, context + n_new, dtype=torch.long, device=dev)  # [B, C + n_new]

        def step() -> None:
            model(input_ids=new, past_key_values=cache, use_cache=True, position_ids=pos, attention_mask=mask)
            cache.crop(-n_new)  # transformers 5: a negative count removes that many positions
        return {"s": median_time(step, dev, repeats, warmup), "graph": False}
    step = _static_step(model, prompt, new, pos)
    if dev.type != "cuda":
        return {"s": median_time(step, dev, repeats, warmup), "graph": False}
    try:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 2)):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return {"s": median_time(graph.replay, dev, repeats, warmup), "graph": True}
    except Exception as e:  # noqa: BLE001 - report and fall back to the un-captured static step
        return {"s": median_time(step, dev, repeats, warmup), "graph": False, "graph_error": repr(e)[:300]}


# --------------------------------------------------------------------------- the run
def run(cfg: ShapesConfig, log: Callable[[str], None] = print) -> dict:
    """Build both models, time every probe in every mode, write JSON + markdown under ``cfg.out``."""
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tcfg, dcfg = llava_config(cfg.small, "target"), llava_config(cfg.small, "draft")
    log(f"building {'small' if cfg.small else 'real-shaped'} target and draft on {device} ({dtype}) ...")
    target, draft = build_model(tcfg, device, dtype), build_model(dcfg, device, dtype)
    bw = copy_bandwidth(device, cfg.copy_mib, max(5, cfg.repeats // 3))
    w_t = decode_weight_bytes(target)
    result = {"date": now(),
              "machine": machine_info(str(device)), "config": asdict(cfg), "dtype": str(dtype),
              "target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters()),
              "copy_bandwidth_GBps": bw / 1e9, "target_decode_weight_bytes": w_t,
              "target_kv_bytes": kv_bytes(tcfg, cfg.context, 1, dtype),
              "T_p_floor_weights_s": w_t / bw,
              "T_p_floor_weights_kv_s": (w_t + kv_bytes(tcfg, cfg.context, 1, dtype)) / bw, "modes": {}}
    if "static" in cfg.modes:  # the static path must compute what the eager one does
        result["static_vs_eager_max_abs_logit_diff"] = {
            "target": static_matches_eager(target, cfg.context, 6), "draft": static_matches_eager(draft, cfg.context, 1)}
    for mode in cfg.modes:
        r: dict = {}
        log(f"[{mode}] T_p ...")
        r["T_p"] = step_time(target, 1, cfg.context, 1, mode, cfg.repeats, cfg.warmup)
        t_p = r["T_p"]["s"]
        r["T_p_over_floor"] = t_p / result["T_p_floor_weights_kv_s"]
        log(f"[{mode}] T_V(gamma) for gamma {list(cfg.gammas)} ...")
        r["T_V"] = {str(g): step_time(target, 1, cfg.context, g + 1, mode, cfg.repeats, cfg.warmup) for g in cfg.gammas}
        r["T_V_over_T_p"] = {g: v["s"] / t_p for g, v in r["T_V"].items()}
        log(f"[{mode}] draft step for batch {list(cfg.batches)} ...")
        r["T_q"] = {str(b): step_time(draft, b, cfg.context, 1, mode, cfg.repeats, cfg.warmup) for b in cfg.batches}
        t_q1 = r["T_q"][str(min(cfg.batches))]["s"]
        r["T_q_over_T_p"] = t_q1 / t_p
        r["T_q_batch_over_batch1"] = {b: v["s"] / t_q1 for b, v in r["T_q"].items()}
        result["modes"][mode] = r
    jp, mp = write_report(result, cfg.out)
    log(markdown(result))
    log(f"wrote {jp} and {mp}")
    return result


def markdown(res: dict) -> str:
    m = res["machine"]
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    lines = [f"# Real-shape latency ({res['date']})", "",
             f"- command: `{res['config']['command']}`",
             f"- machine: {m.get('gpu', m['device'])}, torch {m['torch']}, {res['dtype']}, "
             f"context {res['config']['context']} tokens; target {res['target_params'] / 1e6:,.1f} M params, "
             f"draft {res['draft_params'] / 1e6:,.1f} M params; static vs eager max |logit diff| "
             f"{res.get('static_vs_eager_max_abs_logit_diff', '-')}",
             f"- copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s; T_p floor (weights) "
             f"{ms(res['T_p_floor_weights_s'])} ms, (weights + KV) {ms(res['T_p_floor_weights_kv_s'])} ms", "",
             "| mode | T_p ms | T_p / floor | T_q(1) / T_p | graph |", "|---|---|---|---|---|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | {ms(r['T_p']['s'])} | {r['T_p_over_floor']:.2f} | {r['T_q_over_T_p']:.3f} | "
                     f"{r['T_p']['graph']}{' (' + r['T_p']['graph_error'] + ')' if 'graph_error' in r['T_p'] else ''} |")
    gam = list(next(iter(res["modes"].values()))["T_V_over_T_p"]) if res["modes"] else []
    lines += ["", "T_V(gamma) / T_p (target verifies gamma + 1 tokens):", "",
              "| mode | " + " | ".join(f"γ={g}" for g in gam) + " |", "|---" * (len(gam) + 1) + "|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{r['T_V_over_T_p'][g]:.2f}" for g in gam) + " |")
    bs = list(next(iter(res["modes"].values()))["T_q"]) if res["modes"] else []
    lines += ["", "Draft step latency by batch (= number of views), ms and ratio to batch 1 (IbED Fig. 9):", "",
              "| mode | " + " | ".join(f"b={b}" for b in bs) + " |", "|---" * (len(bs) + 1) + "|"]
    for mode, r in res["modes"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{ms(r['T_q'][b]['s'])} ({r['T_q_batch_over_batch1'][b]:.2f}x)"
                                                 for b in bs) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "gpu_shapes.json", out / "gpu_shapes.md"
    jp.write_text(json.dumps(result, indent=1))
    mp.write_text(markdown(result))
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
    ap.add_argument("--batches", default=",".join(map(str, d.batches)))
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--modes", default=",".join(d.modes), help="eager,static")
    ap.add_argument("--copy-mib", type=int, default=d.copy_mib)
    ap.add_argument("--out", default=d.out)
    a = ap.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    if set(modes) - {"eager", "static"}:
        ap.error(f"--modes takes eager and/or static, got {a.modes}")
    kw = vars(a) | {"gammas": _ints(a.gammas), "batches": _ints(a.batches), "modes": modes}
    return ShapesConfig(**kw, command=" ".join(["python", "bench/gpu_shapes.py",
                                                 *(argv if argv is not None else sys.argv[1:])]))


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
