"""Where a speculative answer leaves the reference's, and whether that is a near-tie or a bug.

Owns, for one request: :func:`locate` (the first differing position and the two tokens there)
and :func:`judge` (the reference's log-probabilities of both tokens there -> a class). Pure: no
HTTP, no model; the local reference's forward is :mod:`mmspec.audit.reference`'s.

**Which tokens are compared.** Token ids when both sides have them (a local reference's own ids;
an endpoint's ``logprobs`` with a ``token_id`` field, mmspec's, or written as ``token_id:N``,
vLLM's ``return_tokens_as_token_ids``); the endpoints' ``logprobs`` token strings when both gave
logprobs, or when the endpoint gave strings without ids (vLLM's default) and the reference has ids
and a tokenizer (a local reference): each string against the reference's token at that position,
as the tokenizer spells it (``decode([id])``, or ``convert_ids_to_tokens``); and **the texts always**: tokens that agree with texts that do not (a proxy, a
detokenizer or a stop-string cut that changed what the client reads) are a difference too, found
from the text. Two equal texts with no tokens are identical, and a difference in text is located by tokenizing the answer with the target's
tokenizer (against a reference with ids) or by aligning the text against the reference's token
strings (the alternative there is the longest of the reference's ``top_logprobs`` that the rest
of the answer starts with, else the tokenizer's first token of that rest). A text round trip can
split a word otherwise than the model did (BPE has many spellings of one text; a token that is
half a UTF-8 character decodes to U+FFFD), so a position found from text is marked
``"compared": "text"`` in the report. Aligned without a tokenizer, the answer's token at a
difference is not known, only its text from there (``Located.text_only``): when that text starts
with none of the reference's ``top_logprobs`` there, the token is none of them, which bounds the
margin as below.

**The class** reuses :func:`mmspec.bench.audit.classify`: the margin ``p(own) - p(ours)`` of the
reference's probabilities at that position (from its log-probabilities), a near-tie when within
the tolerance (default the dtype's machine epsilon; float32: 0, every difference a bug). A
position whose alternative the reference did not list among its ``top_logprobs`` is a bug when
even the best case (``ours`` just below the last listed) leaves a margin past the tolerance, else
``unclassified``; so is a difference the reference gave no log-probabilities for. An endpoint's
logprobs token that is no token of the target's vocabulary in any spelling (``Located.foreign``)
cannot be the target's greedy choice: a bug.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

from mmspec.audit.client import Reply, Token
from mmspec.bench.audit import NEAR_TIE_TOLERANCE, classify, first_difference

CLASSES = ("identical", "near-tie", "bug", "unclassified", "error")


@dataclass
class Reference:
    """The reference's answer: text, and its token ids (a local target) or logprobs tokens (an endpoint)."""

    text: str
    ids: list[int] | None = None  # a local target's ids, EOS included when it stopped there
    tokens: list[Token] | None = None  # an endpoint's logprobs.content


@dataclass
class Located:
    """The first difference: ``position`` and the two tokens (ids or strings; None: that answer ended)."""

    position: int
    own: int | str | None  # the reference's token
    ours: int | str | None  # the speculative endpoint's token
    compared: str  # "ids", "tokens" or "text"
    unknown: bool = False  # the answer's token there could not be told (text only, no tokenizer)
    note: str | None = None  # what the report should say about how it was found
    text_only: bool = False  # ours is the answer's text from there (its token unknown), none of the listed
    foreign: bool = False  # ours is a logprobs token string that is no token of the target's vocabulary


def _ids(tokens: list[Token] | None) -> list[int] | None:
    if tokens is None:
        return None
    ids = [t.id for t in tokens]
    return None if any(i is None for i in ids) else ids


def locate(ref: Reference, ours: Reply, tokenizer=None, eos_id: int | None = None,
           eos_ids: Collection[int] = ()) -> Located | None:
    """None when the answers agree, token for token AND in their texts; else where they first
    differ (see the module docstring). ``eos_id``: appended to the answer's tokens (or its
    tokenized text) when it stopped (``finish_reason`` stop, or tool_calls) without one of ``eos_ids`` (default
    ``{eos_id}``) at its end, so an answer that ends where the reference goes on differs by its
    EOS, as the reference's ids (an endpoint leaves the EOS out of its logprobs, or keeps it)."""
    eos = _Eos(eos_id, frozenset(eos_ids) or frozenset([eos_id] if eos_id is not None else []))
    ref_ids = ref.ids if ref.ids is not None else _ids(ref.tokens)
    ours_ids = _ids(ours.tokens)
    if ref_ids is not None and ours_ids is not None:
        found = _located(ref_ids, eos.ended(ours_ids, ours, ref_ids), "ids")
    elif ref.tokens is not None and ours.tokens is not None:
        found = _located([t.text for t in ref.tokens], [t.text for t in ours.tokens], "tokens")
    elif ref_ids is not None and ours.tokens is not None and tokenizer is not None:
        found = _strings_against_ids(ref_ids, ours, tokenizer, eos)
    else:
        return None if ref.text == ours.text else _by_text(ref, ours, ref_ids, tokenizer, eos)
    if found is not None or ref.text == ours.text:
        return found
    # the tokens agree and the texts do not: what the client reads is not what the tokens spell
    found = _by_text(ref, ours, ref_ids, tokenizer, eos)
    note = (f"the answers' {_agreed(ref_ids, ours_ids)} agree but their texts differ: the text is not what "
            "the tokens spell (a proxy, detokenizer or stop-string cut changed it); located from the text")
    found.note = f"{note}; {found.note}" if found.text_only else note
    return found


def compared_by(ref: Reference, ours: Reply, tokenizer=None) -> str:
    """How :func:`locate` compares two answers: "ids", "tokens" (and the texts too), or "text" alone."""
    ref_ids = ref.ids is not None or _ids(ref.tokens) is not None
    if ref_ids and _ids(ours.tokens) is not None:
        return "ids"
    if ours.tokens is not None and (ref.tokens is not None or (ref_ids and tokenizer is not None)):
        return "tokens"
    return "text"


def _spellings(tokenizer, i: int) -> set[str]:
    """How an endpoint may write the token ``i`` as a logprobs string: its text alone (vLLM's,
    mmspec's ``decode([id])``) or the vocabulary's own form (``convert_ids_to_tokens``: "Ġred")."""
    forms = {tokenizer.decode([i])}
    raw = tokenizer.convert_ids_to_tokens(i)
    if isinstance(raw, str):
        forms.add(raw)
    return forms


def _strings_against_ids(ref_ids: list[int], ours: Reply, tokenizer, eos: _Eos) -> Located | None:
    """An endpoint's logprobs token strings (no ids) against the reference's ids: each string is
    the reference's token where it spells it, else the first difference; there the string is
    read back as a token of the target's vocabulary (one token, in either spelling) to be judged,
    or, when it is none, marked ``foreign``."""
    read = [own if own is not None and t.text in _spellings(tokenizer, own) else t.text
            for t, own in zip(ours.tokens, [*ref_ids, *[None] * len(ours.tokens)])]
    found = _located(ref_ids, eos.ended(read, ours, ref_ids), "tokens")
    if found is None or not isinstance(found.ours, str):
        return found
    text = found.ours
    ids = tokenizer.encode(text, add_special_tokens=False)
    vocab_id = tokenizer.convert_tokens_to_ids(text) if text in tokenizer.get_vocab() else None
    if len(ids) == 1 and text in _spellings(tokenizer, ids[0]):
        found.ours = ids[0]
    elif vocab_id is not None:
        found.ours = vocab_id
    else:
        found.foreign = True
        found.note = (f"the endpoint's logprobs token {text!r} is no token of the target's vocabulary (its text "
                      f"is {len(ids)} tokens): the target cannot have chosen it")
    return found


def _agreed(ref_ids, ours_ids) -> str:
    return "token ids" if ref_ids is not None and ours_ids is not None else "logprobs tokens"


@dataclass(frozen=True)
class _Eos:
    """The EOS a stopped answer is given where its tokens lack one (None: none is added)."""

    id: int | None
    ids: frozenset

    def ended(self, ids: list[int], reply: Reply, ref_ids: list[int]) -> list[int]:
        ended = reply.finish_reason in ("stop", "tool_calls")  # an answer given as tool calls ended by itself too
        if self.id is None or not ended or (ids and ids[-1] in self.ids):
            return ids
        there = ref_ids[len(ids)] if len(ids) < len(ref_ids) else None  # the reference's own EOS, if it ends there
        return [*ids, there if there in self.ids else self.id]


def _by_text(ref: Reference, ours: Reply, ref_ids: list[int] | None, tokenizer, eos: _Eos) -> Located:
    """A difference of two texts, located: the answer tokenized against the reference's ids, else
    aligned against the reference's token strings."""
    if ref_ids is not None and tokenizer is not None:
        ids = eos.ended(tokenizer.encode(ours.text, add_special_tokens=False), ours, ref_ids)
        found = _located(ref_ids, ids, "text")
        return found or Located(len(ref_ids), None, None, "text", note=(  # equal ids, other texts: a decoding quirk
            "the texts differ but the answer's text tokenizes to the reference's tokens (a decoding difference: "
            "spaces, special tokens)"))
    return _align(ref, ours.text, tokenizer)


def _located(own: list, ours: list, how: str) -> Located | None:
    k = first_difference(own, ours)
    if k is None:
        return None
    return Located(k, own[k] if k < len(own) else None, ours[k] if k < len(ours) else None, how)


def _align(ref: Reference, text: str, tokenizer) -> Located:
    """Text against the reference's token strings (or its tokenized text): the longest run of its
    tokens that the answer starts with, and the answer's next token after it. Where the answer
    took a longer token than the reference (``" redd"`` for ``" red"``), the run goes past the real
    difference: the reference's ``top_logprobs`` a few positions back find it."""
    pieces = ([t.text for t in ref.tokens] if ref.tokens is not None
              else [tokenizer.decode([i]) for i in tokenizer.encode(ref.text, add_special_tokens=False)]
              if tokenizer is not None else None)
    if pieces is None:
        return Located(0, None, None, "text", unknown=True)  # nothing to align with: no tokens, no tokenizer
    starts = [0]
    while len(starts) <= len(pieces) and text.startswith(pieces[len(starts) - 1], starts[-1]):
        starts.append(starts[-1] + len(pieces[len(starts) - 1]))
    k = len(starts) - 1
    for j in range(k, max(-1, k - 4), -1):  # the reference's alternatives there that the answer takes
        top = ref.tokens[j].top if ref.tokens is not None and j < len(ref.tokens) else {}
        own = pieces[j] if j < len(pieces) else None
        fits = [t for t in top if t and t != own and text.startswith(t, starts[j])]
        if fits and (j == k or any(len(t) > len(own or "") for t in fits)):
            return Located(j, own, max(fits, key=len), "text")
    own = pieces[k] if k < len(pieces) else None
    rest = text[starts[k]:]
    if not rest:
        return Located(k, own, None, "text")
    if tokenizer is not None:
        return Located(k, own, tokenizer.decode(tokenizer.encode(rest, add_special_tokens=False)[:1]), "text")
    if own is not None and ref.tokens is not None and k < len(ref.tokens):
        # no tokenizer: the answer's token here is unknown, but it is none of the reference's top_logprobs
        # (the text from here starts with none of them), which is enough to bound the margin
        word = re.match(r"\s*\w{1,24}|\s*\S|\s{1,24}", rest).group(0)
        return Located(k, own, word, "text", text_only=True, note=(
            f"no tokenizer: the answer's token here is not known, its text from here reads {word!r}, which starts "
            "with neither the reference's token nor any of its top_logprobs (pass --tokenizer to read the token)"))
    return Located(k, own, None, "text", unknown=True)


def tolerance_for(dtype: str, tolerance: float | None = None) -> float:
    """``tolerance`` when given, else the dtype's (:data:`mmspec.bench.audit.NEAR_TIE_TOLERANCE`)."""
    return float(tolerance) if tolerance is not None else NEAR_TIE_TOLERANCE.get(str(dtype), 0.0)


def judge(found: Located, logprob_own: float | None, logprob_ours: float | None, dtype: str,
          tolerance: float | None = None, listed_floor: float | None = None) -> dict:
    """The difference's entry: both tokens, their reference log-probabilities, the margin
    ``p(own) - p(ours)`` and the class. ``listed_floor``: the smallest log-probability the reference
    listed there, when ``ours`` was not among them (then ``logprob_ours`` is None)."""
    entry = {"position": found.position, "reference_token": found.own, "endpoint_token": found.ours,
             "compared": found.compared, "reference_logprob": logprob_own, "endpoint_token_logprob": logprob_ours}
    if found.note:
        entry["note"] = found.note
    tol = tolerance_for(dtype, tolerance)
    if found.foreign:
        return {**entry, "margin": None, "logprob_gap": None, "class": "bug",
                "why": "the endpoint's logprobs token is no token of the target's vocabulary"}
    if logprob_own is None or found.own is None or found.ours is None:
        ended = (found.own is None) != (found.ours is None) and not found.unknown
        return {**entry, "margin": None, "logprob_gap": None, "class": "bug" if ended else "unclassified",
                "why": _why(found, logprob_own)}
    if logprob_ours is None:
        if listed_floor is None:
            return {**entry, "margin": None, "logprob_gap": None, "class": "unclassified",
                    "why": "the reference gave no log-probability for the endpoint's token"}
        least = math.exp(logprob_own) - math.exp(listed_floor)  # the margin is at least this
        cls = "bug" if least > tol else "unclassified"
        return {**entry, "margin": None, "margin_at_least": least, "logprob_gap": None, "class": cls,
                "why": "the endpoint's token is not among the reference's top_logprobs there"}
    margin = math.exp(logprob_own) - math.exp(logprob_ours)
    return {**entry, "margin": margin, "logprob_gap": logprob_own - logprob_ours,
            "class": classify({"margin": margin}, str(dtype), tolerance=tol)}


def _why(found: Located, logprob_own) -> str:
    if found.note and found.own is None and found.ours is None:
        return found.note
    if found.unknown:
        return "the answers differ but could not be aligned token by token (no tokens, no tokenizer)"
    if found.own is None:
        return "the reference's answer ends here; the endpoint's goes on"
    if found.ours is None:
        return "the endpoint's answer ends here; the reference's goes on"
    return "the reference gave no log-probabilities (it refused logprobs)"
