"""Streaming a decode's text as its blocks are accepted.

Owns the incremental detokenization (:class:`TextDelta`: decode a window of the newest tokens
and emit its new text, holding back an incomplete multi-byte character, so the pieces
concatenate to the text :meth:`mmspec.SpecDecoder.generate` returns; per row of a batch too) and :class:`TextStream`, the iterator that
:meth:`mmspec.SpecDecoder.stream` returns: ``generate`` runs in a worker thread with a streamer
(transformers' ``put(ids)`` / ``end()`` protocol, the same one ``generate(streamer=...)``
accepts) that queues at most one text piece per block. Knows nothing of drafting or caches.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

_DONE = object()


def fast_decoder(tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a fast Hugging Face tokenizer, where decoding
    through it gives what ``tokenizer.decode`` gives (no clean-up of tokenization spaces, which
    transformers applies in Python): about half the host time of a streamed row's step
    (measured: 12.9 us a push through ``tokenizer.decode``); None where it cannot stand in."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class TextDelta:
    """Tokens in, new text out: ``push(ids) -> piece``; the pieces and ``finish()`` concatenate
    to ``tokenizer.decode(all ids, skip_special_tokens=...)``.

    Incremental (vLLM's and transformers' streamers' way): each push decodes only a window, the
    tokens since the start of the previous piece's tokens, and emits the window's text past what
    the previous tokens of the window decode to (so a tokenizer that drops or adds a leading
    space at the start of a decode is read right). A window whose text ends in an incomplete
    multi-byte character waits for its bytes. ``finish()`` decodes the whole answer once and
    emits what is left of it."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast = fast_decoder(tokenizer)
        self.tokens: list[int] = []
        self.emitted = ""
        self.prefix = 0  # the window starts here: the tokens of the piece before the last one
        self.read = 0  # tokens emitted as text so far

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids) -> str:
        self.tokens.extend(ids if type(ids) is list else [int(t) for t in ids])  # the engine's: a list of ints already
        before = self._decode(self.tokens[self.prefix:self.read])
        text = self._decode(self.tokens[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""  # nothing new, an incomplete character, or a decode that rewrote earlier text: wait
        piece = text[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.emitted += piece
        return piece

    def finish(self) -> str:
        text = self._decode(self.tokens)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += piece
        return piece


class _Cancelled(Exception):
    """Raised inside the decode when the consumer closed the stream."""


class _QueueStreamer:
    """A streamer for ``generate(streamer=...)`` that skips the prompt and queues each block's text."""

    def __init__(self, tokenizer, out: queue.Queue, cancelled: threading.Event):
        self.delta = TextDelta(tokenizer)
        self.out, self.cancelled = out, cancelled
        self.prompt_seen = False

    def put(self, ids) -> None:
        if self.cancelled.is_set():
            raise _Cancelled()
        if not self.prompt_seen:  # the prompt comes first
            self.prompt_seen = True
            return
        piece = self.delta.push(ids.reshape(-1).tolist())
        if piece:
            self.out.put(piece)

    def end(self) -> None:
        piece = self.delta.finish()
        if piece and not self.cancelled.is_set():
            self.out.put(piece)


class TextStream(Iterator[str]):
    """Text pieces of one decode, at most one per block, in order; ``result`` is the
    :class:`~mmspec.decoder.GenerationResult` once the iteration has ended. An error of the
    decode (bad input included) is raised by the iteration. ``close()`` (or leaving a ``for``
    loop over it early and dropping it) stops the decode at its next block."""

    def __init__(self, decoder, args: tuple, kwargs: dict):
        self.result = None
        self._out: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        streamer = _QueueStreamer(decoder.tokenizer, self._out, self._cancelled)

        def work():
            try:
                self.result = decoder.generate(*args, streamer=streamer, **kwargs)
                self._out.put(_DONE)
            except _Cancelled:
                self._out.put(_DONE)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self._out.put(e)

        self._thread = threading.Thread(target=work, name="mmspec-stream", daemon=True)
        self._thread.start()

    def __next__(self) -> str:
        if self._thread is None:
            raise StopIteration
        item = self._out.get()
        if item is _DONE or isinstance(item, BaseException):
            self._thread.join()
            self._thread = None
            if isinstance(item, BaseException):
                raise item
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the decode (at its next block) and wait for it."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __del__(self):
        self._cancelled.set()
