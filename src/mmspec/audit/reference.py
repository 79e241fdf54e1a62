"""The local reference: the target itself through transformers, greedy, one request at a time.

Owns :class:`LocalTarget`: a request's messages -> the prompt the way ``mmspec serve`` frames
it (:func:`mmspec.serve.messages.build_prompt`, so the same request gives the same prompt ids),
``target.generate(do_sample=False)`` -> a :class:`~mmspec.audit.compare.Reference` (its ids, EOS
kept when it stopped there; its text decoded as the server decodes it), and at a first difference
the one target forward of :func:`mmspec.bench.audit.audit_difference` for both tokens'
log-probabilities. A request that constrains its answer (``response_format``, ``structured_outputs``,
``tools`` with ``tool_choice`` "required" or a named function: :mod:`mmspec.serve.structured`)
is answered under the same constraint (:mod:`mmspec.audit.constrained`: the target's own
constrained decoding), its tools presented in the prompt as the server presents them. Another engine may frame chat messages otherwise (its chat template): audit
such an endpoint against a reference endpoint of the same engine (``--reference URL``).
"""

from __future__ import annotations

import math
import threading

from mmspec.audit.client import AuditError
from mmspec.audit.compare import Located, Reference


class LocalTarget:
    """``path`` a target directory (None: the embedded target), loaded in ``dtype`` on ``device``."""

    def __init__(self, path: str | None = None, dtype: str = "float32", device: str = "cpu"):
        import torch

        from mmspec.checks import eos_ids

        if path is None:
            from mmspec.embedded import load_embedded

            e = load_embedded(dtype=getattr(torch, dtype), device=device)
            self.model, self.processor, self.tokenizer = e.target, e.processor, e.tokenizer
        else:
            from mmspec.models.loading import load_model, load_processor

            self.model = load_model(path, dtype=dtype, device=device)
            self.processor = load_processor(path)
            self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        eos = sorted(eos_ids(self.model, self.tokenizer))
        self.eos_ids, self.eos_id = set(eos), (eos[0] if eos else None)
        self._lock = threading.Lock()  # one forward at a time: the model is shared by the worker threads

    def inputs(self, body: dict) -> dict:
        """The processor's tensors for a request's messages, framed as mmspec serve frames them."""
        from mmspec.inputs import processor_inputs, to_target
        from mmspec.serve.messages import build_prompt, image_refs, load_image
        from mmspec.serve.protocol import parse_messages

        try:
            messages = parse_messages(body["messages"])  # typed as the server reads them
            images = [load_image(ref, []) for ref in image_refs(messages)]
            prompt = build_prompt(self.processor, self.tokenizer, messages, tools=self.plan(body).tools)
            enc = processor_inputs(self.processor, prompt, images)
        except Exception as e:  # noqa: BLE001 - the server's RequestError, the processor's own
            raise AuditError(f"the local reference cannot read this request: {e}") from None
        return to_target(enc, self.device, self.model.dtype)

    @staticmethod
    def plan(body: dict):
        """The request's constraint and tools, read as mmspec serve reads them (tool_choice "auto":
        unconstrained, the tags parsed by the server's hermes parser)."""
        from mmspec.serve.structured import plan_of

        try:
            return plan_of(response_format=body.get("response_format"),
                           structured_outputs=body.get("structured_outputs"), tools=body.get("tools"),
                           tool_choice=body.get("tool_choice"), tool_call_parser="hermes",
                           parallel_tool_calls=body.get("parallel_tool_calls"))
        except Exception as e:  # noqa: BLE001 - the server's RequestError
            raise AuditError(f"the local reference cannot read this request's constraint: {e}") from None

    def answer(self, body: dict) -> tuple[Reference, dict]:
        """The target's greedy answer to ``body`` and the inputs it was made from."""
        import torch

        from mmspec.audit.constrained import constrained_kwargs

        inputs = self.inputs(body)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 128)
        with self._lock, torch.inference_mode():
            constrained = constrained_kwargs(self.model, self.tokenizer, self.eos_ids, self.plan(body).constraint)
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=n, num_beams=1, **constrained)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        for k, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[: k + 1]
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = body.get("stop") or []
        cuts = [i for i in (text.find(x) for x in ([stops] if isinstance(stops, str) else stops)) if i >= 0]
        if cuts:  # as the server does: the text before the first stop string
            text = text[: min(cuts)]
            keep = next(m for m in range(len(ids) + 1)
                        if len(self.tokenizer.decode(ids[:m], skip_special_tokens=True)) >= len(text))
            ids = ids[:keep]
        return Reference(text, ids=ids), inputs

    def logprobs(self, inputs: dict, ref: Reference, found: Located) -> tuple[float, float]:
        """log p(own), log p(ours) at the difference: one forward over the prompt + the common prefix."""
        from mmspec.bench.audit import audit_difference

        own = ref.ids
        ours = [*own[: found.position], int(found.ours)]
        with self._lock:
            a = audit_difference(self.model, inputs, own, ours)
        own_lp = math.log(a["p_own"])  # the reference's own (argmax) token: never 0
        return own_lp, own_lp - a["logit_gap"]  # log p(own) - log p(ours) is the logit gap, exactly
