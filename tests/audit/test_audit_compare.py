"""mmspec.audit without a server: locating the first difference, classifying it, the requests."""

from __future__ import annotations

import json
import math

import pytest

from mmspec.audit import AuditError, Reference, Reply, Token, judge, locate, read_jsonl
from mmspec.audit.compare import Located


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from mmspec.embedded import default_path

    return AutoTokenizer.from_pretrained(default_path() / "target")


def toks(*texts, top=None):
    return [Token(t, -0.1, dict(top or {})) for t in texts]


def test_identical_answers_by_ids_tokens_and_text(tok):
    ids = tok.encode("The tallest bar is red.", add_special_tokens=False)
    text = tok.decode(ids)
    assert locate(Reference(text, ids=ids), Reply(text, "length"), tok) is None  # text only: equal texts
    as_ids = [Token(f"token_id:{i}", -0.1) for i in ids]
    assert locate(Reference(text, ids=ids), Reply(text, "length", as_ids)) is None
    assert locate(Reference("a b", tokens=toks("a", " b")), Reply("a b", "stop", toks("a", " b"))) is None


def test_first_difference_by_ids_and_by_tokenized_text(tok):
    own = tok.encode("The tallest bar is red.", add_special_tokens=False)
    ours_text = "The tallest bar is blue."
    found = locate(Reference(tok.decode(own), ids=own), Reply(ours_text, "length"), tok)
    assert (found.position, found.own, found.compared) == (4, own[4], "text")
    assert tok.decode([found.ours]) == " blue"
    # an answer that stops early differs by its EOS (the reference's ids go on)
    found = locate(Reference(tok.decode(own), ids=own), Reply("The tallest", "stop"), tok, eos_id=2)
    assert (found.position, found.ours) == (2, 2)


def test_text_against_reference_token_strings():
    ref = Reference("The bar is red.", tokens=toks("The", " bar", " is", " red", ".")
                    [:3] + [Token(" red", -0.69, {" red": -0.69, " redd": -0.70, " r": -3.0})] + toks("."))
    found = locate(ref, Reply("The bar is reddish.", "stop"))  # no tokens, no tokenizer: top_logprobs align it
    assert (found.position, found.own, found.ours) == (3, " red", " redd")
    found = locate(ref, Reply("The bar is red. And", "stop"))
    assert (found.position, found.own, found.unknown) == (5, None, True)  # ours goes on: which token, unknown
    assert judge(found, None, None, "bfloat16")["class"] == "unclassified"
    found = locate(ref, Reply("The bar is", "stop"))
    assert (found.position, found.own, found.ours, found.unknown) == (3, " red", None, False)
    assert judge(found, -0.69, None, "bfloat16")["class"] == "bug"  # ours ended where the reference goes on


def test_judge_near_tie_and_bug():
    at = Located(3, " red", " blue", "tokens")
    lp = math.log(0.5)
    tie = judge(at, lp, math.log(0.4995), "bfloat16")
    assert tie["class"] == "near-tie" and tie["margin"] == pytest.approx(0.0005)
    assert judge(at, lp, math.log(0.4995), "float32")["class"] == "bug"  # float32: exact, every difference a bug
    assert judge(at, lp, math.log(0.4995), "float32", tolerance=1e-3)["class"] == "near-tie"
    assert judge(at, lp, math.log(0.2), "bfloat16")["class"] == "bug"
    # not among the reference's top_logprobs: a bug when even the best case is past the tolerance
    assert judge(at, lp, None, "bfloat16", listed_floor=math.log(0.1))["class"] == "bug"
    assert judge(at, lp, None, "bfloat16", listed_floor=math.log(0.4999))["class"] == "unclassified"
    assert judge(at, None, None, "bfloat16")["class"] == "unclassified"  # the reference gave no logprobs
    assert judge(Located(3, None, " x", "text"), None, None, "bfloat16")["class"] == "bug"  # one answer ended


def test_world_requests_frame_as_the_world_prompt():
    """The default requests reach the target as the world's own prompt (mmspec serve's framing)."""
    from mmspec.audit import world_requests
    from mmspec.embedded import load_embedded
    from mmspec.inputs import chat_prompt
    from mmspec.serve.messages import build_prompt
    from mmspec.serve.protocol import parse_messages
    from mmspec.world import iter_all

    reqs = world_requests(8, max_tokens=16)
    e = load_embedded()
    for r, s in zip(reqs, iter_all("test", 1)):
        assert r.id == s.uid and r.body["max_tokens"] == 16
        got = build_prompt(e.processor, e.tokenizer, parse_messages(r.body["messages"]))
        assert got == chat_prompt(e.processor, s.prompt, len(s.images)), s.uid


def test_bad_jsonl_lines(tmp_path):
    p = tmp_path / "r.jsonl"
    cases = [("{not json", "line 1: not valid JSON"), ("[1, 2]", "line 1: a JSON list, not an object"),
             ('{"max_tokens": 3}', "line 1: no 'messages' list"),
             ('{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}', "greedy"),
             ('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{"id": "a", "messages": '
              '[{"role": "user", "content": "y"}]}', "line 2: the id 'a' is used twice"), ("\n\n", "holds no requests")]
    for text, says in cases:
        p.write_text(text)
        with pytest.raises(AuditError, match=says):
            read_jsonl(p)
    with pytest.raises(AuditError, match="not found"):
        read_jsonl(tmp_path / "none.jsonl")
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_p": 1}) + "\n")
    (r,) = read_jsonl(p, max_tokens=7)
    assert r.id == "line-1" and r.body == {"messages": [{"role": "user", "content": "hi"}], "top_p": 1, "max_tokens": 7}


def test_local_reference_cuts_at_a_stop_string_as_the_server_does():
    from mmspec.audit import world_requests
    from mmspec.audit.reference import LocalTarget

    local = LocalTarget()
    (req,) = world_requests(1, max_tokens=24)
    full, _ = local.answer(req.body)
    word = full.text.split()[3]
    cut, _ = local.answer({**req.body, "stop": [" " + word]})
    assert cut.text == full.text[: full.text.find(" " + word)]
    assert local.tokenizer.decode(cut.ids, skip_special_tokens=True).startswith(cut.text)
    assert len(cut.ids) < len(full.ids)
    assert locate(cut, Reply(cut.text, "stop"), local.tokenizer) is None


def _content(entries):
    """``logprobs.content`` as mmspec serve writes it: each entry and alternative with its ``token_id``."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "token_id": i,
                         "top_logprobs": [{"token": a, "logprob": b, "bytes": [], "token_id": j} for a, j, b in top]}
                        for t, i, lp, top in entries]}


def test_mmspecs_token_id_field_is_read_as_ids():
    """mmspec (and SGLang) give each logprobs entry a ``token_id``; vLLM writes ``token_id:N`` as the
    token. Both are ids: two answers whose token strings agree but whose ids differ are told apart."""
    from mmspec.audit.client import _tokens

    toks_ = _tokens(_content([("a", 7, -0.1, [("a", 7, -0.1), ("b", 9, -2.5)]), (" b", 8, -0.2, [])]))
    assert [t.id for t in toks_] == [7, 8] and toks_[0].alternative(9) == -2.5 and toks_[0].alternative("b") == -2.5
    vllm = _tokens({"content": [{"token": "token_id:7", "logprob": -0.1, "top_logprobs": [
        {"token": "token_id:9", "logprob": -2.5}]}]})
    assert vllm[0].id == 7 and vllm[0].alternative(9) == -2.5
    other = _tokens(_content([("a", 7, -0.1, []), (" b", 5, -0.2, [])]))  # the same strings, another id
    found = locate(Reference("a b", tokens=toks_), Reply("a b", "stop", other))
    assert (found.position, found.own, found.ours, found.compared) == (1, 8, 5, "ids")


def test_tokens_that_agree_with_texts_that_do_not_are_a_difference(tok):
    """A proxy that rewrites the text and leaves the logprobs alone: the tokens agree, the texts do
    not; the difference is located in the text (against ids and against token strings alike)."""
    own = tok.encode("The tallest bar is red.", add_special_tokens=False)
    text = tok.decode(own)
    as_ids = [Token(tok.decode([i]), -0.1, token_id=i) for i in own]
    changed = text.replace(" red", " blue")
    found = locate(Reference(text, ids=own), Reply(changed, "length", as_ids), tok)
    assert (found.position, found.own, found.compared) == (4, own[4], "text") and tok.decode([found.ours]) == " blue"
    assert "texts differ" in found.note
    strings = [Token(tok.decode([i]), -0.1) for i in own]
    found = locate(Reference(text, tokens=strings), Reply(changed, "length", strings))
    assert (found.position, found.own, found.compared) == (4, " red", "text") and "texts differ" in found.note
    entry = judge(found, -0.1, None, "float32")
    assert entry["note"] == found.note
    assert locate(Reference(text, ids=own), Reply(text, "length", as_ids), tok) is None  # both agree: identical


def test_a_stopped_answers_tokens_end_with_the_eos_the_reference_has(tok):
    """An endpoint leaves the EOS out of its logprobs (mmspec) or keeps it (vLLM); a local reference's
    ids end with it. A stopped answer is given its EOS; one that goes on past the reference differs."""
    own = [*tok.encode("The tallest bar", add_special_tokens=False), 2]
    text = tok.decode(own, skip_special_tokens=True)
    without = [Token(tok.decode([i]), -0.1, token_id=i) for i in own[:-1]]
    assert locate(Reference(text, ids=own), Reply(text, "stop", without), tok, eos_id=2) is None
    assert locate(Reference(text, ids=own), Reply(text, "stop", [*without, Token("", -0.1, token_id=2)]),
                  tok, eos_id=2) is None
    found = locate(Reference(text, ids=own), Reply(text, "length", without), tok, eos_id=2)
    assert (found.position, found.own, found.ours) == (len(own) - 1, 2, None)  # it did not stop: no EOS given


def test_logprobs_strings_without_ids_are_compared_with_a_local_references_ids(tok):
    """vLLM's default logprobs carry token strings and no ids; against a local reference (ids and a
    tokenizer) each string is compared with the reference's token there: a rewritten token is found
    although the texts agree (it used to be "identical", compared by text alone)."""
    from mmspec.audit.compare import compared_by

    ids = tok.encode("The tallest bar is red.", add_special_tokens=False)
    text = tok.decode(ids)
    ref = Reference(text, ids=[*ids, 2])  # the local reference keeps its EOS
    strings = [Token(tok.decode([i]), -0.1) for i in ids]
    assert locate(ref, Reply(text, "stop", strings), tok, eos_id=2) is None
    assert compared_by(ref, Reply(text, "stop", strings), tok) == "tokens"
    raw = [Token(t, -0.1) for t in tok.convert_ids_to_tokens(ids)]  # "Ġtallest": the vocabulary's spelling
    assert locate(ref, Reply(text, "stop", raw), tok, eos_id=2) is None
    (purple,) = tok.encode(" purple", add_special_tokens=False)
    swapped = [*strings[:2], Token(" purple", -0.1), *strings[3:]]
    found = locate(ref, Reply(text, "stop", swapped), tok, eos_id=2)
    assert (found.position, found.own, found.ours, found.compared) == (2, ids[2], purple, "tokens")
    banana = [*strings[:2], Token(" banana", -0.1), *strings[3:]]  # no single token of the vocabulary
    found = locate(ref, Reply(text, "stop", banana), tok, eos_id=2)
    assert (found.position, found.ours, found.foreign) == (2, " banana", True)
    entry = judge(found, None, None, "float32")
    assert entry["class"] == "bug" and "no token of the target's vocabulary" in entry["why"]


def test_text_change_without_a_tokenizer_is_bounded_by_the_references_alternatives():
    """--reference URL without --tokenizer: the answer's token at the difference is unknown, but
    its text starts with none of the reference's top_logprobs there, so the margin is bounded: a
    bug at the right position (it used to be "unclassified", endpoint token "(end)")."""
    top = {" red": math.log(0.9), " blue": math.log(0.05), " green": math.log(0.02)}
    words = ("The", " bar", " is", " red", ".")
    ref = Reference("The bar is red.", tokens=[Token(w, math.log(0.9), top if k == 3 else {}, token_id=10 + k)
                                                for k, w in enumerate(words)])
    ours = Reply("The bar is purple.", "stop", ref.tokens)  # its tokens (ids) agree, its text was rewritten
    found = locate(ref, ours)
    assert (found.position, found.own, found.ours, found.text_only) == (3, " red", " purple", True)
    assert "texts differ" in found.note and "no tokenizer" in found.note
    entry = judge(found, math.log(0.9), None, "bfloat16", listed_floor=math.log(0.02))
    assert entry["class"] == "bug" and entry["margin_at_least"] == pytest.approx(0.88)
