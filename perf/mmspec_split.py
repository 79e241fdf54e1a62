"""Write an MMSpec-format split from the embedded world's images, for ``mmspec bench run -d mmspec=DIR``.

MMSpec's own data (``killthefullmoon/MMSpec``: GQA, TextVQA, COCO, CharXiv, MMMU-Pro, ConvBench /
MM-MT-Bench pictures) is what a user with a 7B checkpoint runs; the embedded pack knows only its
synthetic world, so this writes a split of the same schema from it: ``OUT/{split}/mmspec.jsonl``
(``id``, ``image`` under ``images/``, ``turns``, ``category``, ``topic``) and ``OUT/{split}/images/``.
Its six categories map onto world families (``--n`` samples each, 2-3 turns)::

    general_vqa        vqav2 conversations (a counting question, then another about the same picture)
    text_vqa           textvqa conversations
    chart_vqa          chartqa conversations
    image_captioning   vqav2 pictures: "Describe the image.", then its question
    complex_reasoning  hallusionbench questions, then "Explain your answer."
    multi_turn         conversations of every base family, three turns

Turn 1 carries the world's instruction ("For the following question, provide a detailed
explanation ...", the embedded target's own prompt wording), later turns are bare questions, as
MMSpec's are. The rows put the task in ``topic`` and a short description in ``category``, as
MMSpec's published rows do. Deterministic (the world's test split).

    python perf/mmspec_split.py --out runs/mmspec-world --n 8
    mmspec bench run --out runs/mmspec-emb -d mmspec=runs/mmspec-world -n 8 -m M,M+tree,lookup,suffix \
        --batch-size 1,8 --no-latency
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmspec.prompt import QA_INSTRUCTION
from mmspec.world import make_conversation, make_sample

CONVERSATION_BASE = {"chartqa": 0, "textvqa": 1, "vqav2": 2}  # make_conversation(i) builds on BASE[i % 3]


def rows_for(category: str, n: int) -> list[tuple[object, list[str], str]]:
    """``n`` (image, turns, description) of one category."""
    out = []
    if category in ("general_vqa", "text_vqa", "chart_vqa"):
        base = {"general_vqa": "vqav2", "text_vqa": "textvqa", "chart_vqa": "chartqa"}[category]
        for k in range(n):
            c = make_conversation("test", 3 * k + CONVERSATION_BASE[base])
            out.append((c.images[0], [f"{QA_INSTRUCTION} {c.question1}", c.question2], f"{base} picture"))
    elif category == "image_captioning":
        for k in range(n):
            s = make_sample("vqav2", "test", 100 + k)
            out.append((s.images[0], ["Describe the image.", s.question], "shapes"))
    elif category == "complex_reasoning":
        for k in range(n):
            s = make_sample("hallusionbench", "test", k)
            out.append((s.images[0], [f"{QA_INSTRUCTION} {s.question}", "Explain your answer."], "figure"))
    else:  # multi_turn
        for k in range(n):
            c = make_conversation("test", 200 + k)
            out.append((c.images[0], [f"{QA_INSTRUCTION} {c.question1}", c.question2,
                                      f"{QA_INSTRUCTION} {c.question1}"], f"{c.base_family} conversation"))
    return out


CATEGORIES = ("general_vqa", "text_vqa", "image_captioning", "chart_vqa", "complex_reasoning", "multi_turn")


def write_split(out: Path, n: int, split: str = "test") -> Path:
    """The split's ``mmspec.jsonl`` path, written with its images."""
    folder = Path(out) / split
    lines, i = [], 0
    for cat in CATEGORIES:
        (folder / "images" / cat).mkdir(parents=True, exist_ok=True)
        for image, turns, description in rows_for(cat, n):
            i += 1
            uid = f"img_{i:06d}"
            image.save(folder / "images" / cat / f"{uid}.png")
            lines.append({"id": uid, "image": f"{cat}/{uid}.png", "turns": turns, "category": description,
                          "topic": cat.replace("_", " ")})
    path = folder / "mmspec.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder to write SPLIT/mmspec.jsonl and SPLIT/images/ into")
    ap.add_argument("--n", type=int, default=8, help="samples per category (MMSpec: 100)")
    ap.add_argument("--split", default="test")
    args = ap.parse_args(argv)
    path = write_split(args.out, args.n, args.split)
    print(f"wrote {path} ({6 * args.n} samples)")


if __name__ == "__main__":
    main()
