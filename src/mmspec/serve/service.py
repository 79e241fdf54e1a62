"""The served decoder and what a request becomes before it reaches the worker.

Owns :class:`Service` (the decoder, its processor,
the :class:`~mmspec.serve.worker.Worker`) and :meth:`Service.prepare`: a validated request (the
pydantic model of :mod:`.protocol`, typed from the wire, its limits already checked into a
:class:`mmspec.request.Decoding` as it was parsed) -> a :class:`Prepared` holding the ONE request
type the scheduler runs, :class:`mmspec.request.Request`, made by :func:`mmspec.request.make_request`
(the decoder's checks, the seed chosen there, the context rule there) from the processor's whole
output, the PIL images (for a captioner or a draft with its own processor) and that
``Decoding``: no dict of arguments in between. Whatever would fail later is refused here with a
:class:`~mmspec.serve.schema.RequestError`: more images than the server takes, an unreadable
image, a prompt or ``max_tokens`` past the context (:func:`mmspec.request.context_room` sizes the
default ``max_tokens``; a :class:`~mmspec.request.ContextError` is reworded for the client). It
runs on the HTTP handlers' threads; only the worker thread decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from mmspec.errors import MMSpecError
from mmspec.request import ContextError, Request, context_room, make_request
from mmspec.serve.config import ServeConfig
from mmspec.serve.messages import PixelBudget, build_prompt, image_refs, load_image, texts
from mmspec.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from mmspec.serve.schema import MAX_SEED, RequestError
from mmspec.serve.worker import LoopMailbox, Worker, make_scheduler

__all__ = ["Body", "Prepared", "ServeConfig", "Service"]  # ServeConfig: mmspec.serve.config's, also read from here
TEXT_MARGIN = 4  # a normalizer may shorten text (NFKC: a 3-byte full-width letter -> 1 byte)


Body = ChatCompletionRequest | CompletionRequest  # a validated request (mmspec.serve.protocol)


@dataclass
class Prepared:
    """A request ready for the scheduler: its one :class:`~mmspec.request.Request` (checked, its
    seed chosen), and what the response needs of it."""

    request: Request  # what the scheduler runs (its seed: the request's own; choice i gets seed + i)
    prompt_tokens: int  # images expanded
    timings: dict = field(default_factory=dict)  # seconds of its phases so far: parse, images, processor (metrics)


class Service:
    """The decoder being served, its processor and the worker thread that decodes."""

    def __init__(self, decoder, processor, config: ServeConfig, scheduler=None):
        self.decoder = decoder
        self.processor = processor
        self.tokenizer = decoder.tokenizer
        self.config = config
        self.context = decoder.target.max_positions  # None: the target sets no limit
        self.depth = decoder.tree.max_depth  # a block's draft positions past the committed tokens
        self.tokens_per_image, base = self._probe_image_tokens()
        if config.max_images is None and self.context and self.tokens_per_image:
            config.max_images = max(1, (self.context - base - self.depth - 1) // self.tokens_per_image)
        self.max_token_bytes = _max_token_bytes(self.tokenizer)
        self.metrics = None
        if config.metrics:
            from mmspec.serve.metrics import Metrics

            self.metrics = Metrics(self)
        renew = None
        if scheduler is None:
            scheduler = make_scheduler(decoder, config.max_batch, config.speculate)
            renew = lambda old: self._renewed(old, decoder, config)  # noqa: E731
        self.worker = Worker(self._metered(scheduler), renew=renew)
        self.started = time.time()
        self._mailbox: LoopMailbox | None = None

    def mailbox(self, loop) -> LoopMailbox:
        """Where the worker hands updates to the event loop ``loop`` (the server's: one)."""
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = LoopMailbox(loop)
        return self._mailbox

    def _renewed(self, old, decoder, config: ServeConfig):
        """A fresh scheduler for the next burst: the old one's policy carried over, its static
        forwards (buffers, CUDA graphs) handed over rather than made again."""
        old.close()
        return self._metered(make_scheduler(decoder, config.max_batch, old.policy))

    def _metered(self, scheduler):
        if self.metrics is None:
            return scheduler
        from mmspec.serve.metrics import MeteredScheduler

        return MeteredScheduler(scheduler, self.metrics)

    def check_text_size(self, messages: list[ChatMessage]) -> None:
        """Refuse a text that cannot fit the context from its length in bytes, before any
        tokenizing: no token covers more than ``max_token_bytes`` bytes of text (its longest
        vocabulary entry; TEXT_MARGIN more for a normalizer that shortens text), so a text of more
        than ``context * max_token_bytes * TEXT_MARGIN`` bytes has more tokens than the context."""
        if not self.context or not self.max_token_bytes:
            return
        n = sum(len(t.encode("utf-8")) for t in texts(messages))
        limit = self.context * self.max_token_bytes * TEXT_MARGIN
        if n > limit:
            raise RequestError(f"the messages' text is {n:,} bytes; the target's context of {self.context} tokens "
                               f"holds no more than {limit:,} bytes of text (a token covers at most "
                               f"{self.max_token_bytes} bytes); shorten the messages", param="messages")

    def prepare(self, req: Body) -> Prepared:
        """``req`` -> the scheduler's request, or RequestError naming the problem and the fix."""
        from mmspec.inputs import processor_inputs, to_target

        messages = req.chat_messages
        refs = image_refs(messages)
        limit = self.config.max_images
        if limit is not None and len(refs) > limit:
            per = f" (each image takes {self.tokens_per_image} of the target's {self.context} context tokens)" \
                if self.tokens_per_image and self.context else ""
            raise RequestError(f"the messages carry {len(refs)} images; this server takes at most {limit} per "
                               f"request{per}; send fewer images", param="messages")
        self.check_text_size(messages)
        budget = PixelBudget(self.config.max_image_pixels, self.config.max_request_pixels)
        t0 = time.perf_counter()
        images = [load_image(r, self.config.allowed_media, budget) for r in refs]  # before any prompt work
        t1 = time.perf_counter()
        plan = req.plan
        prompt = req.raw_text if req.completion else build_prompt(self.processor, self.tokenizer, messages,
                                                                   tools=plan.tools)
        try:
            inputs = processor_inputs(self.processor, prompt, images)
        except MMSpecError as e:
            raise RequestError(str(e)) from None
        inputs = to_target(inputs, self.decoder.target.device, self.decoder.target_model.dtype)
        timings = {"images": t1 - t0, "processor": time.perf_counter() - t1}
        n_prompt = int(inputs["input_ids"].shape[-1])
        asked = req.decoding  # checked as the request was parsed
        if asked.max_new_tokens is None:  # the server's default, capped by the room in the context
            room = context_room(self.context, n_prompt, self.depth)
            asked = replace(asked, max_new_tokens=self.config.max_tokens if room is None else
                            max(1, min(self.config.max_tokens, room)))
        try:
            request = make_request(self.decoder, inputs, asked, images=images or None, constraint=plan.constraint)
        except ContextError as e:
            raise _past_the_context(e, req.max_tokens is not None) from None
        except MMSpecError as e:
            if plan.constraint is not None and plan.source and "constraint" in str(e):  # its compilation: name the field
                raise RequestError(f"{plan.source}: {e}", param=plan.source) from None
            raise RequestError(str(e)) from None
        return Prepared(request=request, prompt_tokens=n_prompt, timings=timings)

    def requests(self, prepared: Prepared, n: int) -> list[Request]:
        """The scheduler requests of ``n`` choices: the same prompt, seeds ``seed, seed + 1, ...``."""
        seed = prepared.request.seed
        return [replace(prepared.request, seed=None if seed is None else (seed + i) % (MAX_SEED + 1)) for i in range(n)]

    def _probe_image_tokens(self) -> tuple[int | None, int]:
        """(tokens one image adds to a prompt, tokens of a one-word prompt): the processor run on a
        blank image, so the image limit is known before any request (None where it fails)."""
        from PIL import Image

        from mmspec.inputs import chat_prompt, processor_inputs

        try:
            size = getattr(getattr(self.decoder.target_model.config, "vision_config", None), "image_size", 224)
            blank = Image.new("RGB", (int(size), int(size)))
            n0 = processor_inputs(self.processor, chat_prompt(self.processor, "hi", 0), [])["input_ids"].shape[-1]
            n1 = processor_inputs(self.processor, chat_prompt(self.processor, "hi", 1), [blank])["input_ids"].shape[-1]
        except Exception:  # noqa: BLE001 - a family the probe does not fit: the context check still holds
            return None, 0
        return (int(n1 - n0) or None), int(n0)


def _past_the_context(e: ContextError, asked: bool) -> RequestError:
    """The engine's context rule, broken, in the words of the request (its ``max_tokens``)."""
    if e.room < 1 or not asked:
        return RequestError(f"the prompt takes {e.prompt_len} tokens (images expanded) and the target's context is "
                            f"{e.limit}: no room for an answer; shorten the messages or send fewer images",
                            param="messages")
    return RequestError(f"max_tokens={e.max_new_tokens} is past the context: the prompt takes {e.prompt_len} tokens "
                        f"(images expanded) of the target's {e.limit}, so at most {e.room} new tokens fit; ask for "
                        f"max_tokens <= {e.room}", param="max_tokens")


def _max_token_bytes(tokenizer) -> int | None:
    """The most bytes of UTF-8 any vocabulary entry is written with: an upper bound on the text
    one token covers (a byte-level entry writes each byte as one character of 1-2 bytes; a
    SentencePiece '▁' is 3 bytes for one space; '<0xE9>' is 6 for one byte). None where the
    tokenizer has no vocabulary to read."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(t.encode("utf-8", "replace")) for t in vocab) or None
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: the context check after tokenizing still holds
        return None
