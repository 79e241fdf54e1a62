"""The video pair on the world's video clips: the event view (E) against M (the draft reads the
frames), T (text only) and the target alone, in ONE interleaved run, with the draft-side
encoding time split out.

Owns: the round-robin timing of those systems on test clips (every output checked against the
target's greedy output), tau per system, and a micro-benchmark of what the draft pays to read a
clip: its vision tower + projector on the frames, against simulating the DVS events, binning
them and running the substitute encoder. Models: ``mmspec train video`` output (target/, draft/)
and an encoder from ``mmspec train align --draft OUT/draft``. Run ``python perf/video_speed.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mmspec.provenance import machine_info, now
from mmspec.timing import median_time


def run(args) -> dict:
    from transformers import AutoProcessor, VideoLlavaForConditionalGeneration

    from mmspec import SpecDecoder
    from mmspec.events import event_stats, simulate_dvs
    from mmspec.models.base import adapter_for
    from mmspec.models.substitute import load_substitute_encoder
    from mmspec.substitutes import DEFAULT_BINS, Substitute, make_substitute
    from mmspec.world import make_video_sample
    from mmspec.world.processor import clip_inputs

    torch.set_num_threads(args.threads)
    root = Path(args.pair)
    proc = AutoProcessor.from_pretrained(root / "target")
    tok, ip = proc.tokenizer, proc.image_processor
    target = VideoLlavaForConditionalGeneration.from_pretrained(root / "target", dtype=torch.float32).eval()
    draft = VideoLlavaForConditionalGeneration.from_pretrained(root / "draft", dtype=torch.float32).eval()
    enc = load_substitute_encoder(args.encoder).float()
    vid = target.config.video_token_index
    per_frame = target.config.video_seq_length // args.n_frames
    clips = [make_video_sample(f, "test", i) for f in args.families.split(",") for i in range(args.n)]
    inputs = [clip_inputs(s, tok, ip, vid, args.n_frames, per_frame) for s in clips]
    decs = {v: SpecDecoder(target, draft, tok, views=v, gamma=args.gamma, substitute=enc if "E" in v else None,
                           prefix_cache_mb=0)
            for v in args.views.split(",")}

    def target_alone(i):
        ids = inputs[i]["input_ids"][None]
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.max_new_tokens, pixel_values_videos=inputs[i]["pixel_values_videos"])
        return out[0, ids.shape[1]:].tolist(), None

    def spec(v):
        def go(i):
            r = decs[v].generate(inputs[i]["input_ids"][None], pixel_values_videos=inputs[i]["pixel_values_videos"],
                                 videos=[clips[i].frames], max_new_tokens=args.max_new_tokens)
            return r.token_ids, r.stats
        return go

    systems = {"target": target_alone, **{f"mmspec_{v}": spec(v) for v in decs}}
    names = list(systems)
    for n in names:  # warm-up
        systems[n](0)
    wall = {n: [0.0] * args.repeats for n in names}
    toks = {n: [0] * args.repeats for n in names}
    blocks, split, ref, bad = {n: 0 for n in names}, {n: {"vision_s": 0.0, "substitute_s": 0.0} for n in names}, {}, []
    with torch.inference_mode():
        for r in range(args.repeats):
            for i in range(len(clips)):
                shift = (r + i) % len(names)
                for n in names[shift:] + names[:shift]:
                    t0 = time.perf_counter()
                    ids, st = systems[n](i)
                    wall[n][r] += time.perf_counter() - t0
                    toks[n][r] += len(ids)
                    if n == "target":
                        ref[(r, i)] = ids
                    elif r == 0:
                        blocks[n] += st.n_blocks
                        split[n]["vision_s"] += st.vision_s
                        split[n]["substitute_s"] += st.substitute_s
                    if n != "target" and (r, i) in ref and ids != ref[(r, i)]:
                        bad.append({"system": n, "clip": clips[i].uid, "repeat": r})
            print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
    tps = {n: statistics.median(t / w for t, w in zip(toks[n], wall[n])) for n in names}
    tower = adapter_for(target)  # target.generate does not split out its vision time: its tower, timed apart
    with torch.inference_mode():
        split["target"]["vision_s"] = sum(
            median_time(lambda pv=x["pixel_values_videos"]: tower.encode({"pixel_values_videos": pv}),
                        torch.device("cpu"), 5, 1) for x in inputs)
    rows = [{"system": n, "tokens_per_s": tps[n], "speedup_vs_target": tps[n] / tps["target"],
             "tau": toks[n][0] / blocks[n] if blocks.get(n) else None,
             "vision_s_per_clip": split[n]["vision_s"] / len(clips),
             "substitute_s_per_clip": None if n == "target" else split[n]["substitute_s"] / len(clips)}
            for n in names]

    # what the draft pays to read one clip: its tower + projector on the frames, vs events
    d = adapter_for(draft)
    pv = inputs[0]["pixel_values_videos"]
    frames = clips[0].frames
    with torch.inference_mode():
        t_video = median_time(lambda: d.encode({"pixel_values_videos": pv}), torch.device("cpu"), 20, 3)
        t_events = median_time(lambda: enc(make_substitute(frames, enc.config.kind, **enc.config.opts).tensor),
                               torch.device("cpu"), 20, 3)
        stream = simulate_dvs(frames, **{k: v for k, v in enc.config.opts.items() if k != "n_bins"})
        n_bins = enc.config.opts.get("n_bins", DEFAULT_BINS)
        t_recorded = median_time(lambda: enc(Substitute.from_events(stream, n_bins).tensor), torch.device("cpu"), 20, 3)
        sub = make_substitute(frames, enc.config.kind, **enc.config.opts).tensor
        t_encoder = median_time(lambda: enc(sub), torch.device("cpu"), 20, 3)
    stats = event_stats(stream, n_frames=len(frames))
    result = {"date": now(), "machine": machine_info("cpu"),
              "command": " ".join(["python", "perf/video_speed.py", *sys.argv[1:]]),
              "clips": [c.uid for c in clips], "identical": not bad, "mismatches": bad[:20], "rows": rows,
              "draft_encoding_s": {"video_tower_and_projector": t_video, "events_simulate_bin_encode": t_events,
                                   "events_encoder_only": t_encoder,
                                   "events_recorded_bin_encode": t_recorded, "ratio_recorded_over_video": t_recorded / t_video, "ratio_events_over_video": t_events / t_video,
                                   "ratio_encoder_over_video": t_encoder / t_video},
              "event_density": {k: v for k, v in stats.__dict__.items() if isinstance(v, (int, float))}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "video_speed.json").write_text(json.dumps(result, indent=1))
    (out / "video_speed.md").write_text(markdown(result))
    print(markdown(result))
    return result


def _fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(r: dict) -> str:
    lines = [f"# Video pair: event view vs M, T and the target ({r['date']})", "", f"- command: `{r['command']}`",
             f"- machine: {r['machine']['platform']}, {r['machine']['cpu_count']} CPUs, torch {r['machine']['torch']}",
             f"- clips: {len(r['clips'])}; outputs identical to the target: **{'YES' if r['identical'] else 'NO'}**", "",
             "| system | tokens/s | vs target | τ | vision encoding ms/clip (target's; + draft's in M) | "
             "draft substitute ms/clip |", "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['system']} | {x['tokens_per_s']:.1f} | {x['speedup_vs_target']:.2f}x | {_fmt(x['tau'])} | "
                     f"{_fmt(x['vision_s_per_clip'], 1e3, 1)} | {_fmt(x['substitute_s_per_clip'], 1e3, 1)} |")
    lines += ["", "The target's vision encoding is its tower and projector on each clip, timed apart "
                  "(`target.generate` does not split it out); a substitute is the draft's, E views only."]
    e = r["draft_encoding_s"]
    lines += ["", f"Draft-side encoding of one clip (median of 20): vision tower + projector on the frames "
                  f"{e['video_tower_and_projector'] * 1e3:.2f} ms; events (simulate + bin + encoder) "
                  f"{e['events_simulate_bin_encode'] * 1e3:.2f} ms (**{e['ratio_events_over_video']:.2f}x**; the simulation "
                  f"stands in for the sensor); a recorded stream (a camera's), binned and encoded "
                  f"{e['events_recorded_bin_encode'] * 1e3:.2f} ms (**{e['ratio_recorded_over_video']:.2f}x**); "
                  f"the encoder alone on binned events {e['events_encoder_only'] * 1e3:.2f} ms "
                  f"(**{e['ratio_encoder_over_video']:.2f}x**)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", required=True, help="mmspec train video --out DIR (target/, draft/)")
    ap.add_argument("--encoder", required=True, help="mmspec train align --out DIR")
    ap.add_argument("--families", default="motion,order")
    ap.add_argument("--n", type=int, default=5, help="test clips per family")
    ap.add_argument("--n-frames", type=int, default=4)
    ap.add_argument("--views", default="M,T,E,TE")
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/video-speed")
    return ap.parse_args(argv)


if __name__ == "__main__":
    r = run(parse_args())
    sys.exit(0 if r["identical"] else 1)
