"""A head proves itself on load: a short calibration (a few prompts, a few dozen tokens each)
that measures what the head actually does against its target, and names the likely causes when
it does nothing.

Owns: the calibration prompts (the embedded world's, or a JSONL file of ``{"prompt", "images"}``
checked before anything loads), :func:`calibrate` (τ, acceptance by depth, the feature layers
and where they came from, the scale of the head's predicted features against the target's) and
:class:`HeadReport`. When τ is near 1 it probes the commonest fault: the feature layers read
one off (it reruns with the layers shifted by one each way). It knows nothing of the CLI; the
decoding is :class:`mmspec.decoder.SpecDecoder`'s (greedy, a chain: the exact output is the
target's, only τ is read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mmspec.errors import MMSpecError

NEAR_ONE = 1.3  # τ below this: the head barely drafts (a working head gives 2-4 on its own data)
CAUSES = ("feature-layer ids off by one (SGLang counts decoder-layer outputs, vLLM and speculators the state "
          "before a layer)", "the token embedding missing or not the target's (a head saved without "
          "embed_tokens, read with a random one)", "the final norm applied twice (features taken after the "
          "target's norm, normed again)", "M-RoPE positions (a Qwen2-VL-family head run with 1-D positions)",
          "a head trained for another target or checkpoint")


@dataclass(frozen=True)
class CalibrationPrompt:
    prompt: str
    images: tuple = ()  # PIL images or paths
    inputs: dict | None = None  # the processor's output, when given instead of prompt and images


@dataclass
class HeadReport:
    """What the calibration measured. ``tau``: tokens per block incl. the bonus/recovered token;
    ``acceptance_by_depth[d]``: the share of blocks whose draft d + 1 was accepted;
    ``feature_scale``: RMS of the head's first predicted feature over the target's true one."""

    tau: float
    acceptance_by_depth: list[float]
    feature_layers: tuple[int, ...]
    layers_from: str
    prompts: int
    tokens: int
    feature_scale: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.warnings

    def lines(self) -> list[str]:
        layers = ", ".join("the final (post-norm) state" if i == -1 else f"output of layer {i}"
                           for i in self.feature_layers)
        out = [f"head check: tau {self.tau:.2f} over {self.prompts} prompt(s), {self.tokens} tokens (greedy chain)",
               "  acceptance by depth: " + " ".join(f"{a:.2f}" for a in self.acceptance_by_depth),
               f"  reads: {layers} ({self.layers_from})"]
        if self.feature_scale is not None:
            out.append(f"  predicted feature scale vs the target's: {self.feature_scale:.2f}x")
        out += [f"  warning: {w}" for w in self.warnings]
        return out


# --------------------------------------------------------------------------- prompts
def world_prompts(n: int = 4) -> list[CalibrationPrompt]:
    """``n`` test-split samples of the embedded world, one family each (1, 2 and 5 images): each
    one's question without LLaVA-1.5's ``USER: ... ASSISTANT:`` frame, so that every target frames
    it its own way (:func:`mmspec.inputs.chat_prompt`: its chat template; the embedded target's
    frame gives the world's prompt back exactly)."""
    from mmspec.world import make_sample

    fams = ("chartqa", "spot_the_diff", "textvqa", "pororosv", "vqav2", "iedit")
    out = []
    for i in range(n):
        s = make_sample(fams[i % len(fams)], "test", i // len(fams))
        question = s.prompt.strip().removeprefix("USER:").removesuffix("ASSISTANT:").strip()
        out.append(CalibrationPrompt(question, tuple(s.images)))
    return out


def read_prompts(path) -> list[CalibrationPrompt]:
    """A JSONL file, one ``{"prompt": "...<image>...", "images": ["a.png", ...]}`` per line
    (paths relative to the file), checked whole before any model loads."""
    from mmspec.inputs import with_markers

    p = Path(path)
    if not p.is_file():
        raise MMSpecError(f"--prompts {str(path)!r}: file not found; give a JSONL file with one "
                          '{"prompt": "USER: <image>\\n...", "images": ["a.png"]} per line')
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MMSpecError(f"--prompts {p}, line {n}: not JSON ({e.msg}); one object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise MMSpecError(f"--prompts {p}, line {n}: needs a \"prompt\" string (and \"images\": a list of "
                              "image files)")
        images = row.get("images", [])
        if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
            raise MMSpecError(f"--prompts {p}, line {n}: \"images\" must be a list of image file paths")
        files = [(p.parent / i) if not Path(i).is_absolute() else Path(i) for i in images]
        for f in files:
            if not f.is_file():
                raise MMSpecError(f"--prompts {p}, line {n}: image file not found: {str(f)!r} (a relative path is "
                                  "read from the prompts file's directory)")
        try:
            with_markers(row["prompt"], len(files), 0)
        except MMSpecError as e:
            raise MMSpecError(f"--prompts {p}, line {n}: {e}") from None
        out.append(CalibrationPrompt(row["prompt"], tuple(str(f) for f in files)))
    if not out:
        raise MMSpecError(f"--prompts {p} holds no prompts; give one JSON object per line")
    return out


# --------------------------------------------------------------------------- calibration
def layers_source(head) -> str:
    """Where the feature layers a head reads came from, in words."""
    c = head.config
    fmt = (c.source or {}).get("format")
    if fmt == "eagle":
        return "EAGLE-1/2 reads the target's final state"
    if fmt in ("eagle3", "speculators-eagle3"):
        cfg = {}
        try:
            cfg = json.loads((Path(c.source["path"]) / "config.json").read_text())
        except (OSError, ValueError, KeyError):
            pass
        if (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            return "config.json eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: decoder-layer outputs)"
        if cfg.get("eagle_aux_hidden_state_layer_ids"):
            return "config.json eagle_aux_hidden_state_layer_ids (vLLM / speculators: the state before layer j, less one)"
        return "none recorded: the engines' default for this depth (outputs of 1, N/2 - 1, N - 4)"
    return "recorded in mmspec_head.json at training"


def prompt_inputs(dec, cp: CalibrationPrompt) -> tuple[dict, list]:
    """One calibration prompt -> (the target processor's WHOLE output on the target's device, the
    PIL images): whatever the target's family reads (LLaVA-NeXT's ``image_sizes``, Qwen's
    ``image_grid_thw``, ...) goes to the decode and to the feature forward alike. The text is framed
    as ``mmspec generate`` frames ``--prompt`` (the chat template; a prompt starting ``USER:`` as written)."""
    from mmspec.inputs import chat_prompt, load_images, processor_inputs, to_target

    images = load_images(list(cp.images)) if cp.images and isinstance(cp.images[0], str) else list(cp.images)
    if cp.inputs is not None:
        inputs = cp.inputs
    else:
        inputs = processor_inputs(dec.processor, chat_prompt(dec.processor, cp.prompt, len(images)), images)
    return to_target(inputs, dec.target.device, dec.target_model.dtype), images


def _run(dec, prompts, max_new_tokens: int):
    blocks: list[int] = []
    scale = []
    for cp in prompts:
        inputs, images = prompt_inputs(dec, cp)
        res = dec.generate(**inputs, max_new_tokens=max_new_tokens, images=images or None)
        blocks += list(res.stats.tokens_per_block)
        s = _feature_scale(dec, inputs)
        if s is not None:
            scale.append(s)
    return blocks, (sum(scale) / len(scale) if scale else None)


def _feature_scale(dec, inputs) -> float | None:
    """RMS of the head's prediction of the target's next feature, over the true feature's, on the
    prompt's last text positions (eagle / msd: both in the target's final-state space). The
    target's forward gets every input its family reads."""
    head = dec.head
    if head.config.layer == "eagle3" or len(head.config.feature_layers) != 1:
        return None
    with torch.inference_mode():
        out = dec.target_model(**inputs, output_hidden_states=True)
        layer = head.config.feature_layers[0]
        hs = out.hidden_states[-1] if layer == -1 else out.hidden_states[layer + 1]  # [1, L, H]; [-1]: post-norm
        ids = inputs["input_ids"][0]
        n = min(8, ids.shape[0] - 2)
        feats, nxt = hs[:, -n - 1:-1], ids[-n:][None]
        emb = dec.target_model.get_input_embeddings()(nxt)
        pred = head(head.fused(feats.to(head.dtype)), emb.to(head.dtype),
                    position_ids=torch.arange(n, device=feats.device)[None])
        true = hs[:, -n:]
        return float(pred.pow(2).mean().sqrt() / true.pow(2).mean().sqrt().clamp_min(1e-12))


def _depths(blocks: list[int], gamma: int) -> list[float]:
    n = max(len(blocks), 1)
    return [sum(1 for b in blocks if b - 1 >= d) / n for d in range(1, gamma + 1)]


def calibrate(dec, prompts: list[CalibrationPrompt] | None = None, *, max_new_tokens: int = 24,
              probe: bool = True) -> HeadReport:
    """Run the head of ``dec`` (a SpecDecoder drafting with a head, with its processor) on
    ``prompts`` (default: 4 of the embedded world's) and report. When τ is near 1 and ``probe``,
    rerun with the feature layers shifted by one each way and say whether either drafts better."""
    if dec.head is None:
        raise MMSpecError("calibrate checks a feature-level head; this decoder drafts with a draft model")
    if dec.processor is None and not (prompts and all(p.inputs is not None for p in prompts)):
        raise MMSpecError("the head check feeds images through the target's processor: pass processor=...")
    prompts = prompts or world_prompts()
    blocks, scale = _run(dec, prompts, max_new_tokens)
    tau = sum(blocks) / max(len(blocks), 1)
    rep = HeadReport(tau=tau, acceptance_by_depth=_depths(blocks, dec.gamma),
                     feature_layers=tuple(dec.head.config.feature_layers), layers_from=layers_source(dec.head),
                     prompts=len(prompts), tokens=sum(blocks), feature_scale=scale)
    if tau >= NEAR_ONE:
        return rep
    found = []
    if scale is not None and not 0.5 <= scale <= 2.0:
        found.append(f"its predicted features are {scale:.2f}x the scale of the target's: a norm applied twice "
                     "(or missing) on the features it reads or predicts")
    if probe:
        for shift in (-1, 1):  # on half the prompts: a probe, not a measurement
            t = _shifted_tau(dec, prompts[:max(1, len(prompts) // 2)], max_new_tokens, shift)
            if t is not None and t >= max(NEAR_ONE, tau * 1.2):
                layers = [i + shift for i in dec.head.config.feature_layers]
                found.append(f"reading layers {layers} instead of {list(dec.head.config.feature_layers)} gives tau "
                             f"{t:.2f}: its feature-layer ids look off by one")
    rep.warnings.append(f"tau {tau:.2f} is near 1: the head barely drafts (every token costs a target pass). "
                        + ("Found: " + "; ".join(found) + ". " if found else "")
                        + "Likely causes: " + "; ".join(CAUSES) + ".")
    return rep


def _shifted_tau(dec, prompts, max_new_tokens: int, shift: int) -> float | None:
    """τ of the same head reading each feature layer ``shift`` off (None: a layer outside the target)."""
    import copy

    c = dec.head.config
    n = dec.target.num_layers
    layers = tuple(n - 1 + shift if i == -1 and shift < 0 else i + shift for i in c.feature_layers)
    if any(i < 0 or i >= n for i in layers) or -1 in c.feature_layers and shift > 0:
        return None
    head = copy.deepcopy(dec.head)
    head.config = replace(c, feature_layers=layers)
    other = type(dec)(dec.target_model, head, dec.tokenizer, processor=dec.processor, gamma=dec.gamma)
    blocks, _ = _run(other, prompts, max_new_tokens)
    return sum(blocks) / max(len(blocks), 1) if blocks else None


def tau_ok(report: HeadReport) -> bool:
    return math.isfinite(report.tau) and report.tau >= NEAR_ONE
