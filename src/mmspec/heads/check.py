"""A head proves itself on load: a short calibration (a few prompts, a few dozen tokens each)
that measures what the head actually does against its target, and says what the evidence
supports when it drafts badly: a head that is broken (its wiring: feature layers, token
embedding, norms) or one that is only under-trained (too few steps; or its first positions
learned and the deeper ones not).

Owns: the calibration prompts (the embedded world's, or a JSONL file of ``{"prompt", "images"}``
checked before anything loads), :func:`calibrate` and :class:`HeadReport`. The calibration
decodes with the decoder as it is set up (greedy; its chain or tree: the shape the server will
draft) and reports τ, acceptance by depth, the feature layers and where they came from, the
training the head records, and, at the answer's own positions, the scale of the head's predicted
features against the target's and whether its prediction reads the token embedding at all. When
τ is near 1 it also reruns with the feature layers shifted by one each way (the commonest
fault). :func:`diagnose` turns that evidence into one verdict. It knows nothing of the CLI; the
decoding is :class:`mmspec.decoder.SpecDecoder`'s (the output is the target's, only τ is read).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from mmspec.errors import MMSpecError

NEAR_ONE = 1.3  # τ below this: the head barely drafts (a working head gives 2-4 on its own data)
FEW_STEPS = 1000  # a head that records fewer training steps than train head's default is under-trained
FALLS_APART = 0.5  # acceptance at a depth below this share of the first position's: the depth is lost
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
    ``acceptance_by_depth[d]``: the share of the blocks drafted at least d + 1 deep whose draft at
    depth d + 1 was accepted; ``shape``: the chain or tree decoded (the decoder's own);
    ``trained``: the training the head records (mmspec_head.json's ``trained``; empty: none);
    ``feature_scale``: RMS of the head's predicted features over the target's true ones at the
    answer's positions (eagle / msd); ``embedding_effect``: how much of that prediction the token
    embedding moves (0: the head ignores it); ``diagnosis``: the verdict of :func:`diagnose`."""

    tau: float
    acceptance_by_depth: list[float]
    feature_layers: tuple[int, ...]
    layers_from: str
    prompts: int
    tokens: int
    shape: str = "chain"
    trained: dict = field(default_factory=dict)
    feature_scale: float | None = None
    embedding_effect: float | None = None
    diagnosis: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.warnings

    def lines(self) -> list[str]:
        layers = layer_words(self.feature_layers)
        out = [f"head check: tau {self.tau:.2f} over {self.prompts} prompt(s), {self.tokens} tokens (greedy, "
               f"{self.shape})",
               "  acceptance by depth: " + " ".join(f"{a:.2f}" for a in self.acceptance_by_depth),
               f"  reads: {layers} ({self.layers_from})",
               f"  trained: {trained_words(self.trained)}"]
        if self.feature_scale is not None:
            out.append(f"  predicted feature scale vs the target's: {self.feature_scale:.2f}x (at the answers' "
                       "positions)")
        if self.diagnosis:
            out.append(f"  diagnosis: {self.diagnosis}")
        out += [f"  warning: {w}" for w in self.warnings]
        return out


def trained_words(trained: dict) -> str:
    """The training a head records, in words."""
    steps = trained.get("steps")
    if steps is None:
        return "not recorded (an untrained head, or one made elsewhere)"
    loss = trained.get("final_loss")
    batch = trained.get("batch_size")
    return (f"{steps} steps" + (f" of {batch} sequences" if batch else "")
            + (f", final loss {loss:.3g}" if isinstance(loss, (int, float)) else ""))


# --------------------------------------------------------------------------- prompts
CHECK_FAMILIES = ("chartqa", "spot_the_diff", "textvqa", "pororosv", "vqav2", "iedit")


def world_prompts(n: int = 4, families: tuple[str, ...] = CHECK_FAMILIES) -> list[CalibrationPrompt]:
    """``n`` test-split samples of the embedded world, one family each in turn (by default 1, 2
    and 5 images): each one's question without LLaVA-1.5's ``USER: ... ASSISTANT:`` frame, so that
    every target frames it its own way (:func:`mmspec.inputs.chat_prompt`: its chat template; the
    embedded target's frame gives the world's prompt back exactly)."""
    from mmspec.world import make_sample

    fams = tuple(families)
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
    path = getattr(head, "path", None)
    if path is not None:
        return f"recorded in {Path(path) / 'mmspec_head.json'} at training"
    return "the head's own config, held in memory (it was not read from a directory)"


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


@dataclass
class _Measured:
    """What the calibration prompts gave: every block's record, and the feature probes per prompt."""

    blocks: list = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    effects: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(b.n_emitted for b in self.blocks) / max(len(self.blocks), 1)

    def acceptance_by_depth(self, depth: int) -> list[float]:
        """P(draft at depth d + 1 accepted | the block drafted that deep), d = 0..depth - 1."""
        hits, tries = [0] * depth, [0] * depth
        for b in self.blocks:
            for d in range(min(b.drafted_depth, depth)):
                tries[d] += 1
                hits[d] += int(d < b.n_accepted)
        return [h / t if t else 0.0 for h, t in zip(hits, tries)]

    @staticmethod
    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None


def _run(dec, prompts, max_new_tokens: int, probe_features: bool = True) -> _Measured:
    m = _Measured()
    for cp in prompts:
        inputs, images = prompt_inputs(dec, cp)
        res = dec.generate(**inputs, max_new_tokens=max_new_tokens, images=images or None)
        m.blocks += list(res.stats.blocks)
        probed = _feature_probe(dec, inputs, res.token_ids) if probe_features else None
        if probed is not None:
            m.scales.append(probed[0])
            m.effects.append(probed[1])
    return m


def _feature_probe(dec, inputs, answer: list[int]) -> tuple[float, float] | None:
    """At the answer's own positions (what the head predicts while drafting): (RMS of the head's
    prediction of the target's next feature over the true feature's, how much of that prediction
    the token embedding moves: RMS of the change when it is zeroed over the prediction's).
    eagle / msd only (their predictions are in the target's final-state space); the target's
    forward gets every input its family reads, the answer appended."""
    head = dec.head
    n = min(16, len(answer) - 1)
    if head.config.layer == "eagle3" or len(head.config.feature_layers) != 1 or n < 1:
        return None
    fed = _appended(inputs, answer)
    ids = fed["input_ids"]
    with torch.inference_mode():
        out = dec.target_model(**fed, output_hidden_states=True)
        layer = head.config.feature_layers[0]
        hs = out.hidden_states[-1] if layer == -1 else out.hidden_states[layer + 1]  # [1, L, H]; [-1]: post-norm
        L = ids.shape[-1]
        feats, nxt = hs[:, L - n - 1:L - 1], ids[:, L - n:]  # the feature at t, the token at t + 1
        emb = dec.target_model.get_input_embeddings()(nxt).to(head.dtype)
        pos = torch.arange(L - n - 1, L - 1, device=feats.device)[None]
        fused = head.fused(feats.to(head.dtype))
        pred = head(fused, emb, position_ids=pos)
        bare = head(fused, torch.zeros_like(emb), position_ids=pos)
        rms = pred.pow(2).mean().sqrt()
        scale = rms / hs[:, L - n:].pow(2).mean().sqrt().clamp_min(1e-12)
        effect = (pred - bare).pow(2).mean().sqrt() / rms.clamp_min(1e-12)
    return float(scale), float(effect)


def _appended(inputs: dict, answer: list[int]) -> dict:
    """The processor's output for the prompt followed by ``answer``: its ids extended, and each of
    its per-token masks (``attention_mask`` with ones; ``mm_token_type_ids``, ``token_type_ids``:
    text, zeros) extended to match."""
    ids = inputs["input_ids"]
    more = torch.tensor([answer], dtype=ids.dtype, device=ids.device)
    out = {**inputs, "input_ids": torch.cat([ids, more], dim=-1)}
    for k, v in inputs.items():
        if k != "input_ids" and k.endswith(("mask", "type_ids")) and isinstance(v, torch.Tensor) \
                and v.shape == ids.shape:
            out[k] = torch.cat([v, torch.full_like(more, int(k == "attention_mask"), dtype=v.dtype)], dim=-1)
    return out


def measure(dec, prompts: list[CalibrationPrompt], max_new_tokens: int = 24) -> tuple[float, list[float], int]:
    """What :func:`calibrate` starts from, without its probes: (τ, acceptance by depth, tokens) of the
    head of ``dec`` on ``prompts``, greedy, in the chain or tree ``dec`` is set up with."""
    m = _run(dec, prompts, max_new_tokens, probe_features=False)
    return m.tau, m.acceptance_by_depth(dec.tree.max_depth), sum(b.n_emitted for b in m.blocks)


def calibrate(dec, prompts: list[CalibrationPrompt] | None = None, *, max_new_tokens: int = 24,
              probe: bool = True) -> HeadReport:
    """Run the head of ``dec`` (a SpecDecoder drafting with a head, with its processor, in the chain
    or tree it is set up with) on ``prompts`` (default: 4 of the embedded world's) and report. When
    τ is near 1 and ``probe``, rerun with the feature layers shifted by one each way and say whether
    either drafts better; :func:`diagnose` names what the evidence supports."""
    if dec.head is None:
        raise MMSpecError("calibrate checks a feature-level head; this decoder drafts with a draft model")
    if dec.processor is None and not (prompts and all(p.inputs is not None for p in prompts)):
        raise MMSpecError("the head check feeds images through the target's processor: pass processor=...")
    prompts = prompts or world_prompts()
    m = _run(dec, prompts, max_new_tokens)
    c = dec.head.config
    rep = HeadReport(tau=m.tau, acceptance_by_depth=m.acceptance_by_depth(dec.tree.max_depth),
                     feature_layers=tuple(c.feature_layers), layers_from=layers_source(dec.head), prompts=len(prompts),
                     tokens=sum(b.n_emitted for b in m.blocks), shape=dec.tree.label, trained=dict(c.trained or {}),
                     feature_scale=m.mean(m.scales), embedding_effect=m.mean(m.effects))
    shifted = {}
    if rep.tau < NEAR_ONE and probe:
        for layers in neighbour_layers(tuple(c.feature_layers), dec.target.num_layers):
            # on half the prompts: a probe, not a measurement
            shifted[layers] = _shifted_tau(dec, prompts[:max(1, len(prompts) // 2)], max_new_tokens, layers)
    rep.diagnosis, warning = diagnose(rep, shifted, imported=bool(c.source))
    if warning:
        rep.warnings.append(warning)
    return rep


def diagnose(rep: HeadReport, shifted: dict | None = None, imported: bool = False) -> tuple[str, str | None]:
    """The evidence of a calibration -> (the verdict, the warning: None when the head drafts).
    ``shifted``: τ with the feature layers shifted (layers -> τ); ``imported``: a head made
    elsewhere (its training unknown). A head is called broken only on evidence of a fault (a
    shifted layer that drafts, a prediction that ignores the token embedding, predicted features
    far larger than the target's), under-trained where it records too little training or its
    predictions are the small ones of a head that has not learned the features yet, and
    under-trained in depth where its first position drafts and the deeper ones fall apart."""
    acc = rep.acceptance_by_depth
    if rep.tau >= NEAR_ONE:
        lost = _falls_apart(acc)
        if lost is None:
            return f"drafts (tau {rep.tau:.2f}; {_accepted(acc)})", None
        return (f"under-trained in depth: its first position drafts ({acc[0]:.2f} accepted) but acceptance falls "
                f"apart after it ({_accepted(acc)}; below half the first from depth {lost}): the head predicts "
                "from the target's features well and from its own poorly. Train it longer, with the "
                "training-time test unrolled as deep as it drafts (train head --ttt-depth), "
                "or draft a shallower tree / a shorter chain"), None
    found = []
    for layers, t in (shifted or {}).items():
        if t is not None and t >= max(NEAR_ONE, rep.tau * 1.2):
            found.append(f"reading {layer_words(layers)} instead of {layer_words(rep.feature_layers)} gives tau "
                         f"{t:.2f}: its feature-layer ids look off by one")
    if rep.embedding_effect is not None and rep.embedding_effect < 1e-3:
        found.append(f"its prediction does not move with the token embedding (it changes {rep.embedding_effect:.1e} "
                     "of it): the token embedding is missing (a head saved without embed_tokens, or read with zeros)")
    if not found and rep.feature_scale is not None and rep.feature_scale > 2.0:
        found.append(f"its predicted features are {rep.feature_scale:.2f}x the scale of the target's, larger than a "
                     "head that has not learned them predicts: a norm applied twice (or missing) on the features "
                     "it reads or predicts")
    head = f"tau {rep.tau:.2f} is near 1: the head barely drafts (every token costs a target pass)."
    if found:
        verdict = "broken: " + "; ".join(found)
        return verdict, f"{head} Found: {'; '.join(found)}. Other causes to rule out: {'; '.join(CAUSES)}."
    steps = rep.trained.get("steps")
    small = rep.feature_scale is not None and rep.feature_scale < 0.5
    if (steps is not None and steps < FEW_STEPS) or (steps is None and not imported):
        why = (f"it records {steps} training steps (train head's default is {FEW_STEPS})" if steps is not None
               else "it records no training (an untrained head, held in memory)")
        if small:
            why += (f", and its predicted features are {rep.feature_scale:.2f}x the scale of the target's: the small "
                    "predictions of a head that has not learned them yet")
        verdict = f"under-trained: {why}; no fault of its wiring was found. Train it longer (train head --steps, --minutes)"
        short = f"{steps} training steps" if steps is not None else "no training"
        return verdict, (f"{head} It looks under-trained (it records {short}); if more training does not help, "
                         f"rule out: {'; '.join(CAUSES)}.")
    if small:
        why = (f"its predicted features are {rep.feature_scale:.2f}x the scale of the target's: a head that has not "
               "learned them (under-trained, or trained for another target or checkpoint), or a norm missing on "
               "the features it reads")
    else:
        why = "the probes found no fault of its wiring (feature layers, token embedding, feature scale)"
        if steps is not None:
            why += f" and it records {steps} training steps"
    verdict = f"does not draft: {why}"
    return verdict, f"{head} {why}. Likely causes: {'; '.join(CAUSES)}."


def _falls_apart(acc: list[float]) -> int | None:
    """The first depth (1-based) whose acceptance is below FALLS_APART of the first position's,
    when the first position drafts (accepted half the time or more); None: it holds."""
    if not acc or acc[0] < 0.5:
        return None
    return next((d + 1 for d in range(1, len(acc)) if acc[d] < FALLS_APART * acc[0]), None)


def _accepted(acc: list[float]) -> str:
    return "accepted by depth " + " / ".join(f"{a:.2f}" for a in acc)


def neighbour_layers(layers: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """The feature layers a head off by one would have meant: each layer shifted by one each way
    (all of an eagle3 head's together); for a head reading the last layers' output, the final
    (post-norm) state too, and for one reading that state, the last layer's own output (the two
    differ by the final norm). -1 is the final state; only layers of an ``n``-layer target."""
    out = []
    for shift in (-1, 1):
        moved = tuple(n - 1 + shift if i == -1 and shift < 0 else i + shift for i in layers)
        if all(0 <= i < n for i in moved) and not (-1 in layers and shift > 0):
            out.append(moved)
    if len(layers) == 1:
        out.append((n - 1,) if layers == (-1,) else (-1,) if layers[0] >= n - 2 else layers)
    return [x for i, x in enumerate(out) if x != layers and x not in out[:i]]


def layer_words(layers) -> str:
    return ", ".join("the final (post-norm) state" if i == -1 else f"the output of layer {i}" for i in layers)


def _shifted_tau(dec, prompts, max_new_tokens: int, layers: tuple[int, ...]) -> float | None:
    """τ of the same head reading ``layers`` instead, in the decoder's own chain or tree."""
    import copy

    head = copy.deepcopy(dec.head)
    head.config = replace(dec.head.config, feature_layers=layers)
    other = type(dec)(dec.target_model, head, dec.tokenizer, processor=dec.processor, tree=dec.tree,
                      prefix_cache_mb=0)  # the TreeSpec carries the shape (a chain: its length)
    m = _run(other, prompts, max_new_tokens, probe_features=False)
    return m.tau if m.blocks else None


def tau_ok(report: HeadReport) -> bool:
    return math.isfinite(report.tau) and report.tau >= NEAR_ONE
