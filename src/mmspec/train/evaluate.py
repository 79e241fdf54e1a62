"""Quality of the embedded models on the world's test split (the embedded-world issue's goals).

* answer fact recall: share of a sample's image-dependent facts whose value appears verbatim,
  as whole words (``1`` does not match ``10``; case ignored), in the target's greedy answer,
  per family and per kind of fact, and for yes/no questions the verdict the answer ends on
  (:func:`verdict`) against the true one (:func:`tally_facts`); a yes/no ``answer`` fact is
  stated only by that verdict. It counts facts stated anywhere, and the world's answers list a
  scene's values before answering, so it also credits a right listing followed by a wrong answer;
* question accuracy (single-image families, whose samples ask one question): the share of
  questions whose final sentence states the *asked* fact, the first of ``Sample.facts``, which
  the reference answer's final sentence gives (:func:`answers_question`); for yes/no
  questions, the verdict the answer ends on;
* caption fact rate: share of the facts a ground-truth caption states (per image) that the
  captioner's caption also states (the same whole-word rule, :func:`states`, which the
  training-time check in :func:`fact_recall` uses too);
* multimodal vs text-only block efficiency per family, from the same results.

The answers are read from a ``mmspec bench run`` results dir (its baseline rows are the
target's own greedy answers on test samples), so the numbers and the block-efficiency table
come from one run; or generated directly by a model (:func:`model_fact_recall`, ``mmspec train
facts``), also in the caption view, where the facts are in the prompt as text and only the
LM's copying is tested.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from mmspec.errors import MMSpecError
from mmspec.world.core import sentences


def _sample_index(uid: str) -> tuple[str, str, int]:
    m = re.fullmatch(r"(.+)-(train|val|test)-(\d+)", uid)
    if not m:
        raise MMSpecError(f"row uid {uid!r} is not a world sample id (family-split-index)")
    return m.group(1), m.group(2), int(m.group(3))


# a position stated as part of a wider one is not stated: "top left" says neither "top" nor "left"
_NOT_AFTER = {"left": r"(?<!top )(?<!bottom )", "right": r"(?<!top )(?<!bottom )"}
_NOT_BEFORE = {"top": r"(?! (?:left|right)\b)", "bottom": r"(?! (?:left|right)\b)"}


def states(text: str, value) -> bool:
    """Whether ``text`` states the fact ``value`` as whole words, case ignored. A grid position
    counts only where it is not part of a wider one ("top" is not stated by "top left")."""
    v = str(value).lower()
    pattern = _NOT_AFTER.get(v, "") + r"(?<!\w)" + re.escape(v) + r"(?!\w)" + _NOT_BEFORE.get(v, "")
    return re.search(pattern, text.lower()) is not None


def verdict(text: str) -> str:
    """The yes/no verdict an answer ends on: its last whole-word "yes" or "no" (``"Yes"``,
    ``"No"``), or ``"none"``. Stricter than :func:`states`, which also counts the "no" of
    "there is no X" as stating the answer No."""
    words = re.findall(r"(?<!\w)(yes|no)(?!\w)", text.lower())
    return words[-1].capitalize() if words else "none"


def final_sentence(text: str) -> str:
    """The last sentence of an answer (all of it when it has one sentence or none ends), by the
    world's one sentence rule (:func:`mmspec.world.core.sentences`)."""
    return sentences(text)[-1]


def finished(text: str) -> bool:
    """Whether an answer ends a sentence (one cut at max_new_tokens mid-sentence does not)."""
    return text.rstrip().endswith((".", "!", "?"))


def answers_question(sample, text: str) -> bool:
    """Whether ``text`` answers ``sample``'s question right: its final sentence states the asked
    fact (the first of ``sample.facts``; the world's reference answers give it there), or, for a
    yes/no question, the answer ends on the true verdict. Listing the scene right and then
    answering wrong ("... bus 6 ... The answer is bus 10.") does not count, nor does an answer
    cut off before it finished its last sentence (it never gave its answer)."""
    if not finished(text):
        return False
    key, value = next(iter(sample.facts.items()))
    if key == "answer" and value in ("Yes", "No"):
        return verdict(text) == value
    return states(final_sentence(text), value)


def fact_kind(key: str) -> str:
    """A fact's kind: its key without a trailing index (``object_2`` -> ``object``)."""
    return re.sub(r"_\d+$", "", key)


def tally_facts(answers) -> dict[str, dict]:
    """Per family, from ``(sample, answer text)`` pairs: the share of the samples' facts the
    answers state (:func:`states`), also by fact kind (``by_fact``: chart value vs label vs
    colour, sign word vs colour...); families whose samples ask a question also get
    ``questions``: the share answered right (:func:`answers_question`), also by the asked
    fact's kind; families with yes/no questions also get ``verdicts``:
    true answer -> {verdict the answer ends on (:func:`verdict`): count}. A yes/no ``answer``
    fact is hit only by the verdict the answer ends on: an answer saying "yes, ..." and then
    "So the answer is No." must not count for both truths."""
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # facts hit, facts, samples
    kinds: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # hit, total
    asked: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # kind -> right, n
    unfinished: dict[str, int] = defaultdict(int)  # questions whose answer was cut off (counted wrong)
    verdicts: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)  # family -> truth -> verdict -> n
    for sample, text in answers:
        family = sample.family
        h = hits[family]
        said = verdict(text)
        for key, value in sample.facts.items():
            hit = int(said == value if key == "answer" and value in ("Yes", "No") else states(text, value))
            h[0] += hit
            h[1] += 1
            k = kinds[family][fact_kind(key)]
            k[0] += hit
            k[1] += 1
        h[2] += 1
        if sample.question is not None and sample.facts:
            q = asked[family][fact_kind(next(iter(sample.facts)))]
            q[0] += answers_question(sample, text)
            q[1] += 1
            unfinished[family] += not finished(text)
        truth = sample.facts.get("answer")
        if truth in ("Yes", "No"):
            verdicts[family].setdefault(truth, {"Yes": 0, "No": 0, "none": 0})[said] += 1

    def questions(f: str) -> dict:
        n = sum(v[1] for v in asked[f].values())
        return {"right": sum(v[0] for v in asked[f].values()) / n, "questions": n, "unfinished": unfinished[f],
                "by_asked": {k: {"right": v[0] / v[1], "questions": v[1]} for k, v in sorted(asked[f].items())}}

    return {f: {"recall": h[0] / max(h[1], 1), "hits": h[0], "facts": h[1], "samples": h[2],
                "by_fact": {k: {"recall": v[0] / v[1], "facts": v[1]} for k, v in sorted(kinds[f].items())},
                **({"questions": questions(f)} if asked[f] else {}),
                **({"verdicts": verdicts[f]} if f in verdicts else {})}
            for f, h in hits.items()}


def answer_fact_recall(results_dir: str | Path, method: str | None = None) -> dict[str, dict]:
    """:func:`tally_facts` of the target's greedy answers in a benchmark run (its baseline rows),
    or of one method's answers (``method``: e.g. a lossy ``+relaxed`` one, to compare)."""
    from mmspec.bench.store import iter_kind, merge_rows
    from mmspec.world import FAMILIES, make_sample

    rows, _ = merge_rows(Path(results_dir))
    answers = []
    picked = iter_kind(rows, "baseline") if method is None else (r for r in iter_kind(rows, "spec")
                                                                 if r["method"] == method)
    for row in picked:
        if row["dataset"] not in FAMILIES:
            continue
        family, split, index = _sample_index(row["uid"])
        answers.append((make_sample(family, split, index), row["text"]))
    if not answers:
        what = "baseline rows" if method is None else f"rows of method {method!r}"
        raise MMSpecError(f"no world {what} in {results_dir}; run `mmspec bench run --out {results_dir}` first")
    return tally_facts(answers)


def model_answers(model, encoder, image_processor, samples: Sequence, view: str = "multimodal",
                  max_new_tokens: int = 128, device: str = "cpu", tokens_per_image: int = 64,
                  progress: bool = False, desc: str = "answers") -> list[tuple]:
    """``(sample, greedy answer text)`` for each world sample, the images seen through ``view``."""
    from tqdm import tqdm

    from mmspec.train.data import example_from_sample
    from mmspec.train.recipe import greedy_answer

    out = []
    for sample in tqdm(samples, desc=desc, disable=not progress):
        ids = greedy_answer(model, encoder, image_processor, example_from_sample(sample), tokens_per_image,
                            max_new_tokens, device, view=view)
        out.append((sample, encoder.tokenizer.decode(ids, skip_special_tokens=True)))
    return out


def fact_recall(model, encoder, image_processor, samples: Sequence, max_new_tokens: int = 64,
                device: str = "cpu", tokens_per_image: int = 64) -> dict:
    """Share of world facts the greedy answer states (held-out samples), with the same whole-word
    rule as the test-split figures (:func:`tally_facts`)."""
    table = tally_facts(model_answers(model, encoder, image_processor, samples, "multimodal", max_new_tokens,
                                      device, tokens_per_image))
    hit = sum(r["hits"] for r in table.values())
    total = sum(r["facts"] for r in table.values())
    return {"recall": hit / max(total, 1), "per_family": {f: round(r["recall"], 3) for f, r in table.items()}}


def model_fact_recall(model, encoder, image_processor, families: Sequence[str], n_per_family: int,
                      view: str = "multimodal", split: str = "test", max_new_tokens: int = 128,
                      device: str = "cpu", tokens_per_image: int = 64, progress: bool = True) -> dict[str, dict]:
    """:func:`tally_facts` of ``model``'s greedy answers on the first ``n_per_family`` samples of
    each family's ``split``, without a benchmark run. ``view="caption"`` replaces each image by
    its ground-truth caption, so the facts are in the prompt as text: what the LM states then
    measures whether it copies and binds facts from its context, with the vision tower out of
    the question."""
    from mmspec.world import generate_samples

    if view not in ("multimodal", "caption"):
        raise MMSpecError(f"unknown view {view!r}; use multimodal or caption")
    answers = []
    for family in dict.fromkeys(families):  # each family once, in the given order
        answers += model_answers(model, encoder, image_processor, list(generate_samples(family, split, n_per_family)),
                                 view, max_new_tokens, device, tokens_per_image, progress, f"facts {family}")
    return tally_facts(answers)


def caption_fact_rate(captioner, n_per_family: int = 50, split: str = "test") -> dict[str, dict]:
    """Per family: of the fact values a ground-truth caption contains, the share the
    captioner's caption of the same image contains too."""
    from tqdm import tqdm

    from mmspec.world import FAMILIES, generate_samples

    out = {}
    for family in tqdm(list(FAMILIES), desc="captions"):
        hit = total = 0
        for sample in generate_samples(family, split, n_per_family):
            produced = captioner.caption(sample.images)
            for truth, cap in zip(sample.captions, produced):
                for value in sample.facts.values():
                    if states(truth, value):
                        total += 1
                        hit += int(states(cap, value))
        out[family] = {"rate": hit / max(total, 1), "facts": total, "samples": n_per_family}
    return out


def view_block_efficiency(results_dir: str | Path, methods: tuple[str, ...] = ("M", "T")) -> dict[str, dict]:
    """tau (bonus/recovered token included) per family for the given methods."""
    from mmspec.bench.metrics import all_metrics
    from mmspec.bench.store import merge_rows

    rows, _ = merge_rows(Path(results_dir))
    table: dict[str, dict] = defaultdict(dict)
    for m in all_metrics(rows):
        if m.method in methods:
            table[m.dataset][m.method] = m.tau
    return dict(table)
