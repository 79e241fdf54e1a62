"""Streaming: ``SpecDecoder.stream`` yields at most one text piece per block, the pieces
concatenate to ``generate(...).text``; ``generate(streamer=...)`` feeds transformers' own
``TextStreamer`` / ``TextIteratorStreamer`` the prompt, then each block's tokens, then ``end()``;
multi-byte characters split over several tokens are never emitted half."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoTokenizer, TextIteratorStreamer, TextStreamer

from helpers.tiny import make_prompt
from mmspec import MMSpecError, SpecDecoder
from mmspec.embedded import default_path
from mmspec.streaming import TextDelta


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, ids):
        self.puts.append(ids.clone())

    def end(self):
        self.ended += 1


@pytest.fixture
def dec(target, draft_shared, tok):
    return SpecDecoder(target, draft_shared, tok, views="MT")


def test_stream_pieces_are_generate_text_one_per_block(dec):
    ids, pv = make_prompt(2, 16, seed=1)
    want = dec.generate(ids, pv, max_new_tokens=30)
    s = dec.stream(ids, pv, max_new_tokens=30)
    pieces = list(s)
    assert "".join(pieces) == want.text and s.result.token_ids == want.token_ids
    assert s.result.stats.n_blocks - 1 <= len(pieces) <= s.result.stats.n_blocks  # a last EOS-only block: no text


def test_streamer_gets_the_prompt_then_each_block(dec):
    ids, pv = make_prompt(1, 16, seed=2)
    rec = Recorder()
    res = dec.generate(ids, pv, max_new_tokens=20, streamer=rec)
    assert torch.equal(rec.puts[0], ids) and rec.ended == 1
    assert [p.tolist() for p in rec.puts[1:]] == _blocks(res)


def _blocks(res) -> list[list[int]]:
    out, i = [], 0
    for n in res.stats.tokens_per_block:
        out.append(res.token_ids[i:i + n])
        i += n
    return out


def test_transformers_text_streamer(dec, tok, capsys):
    ids, pv = make_prompt(1, 16, seed=3)
    res = dec.generate(ids, pv, max_new_tokens=20, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    assert capsys.readouterr().out == res.text + "\n"


def test_transformers_text_iterator_streamer(dec, tok):
    ids, pv = make_prompt(2, 16, seed=4)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=60)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("res", dec.generate(ids, pv, max_new_tokens=24,
                                                                               streamer=streamer)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == out["res"].text


def test_stream_raises_bad_input_and_stops_early(dec):
    ids, pv = make_prompt(1, 16, seed=5)
    with pytest.raises(MMSpecError, match="max_new_tokens"):
        list(dec.stream(ids, pv, max_new_tokens=0))
    with pytest.raises(MMSpecError, match="streamer"):
        dec.stream(ids, pv, streamer=Recorder())
    s = dec.stream(ids, pv, max_new_tokens=200)
    first = next(s)
    s.close()  # stops the decode at its next block
    assert first and s.result is None and list(s) == []
    assert dec.generate(ids, pv, max_new_tokens=5).token_ids  # the decoder still works


def test_multibyte_characters_are_never_split():
    tok = AutoTokenizer.from_pretrained(default_path() / "target")
    text = "héllo 😀 wörld ü"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters split over several byte tokens
    delta = TextDelta(tok)
    pieces = [delta.push([i]) for i in ids] + [delta.finish()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)
