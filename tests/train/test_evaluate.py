"""The embedded-quality metrics: each can report success and failure."""

import pytest

from mmspec.bench.store import RowWriter, results_path
from mmspec.train.evaluate import answer_fact_recall, caption_fact_rate, fact_recall
from mmspec.world import make_sample


def _write(tmp_path, texts):
    w = RowWriter(results_path(tmp_path, 0))
    for i, text in enumerate(texts):
        w.append({"kind": "baseline", "dataset": "chartqa", "uid": f"chartqa-test-{i}", "method": "",
                 "text": text, "token_ids": [], "wall_s": 0.1})
    w.close()


def test_answer_fact_recall_right_and_wrong(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    _write(good, [make_sample("chartqa", "test", i).answer for i in range(3)])
    assert answer_fact_recall(good)["chartqa"]["recall"] == 1.0
    assert set(answer_fact_recall(good)["chartqa"]["by_fact"]) == {"label", "value", "colour"}
    bad = tmp_path / "bad"
    bad.mkdir()
    _write(bad, ["I cannot tell."] * 3)
    r = answer_fact_recall(bad)["chartqa"]
    assert r["recall"] == 0.0 and r["samples"] == 3
    assert all(k["recall"] == 0.0 for k in r["by_fact"].values())
    assert sum(k["facts"] for k in r["by_fact"].values()) == r["facts"]
    half = tmp_path / "half"
    half.mkdir()
    s = [make_sample("chartqa", "test", i) for i in range(2)]  # both state a label, a value and a colour
    _write(half, [f"It is {x.facts['value']} and {x.facts['label']}." for x in s])  # the colour left out
    by = answer_fact_recall(half)["chartqa"]["by_fact"]
    assert by["colour"]["recall"] == 0.0 and by["value"]["recall"] == 1.0 and by["label"]["recall"] == 1.0


def test_a_methods_own_fact_recall_next_to_the_targets(tmp_path):
    """For a lossy method (+relaxed): its answers are tallied apart from the target's."""
    _write(tmp_path, [make_sample("chartqa", "test", i).answer for i in range(2)])
    w = RowWriter(results_path(tmp_path, 1))
    for i in range(2):
        w.append({"kind": "spec", "dataset": "chartqa", "uid": f"chartqa-test-{i}", "method": "M+relaxed",
                  "text": "I cannot tell.", "token_ids": [], "wall_s": 0.1})
    w.close()
    assert answer_fact_recall(tmp_path)["chartqa"]["recall"] == 1.0
    assert answer_fact_recall(tmp_path, "M+relaxed")["chartqa"]["recall"] == 0.0
    with pytest.raises(Exception, match="rows of method 'M'"):
        answer_fact_recall(tmp_path, "M")


def test_states_matches_whole_words_only():
    from mmspec.train.evaluate import states

    assert states("I count 1 star.", 1) and states("The word is SALE", "sale") and states("a red star", "red star")
    assert not states("I count 10 stars.", 1) and not states("Nothing here", "no") and not states("wholesale", "sale")
    # a grid position inside a wider one is not stated: "red circle top left" does not answer "top"
    assert not states("The answer is red circle top left.", "top") and not states("bottom right", "right")
    assert not states("in the top right", "top") and not states("at the bottom left", "left")
    assert states("So the asked shape is red circle top.", "top") and states("on the right", "right")
    assert states("top left", "top left") and states("Top.", "top") and states("the left one", "left")


def test_fact_kind_drops_index():
    from mmspec.train.evaluate import fact_kind

    assert (fact_kind("object_2"), fact_kind("detail_1"), fact_kind("value")) == ("object", "detail", "value")


class Blank:
    def caption(self, images):
        return ["a picture"] * len(images)


def test_caption_fact_rate_oracle_and_blank():
    ok = caption_fact_rate(_PerSample(), n_per_family=3)
    assert sum(v["facts"] for v in ok.values()) > 0
    assert all(v["rate"] == 1.0 for v in ok.values() if v["facts"])
    blank = caption_fact_rate(Blank(), n_per_family=3)
    assert all(v["rate"] == 0.0 for v in blank.values() if v["facts"])


class _PerSample:
    """Returns the ground-truth captions of whichever sample's images it is shown."""

    def caption(self, images):
        from mmspec.world import FAMILIES, make_sample

        for family in FAMILIES:
            for i in range(3):
                s = make_sample(family, "test", i)
                if [im.tobytes() for im in s.images] == [im.tobytes() for im in images]:
                    return list(s.captions)
        raise AssertionError("unknown images")


def test_evaluate_command_writes_json(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from mmspec.cli import app

    res_dir = tmp_path / "res"
    res_dir.mkdir()
    _write(res_dir, [make_sample("chartqa", "test", 0).answer, "no idea"])
    w = RowWriter(results_path(res_dir, 1))
    hallu = make_sample("hallusionbench", "test", 0)
    w.append({"kind": "baseline", "dataset": "hallusionbench", "uid": "hallusionbench-test-0", "method": "",
              "text": hallu.answer, "token_ids": [], "wall_s": 0.1})
    w.close()
    out = tmp_path / "eval.json"
    args = ["train", "evaluate", "--results", str(res_dir), "--captions-per-family", "0", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["/venv/bin/mmspec", *args])  # what a shell call gives the command
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    truth = hallu.facts["answer"]
    assert f"1 {truth}-questions end on: Yes {int(truth == 'Yes')}, No {int(truth == 'No')}, none 0" in r.output
    report = json.loads(out.read_text())
    assert report["answer_fact_recall"]["hallusionbench"]["verdicts"] == {
        truth: {"Yes": int(truth == "Yes"), "No": int(truth == "No"), "none": 0}}
    assert report["answer_fact_recall"]["chartqa"]["samples"] == 2
    assert 0.4 <= report["answer_fact_recall"]["chartqa"]["recall"] <= 0.6
    assert report["answer_fact_recall"]["chartqa"]["questions"]["right"] == 0.5  # one right, one "no idea"
    assert "questions answered right 50.0% of 2" in r.output
    prov = report["provenance"]  # the figures name the command, date and machine that made them
    assert prov["command"] == "mmspec " + " ".join(args) and prov["date"][:2] == "20"
    assert prov["machine"]["cpu_count"] >= 1 and prov["results"] == str(res_dir)


def test_training_time_fact_recall_uses_the_whole_word_rule(monkeypatch):
    """The held-out check recorded in each checkpoint's mmspec.json scores like the test-split one."""
    import types

    import mmspec.train.recipe as recipe

    sample = make_sample("vqav2", "test", 0)  # facts: count '0', colour 'green'
    answers = iter([f"I count 10 shapes; the one is {sample.facts['colour']}."])
    monkeypatch.setattr(recipe, "greedy_answer", lambda *a, **k: [])
    encoder = types.SimpleNamespace(tokenizer=types.SimpleNamespace(decode=lambda ids, **k: next(answers)))
    r = fact_recall(None, encoder, None, [sample])
    assert sample.facts["count"] == "0" and r["recall"] == 0.5  # the colour is stated; "0" inside "10" is not


def test_verdicts_count_the_last_yes_or_no(tmp_path):
    """The yes/no verdict is the answer's last yes/no word, tallied against the true answer; the
    "no" inside "there is no X" does not count as a No when the answer ends on Yes."""
    from mmspec.train.evaluate import verdict

    assert verdict("There is no red star. The closest thing is... So the answer is Yes.") == "Yes"
    assert verdict("I count 2 stars. Therefore: No.") == "No" and verdict("I cannot tell.") == "none"
    assert verdict("Nothing is known") == "none"  # "no" only as a whole word
    samples = [make_sample("hallusionbench", "test", i) for i in range(12)]
    truths = [s.facts["answer"] for s in samples]
    assert {"Yes", "No"} <= set(truths)
    w = RowWriter(results_path(tmp_path, 0))
    for i, s in enumerate(samples):  # the true answer for even rows, always "No" for odd rows
        text = s.answer if i % 2 == 0 else "There is no such thing. So the answer is No."
        w.append({"kind": "baseline", "dataset": "hallusionbench", "uid": f"hallusionbench-test-{i}",
                  "method": "", "text": text, "token_ids": [], "wall_s": 0.1})
    w.close()
    got = answer_fact_recall(tmp_path)["hallusionbench"]["verdicts"]
    want: dict = {}
    for i, t in enumerate(truths):
        said = t if i % 2 == 0 else "No"
        want.setdefault(t, {"Yes": 0, "No": 0, "none": 0})[said] += 1
    assert got == want
    assert "verdicts" not in answer_fact_recall(_chart_dir(tmp_path))["chartqa"]


def test_yes_no_answer_fact_is_the_verdict_not_any_yes_or_no():
    """A hallucination answer that says "yes" on the way and ends on No states the answer No only."""
    from mmspec.train.evaluate import tally_facts

    yes = next(s for s in (make_sample("hallusionbench", "test", i) for i in range(40))
               if s.facts.get("answer") == "Yes" and "position" in s.facts)
    mixed = f"Looking for it: yes, it is there, {yes.facts['position']}. So the answer is No."
    by = tally_facts([(yes, mixed)])["hallusionbench"]["by_fact"]
    assert by["answer"]["recall"] == 0.0 and by["position"]["recall"] == 1.0
    assert tally_facts([(yes, yes.answer)])["hallusionbench"]["recall"] == 1.0
    no = next(s for s in (make_sample("hallusionbench", "test", i) for i in range(40))
              if s.facts == {"answer": "No"})
    assert tally_facts([(no, "Looking for it: no, there is none. So the answer is Yes.")])["hallusionbench"]["recall"] == 0
    assert tally_facts([(no, no.answer)])["hallusionbench"]["recall"] == 1.0


def _chart_dir(tmp_path):
    d = tmp_path / "charts"
    d.mkdir()
    _write(d, [make_sample("chartqa", "test", 0).answer])
    return d


def test_model_fact_recall_tallies_the_answers_of_the_view_it_asks_for(monkeypatch):
    """`model_fact_recall` asks for each sample's answer through the given view (multimodal by
    default) and tallies it like the benchmark figures: right answers score 1, answers without
    the facts 0, verdicts counted per true answer; a family named twice is answered once."""
    import mmspec.train.recipe as recipe
    from mmspec.train.evaluate import model_fact_recall
    from mmspec.world import generate_samples

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ids  # the fake greedy answer below already returns text

    class Enc:
        tokenizer = Tok()

    from mmspec.train.data import example_from_sample

    truth = {example_from_sample(s).prompt: s.answer
             for f in ("chartqa", "hallusionbench") for s in generate_samples(f, "test", 3)}
    seen = []

    def right(model, encoder, image_processor, ex, *args, view, **kwargs):
        seen.append(view)
        return truth[ex.prompt]

    monkeypatch.setattr(recipe, "greedy_answer", right)
    r = model_fact_recall(None, Enc(), None, ["chartqa", "hallusionbench", "chartqa"], 3, view="caption",
                          progress=False)
    assert seen == ["caption"] * 6
    assert r["chartqa"]["recall"] == 1.0 and r["hallusionbench"]["recall"] == 1.0
    assert r["chartqa"]["samples"] == 3 and "verdicts" in r["hallusionbench"]
    said = r["hallusionbench"]["verdicts"]
    assert sum(v["none"] for v in said.values()) == 0
    assert all(v[t] == sum(v.values()) for t, v in said.items())  # every verdict right

    views = []
    monkeypatch.setattr(recipe, "greedy_answer", lambda *a, **k: views.append(k["view"]) or "I cannot tell.")
    r = model_fact_recall(None, Enc(), None, ["chartqa"], 2, progress=False)
    assert r["chartqa"]["recall"] == 0.0 and r["chartqa"]["facts"] > 0 and views == ["multimodal"] * 2
    import pytest

    from mmspec.errors import MMSpecError

    with pytest.raises(MMSpecError, match="unknown view"):
        model_fact_recall(None, Enc(), None, ["chartqa"], 1, view="text", progress=False)


@pytest.mark.parametrize("text, expected", [
    ("", [""]),
    ("   ", [""]),
    ("No end", ["No end"]),
    ("One. Two", ["One.", "Two"]),
    ("One.  Two.\n", ["One.", "Two."]),
    ("Is it? Yes! It is 3.5 high.", ["Is it?", "Yes!", "It is 3.5 high."]),
    ("Wow!! Then . done", ["Wow!!", "Then .", "done"]),
    ("A.B c.", ["A.B c."]),
])
def test_sentences_split_at_end_punctuation_before_whitespace(text, expected):
    """The world's one sentence rule: end punctuation before whitespace or the end of the text;
    final_sentence takes the last piece, the answer weight starts after the first end."""
    from mmspec.train.evaluate import final_sentence
    from mmspec.world.core import SENTENCE_END, sentences

    assert sentences(text) == expected
    assert final_sentence(text) == expected[-1]
    first = SENTENCE_END.search(text.strip())
    assert (first is None) == (len(expected) == 1 and not expected[0].endswith((".", "!", "?")))
    if first is not None:
        assert text.strip()[:first.end()] == expected[0]


def test_a_question_counts_only_when_its_final_sentence_answers_it():
    """Question accuracy reads the asked fact (the first of `facts`) in the answer's final
    sentence: a right listing followed by a wrong answer, side facts alone, or an answer cut off
    mid-sentence (its only "sentence" holds the label) do not count; a
    yes/no question counts by the verdict the answer ends on; families that ask no question
    get no question figure."""
    from mmspec.train.evaluate import tally_facts

    s = [make_sample("chartqa", "test", i) for i in range(40)]
    top = next(x for x in s if list(x.facts) == ["label", "value", "colour"])  # asks the label
    wrong = next(lab for lab in ("tea", "egg", "bus", "dog") if lab != top.facts["label"])
    texts = [(top, top.answer),  # right
             (top, f"The answer is {top.facts['label']}."),  # right, nothing else said
             (top, f"{top.answer.rsplit('. ', 1)[0]}. The answer is {wrong}."),  # right listing, wrong answer
             (top, f"The bar is {top.facts['colour']}, at {top.facts['value']}."),  # side facts only
             (top, f"{top.facts['label']} is {top.facts['value']}, the tallest, and the answer is")]  # cut off
    q = tally_facts(texts)["chartqa"]["questions"]
    assert q == {"right": 0.4, "questions": 5, "unfinished": 1, "by_asked": {"label": {"right": 0.4, "questions": 5}}}
    no = next(x for x in (make_sample("hallusionbench", "test", i) for i in range(40)) if x.facts["answer"] == "No")
    h = tally_facts([(no, no.answer), (no, "There is no such thing. So the answer is Yes.")])
    assert h["hallusionbench"]["questions"]["right"] == 0.5  # the verdict it ends on
    story = make_sample("vist", "test", 0)
    assert "questions" not in tally_facts([(story, story.answer)])["vist"]
