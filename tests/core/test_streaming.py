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


class ByteTokenizer:
    """Every token one byte of UTF-8: ids 3k are the lead byte of "é" (0xC3), 3k+1 its
    continuation (0xA9), 3k+2 an "a": a character is split over two tokens, often over two blocks."""

    def decode(self, ids, skip_special_tokens=True):
        table = {0: b"\xc3", 1: b"\xa9", 2: b"a"}
        return b"".join(table[int(t) % 3] for t in ids).decode("utf-8", errors="replace")


def test_scheduler_streams_text_deltas_and_never_splits_a_character(target, draft_shared, tok):
    """Issue 42, item 7: BatchScheduler (what `mmspec serve` streams from) emits each step's text
    incrementally per request (TextDelta): the pieces of a request concatenate to its result's
    text, though block boundaries fall inside multi-byte characters."""
    from mmspec.batch import BatchScheduler

    dec = SpecDecoder(target, draft_shared, tok, views="MT")
    dec.tokenizer = ByteTokenizer()  # decoding only: the scheduler's text goes through it
    sched = BatchScheduler(dec, max_batch=3)
    rids = [sched.submit(dict(input_ids=ids, pixel_values=pv, max_new_tokens=24))
            for ids, pv in (make_prompt(n, 16, seed=40 + n, text_len=3 + n) for n in range(4))]
    pieces = {r: [] for r in rids}
    blocks = {r: [] for r in rids}
    results = {}
    while sched.has_work():
        for ev in sched.step():
            assert ev.error is None
            pieces[ev.rid].append(ev.text)
            blocks[ev.rid].append(ev.new_token_ids)
            if ev.finished:
                results[ev.rid] = ev.result
    split = 0  # block boundaries that cut a character ("é" = lead byte | continuation byte)
    for r in rids:
        text = results[r].text
        assert text == ByteTokenizer().decode(results[r].token_ids)
        assert "".join(pieces[r]) == text
        split += sum(a[-1] % 3 == 0 and b[0] % 3 == 1 for a, b in zip(blocks[r], blocks[r][1:]) if a and b)
    assert split > 0  # the case the test is about did happen


def test_text_delta_decodes_a_window_not_the_whole_answer():
    """Streaming without re-decoding: each push decodes the newest tokens (a window), never the
    whole answer again, and the pieces still concatenate to the whole decode."""
    tok = AutoTokenizer.from_pretrained(default_path() / "target")
    ids = tok.encode("the red square is left of the blue circle, héllo 😀 " * 8, add_special_tokens=False)
    decoded = []
    real = tok.decode

    class Counting:
        def decode(self, t, **kw):
            decoded.append(len(t))
            return real(t, **kw)

    delta = TextDelta(Counting())
    pieces = [delta.push(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [delta.finish()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert max(decoded[:-1]) <= 12  # windows of a few tokens; only finish() decodes the whole answer


def test_the_rust_decoder_stands_in_only_where_it_decodes_as_transformers_does():
    """TextDelta decodes through the tokenizer's Rust backend (half a streamed row's host time):
    the same text as ``tokenizer.decode`` with special tokens, multi-byte characters and every
    window, and not used where transformers would clean up tokenization spaces."""
    from mmspec.streaming import fast_decoder

    tok = AutoTokenizer.from_pretrained(default_path() / "target")
    fast = fast_decoder(tok)
    assert fast is not None
    ids = [tok.bos_token_id] + tok.encode("héllo 😀 wörld, the red square", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        for i in range(len(ids)):
            for j in range(i, min(len(ids), i + 6) + 1):
                assert fast.decode(ids[i:j], skip_special_tokens=skip) == tok.decode(ids[i:j], skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True
    assert fast_decoder(tok) is None and fast_decoder(ByteTokenizer()) is None
