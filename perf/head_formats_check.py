"""External proof of mmspec's head formats: an mmspec-exported EAGLE-3 head loaded by
``speculators`` (vLLM's format library: its converter, its config, its ``Eagle3DraftModel``)
scores the same logits as mmspec; an exported EAGLE-1/2 head loads (strictly) into SafeAILab's
own ``eagle.model.cnets.Model`` (the ``eagle-llm`` package) and scores the same logits too.

Two processes, because speculators pins transformers <= 5.19 while mmspec runs on the project's:

1. ``python perf/head_formats_check.py --venv /tmp/specvenv [--out DIR]`` (mmspec's environment)
   builds a tiny 8-layer Llama target, an eagle3 head reading NON-default layers (0, 2, 5) over a
   draft vocabulary of 200 of its 512 tokens, exports it with ``mmspec export head``, an eagle
   head with ``--format eagle``, and records mmspec's inputs and draft logits;
2. it then runs itself with ``--phase reference`` in the venv, where only speculators /
   eagle-llm / transformers code computes: the target's features from transformers'
   ``output_hidden_states`` at speculators' layer ids, and the heads' logits.

The venv: ``python -m venv /tmp/specvenv && /tmp/specvenv/bin/pip install torch==2.13.0
speculators==0.9.0 transformers==5.19.0 && /tmp/specvenv/bin/pip install --no-deps eagle-llm``;
then ``/tmp/specvenv/bin/pip uninstall -y torchvision torchaudio``: the torchvision it pulls in is
built for another torch and breaks ``import transformers`` (``torchvision::nms does not exist``).
Writes ``check.json`` (and prints it) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

V, H, N_LAYERS, DRAFT = 512, 128, 8, 200
FEATURE_LAYERS = (0, 2, 5)  # not the engines' default (1, 3, 4): the layer-id conventions are exercised


# --------------------------------------------------------------------------- phase 1: mmspec
def _target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=N_LAYERS,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def _randomise(head, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 1.0))
    return head


def mmspec_phase(work: Path, venv: Path) -> dict:
    from mmspec.heads import build_head, load_head
    from mmspec.heads.formats import load_external_head
    from mmspec.models.base import adapter_for

    target = _target()
    target.save_pretrained(work / "target")
    adapter = adapter_for(target)
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:DRAFT].sort().values
    e3 = _randomise(build_head(target, "eagle3", feature_layers=FEATURE_LAYERS, draft_vocab=vocab), 2)
    e1 = _randomise(build_head(target, "eagle"), 3)
    e3.save(work / "mine-eagle3")
    e1.save(work / "mine-eagle")
    cli = [sys.executable, "-m", "mmspec", "export", "head"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    subprocess.run(cli + [str(work / "mine-eagle3"), "--format", "eagle3", "--out", str(work / "eagle3")],
                   check=True, env=env)
    subprocess.run(cli + [str(work / "mine-eagle"), "--format", "eagle", "--out", str(work / "eagle"),
                          "--target", str(work / "target")], check=True, env=env)

    from transformers import DynamicCache

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (1, 24), generator=g)  # [1, n]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        _, feats = adapter.forward(cache=DynamicCache(config=target.config), attention_mask=torch.ones_like(ids),
                                   position_ids=pos, input_ids=ids, hidden=FEATURE_LAYERS + (-1,))  # [1, n, 4H]
        low_mid_high, final = feats[..., :3 * H], feats[..., 3 * H:]
        nxt = torch.randint(3, V, (1, ids.shape[1]), generator=g)  # the token after each slot
        emb = target.get_input_embeddings()(nxt)
        lm = target.get_output_embeddings()
        logits3 = e3.logits(e3(e3.fused(low_mid_high), emb, position_ids=pos), lm)  # [1, n, V]
        logits1 = e1.logits(e1(e1.fused(final), emb, position_ids=pos), lm)
    from safetensors.torch import save_file

    save_file({"ids": ids, "next": nxt, "features": low_mid_high.contiguous(), "final": final.contiguous(),
               "logits_eagle3": logits3.contiguous(), "logits_eagle": logits1.contiguous()}, str(work / "io.safetensors"))

    timings = {}
    for name, load in (("mmspec directory (load_head)", lambda: load_head(work / "mine-eagle3", target)),
                       ("EAGLE-3 export (load_external_head)", lambda: load_external_head(work / "eagle3", target)),
                       ("EAGLE-1/2 export (load_external_head)", lambda: load_external_head(work / "eagle", target))):
        load()  # warm: imports
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            load()
            t.append(time.perf_counter() - t0)
        timings[name] = round(1000 * sorted(t)[len(t) // 2], 2)
    back = load_external_head(work / "eagle3", target)
    with torch.no_grad():
        again = back.logits(back(back.fused(low_mid_high), emb, position_ids=pos), lm)
    out = subprocess.run([str(venv / "bin" / "python"), __file__, "--phase", "reference", "--work", str(work)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the reference phase failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    ref = json.loads(out.stdout.strip().splitlines()[-1])
    import transformers

    return {"mmspec": {"transformers": transformers.__version__, "torch": torch.__version__,
                       "round_trip_identical": bool(torch.equal(logits3, again)),
                       "head_load_ms_median_of_5": timings,
                       "target": f"LlamaForCausalLM, {N_LAYERS} layers, hidden {H}, vocab {V}, float32, random",
                       "eagle3_head": {"feature_layers": list(FEATURE_LAYERS), "draft_vocab": DRAFT}},
            **ref}


# --------------------------------------------------------------------------- phase 2: the references
def reference_phase(work: Path) -> dict:
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    io = load_file(str(work / "io.safetensors"))
    target = AutoModelForCausalLM.from_pretrained(str(work / "target"), dtype=torch.float32).eval()
    ids, nxt = io["ids"], io["next"]
    n = ids.shape[1]
    pos = torch.arange(n)[None]
    result = {"reference": {"transformers": transformers.__version__, "torch": torch.__version__}}
    result["speculators"] = _speculators(work, io, target, ids, nxt, pos)
    result["eagle_llm"] = _eagle_llm(work, io, target, nxt)
    return result


def _speculators(work, io, target, ids, nxt, pos) -> dict:
    import importlib.metadata as md

    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = json.loads((work / "eagle3" / "config.json").read_text())
    # speculators' converter takes the layer ids as an argument (its CLI flag); pass the export's own field
    Eagle3Converter().convert(work / "eagle3", work / "speculators", base_model=str(work / "target"),
                              eagle_aux_hidden_state_layer_ids=cfg["eagle_aux_hidden_state_layer_ids"])
    scfg = Eagle3SpeculatorConfig.from_pretrained(str(work / "speculators"))
    scfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(work / "speculators"), config=scfg).float().eval()
    layer_ids = list(model.config.eagle_aux_hidden_state_layer_ids)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # engines share the target's
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states  # (embeddings, layer 0 out, ...)
        feats = torch.cat([hs[j] for j in layer_ids], dim=-1)  # speculators' / vLLM's ids index this tuple
        x = torch.cat([model.embed_tokens(nxt), model.fc(feats)], dim=-1)  # [1, n, 2H]
        mask = torch.full((n := ids.shape[1], n), float("-inf")).triu(1)[None, None]
        h = model.layers[0](x, attention_mask=mask, position_ids=pos,
                            position_embeddings=model.rotary_emb(x, pos))
        small = model.lm_head(model.norm(h))  # [1, n, V_draft]
        full = torch.full((*small.shape[:-1], V), float("-inf"))
        full[..., torch.arange(small.shape[-1]) + model.d2t] = small
        tokens = model(hidden_states=feats, input_ids=nxt, document_ids=torch.zeros_like(nxt), position_ids=pos,
                       ttt_steps=1)[0]  # their own forward: argmax over the draft vocabulary
    mine = io["logits_eagle3"]
    finite = torch.isfinite(mine)
    return {"version": md.version("speculators"), "converted_architectures": model.config.architectures,
            "aux_layer_ids_read": layer_ids,
            "features_equal_mmspec_within": float((feats - io["features"]).abs().max()),
            "same_draft_vocabulary": bool(torch.equal(finite, torch.isfinite(full))),
            "max_abs_logit_diff": float((full[finite] - mine[finite]).abs().max()),
            "max_abs_logit": float(mine[finite].abs().max()),
            "forward_argmax_equal": bool(torch.equal(model.d2t[tokens] + tokens, mine.argmax(-1)))}


def _eagle_llm(work, io, target, nxt) -> dict:
    import importlib.metadata as md

    try:
        from eagle.model.cnets import Model
        from eagle.model.configs import EConfig
    except Exception as e:  # noqa: BLE001 - its code targets transformers 4.x: report whatever stops it
        return {"loaded": False, "why": f"{type(e).__name__}: {e}"[:300]}
    cfg = EConfig.from_pretrained(str(work / "eagle"))
    file_cfg = json.loads((work / "eagle" / "config.json").read_text())
    cfg.rope_scaling = file_cfg["rope_scaling"]  # transformers 5 fills in a dict; the file (and EAGLE) say null
    model = Model(cfg, bias=json.loads((work / "eagle" / "config.json").read_text()).get("bias", True))
    missing = model.load_state_dict(torch.load(work / "eagle" / "pytorch_model.bin", weights_only=True), strict=True)
    model = model.float().eval()
    try:
        with torch.no_grad():
            out = model(io["final"], input_ids=nxt)
            logits = target.get_output_embeddings()(out[0] if isinstance(out, tuple) else out)
    except Exception as e:  # noqa: BLE001 - a report, not a crash, whatever stops the old code
        return {"version": md.version("eagle-llm"), "loaded_strict": not (missing.missing_keys or missing.unexpected_keys),
                "scored": False, "why": f"{type(e).__name__}: {e}"[:300]}
    return {"version": md.version("eagle-llm"), "loaded_strict": True, "scored": True,
            "max_abs_logit_diff": float((logits - io["logits_eagle"]).abs().max()),
            "max_abs_logit": float(io["logits_eagle"].abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="mmspec", choices=["mmspec", "reference"])
    ap.add_argument("--venv", default="/tmp/specvenv")
    ap.add_argument("--work", default="/tmp/head-formats-check")
    ap.add_argument("--out", default=None, help="Directory for check.json (default: print only).")
    a = ap.parse_args()
    work = Path(a.work)
    if a.phase == "reference":
        print(json.dumps(reference_phase(work)))
        return
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"--work {work} is not empty; give a new directory")
    work.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
                      f"Python {platform.python_version()}".replace("  ", " "),
           **mmspec_phase(work, Path(a.venv))}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "check.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
