"""Constrained answers decoded for real (xgrammar; tiny float64 models from configs): the audit's
constrained reference masks exactly what the grammar forbids, and once the engine takes
constraints (the core's ``mmspec.constrain``), the server's greedy constrained answer is token
for token the target's own constrained decoding, every sampled choice legal."""

from __future__ import annotations

import importlib.util
import inspect
import json

import pytest
import torch

pytest.importorskip("xgrammar")
if importlib.util.find_spec("mmspec.constrain.compile") is None:
    pytest.skip("needs mmspec.constrain.compile (the constrained-decoding core)", allow_module_level=True)

from helpers.servers import ThreadServer  # noqa: E402
from helpers.tiny import make_llava, make_processor, make_tokenizer, noisy_copy  # noqa: E402
from mmspec.audit.constrained import constrained_kwargs  # noqa: E402
from mmspec.constrain import Constraint  # noqa: E402


def engine_takes_constraints() -> bool:
    import mmspec.request

    return "constraint" in inspect.getsource(mmspec.request)


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return tok, make_llava(0)


def test_the_constrained_reference_masks_what_the_grammar_forbids(models):
    tok, target = models
    ids = torch.tensor([[1, 5, 6, 7]])
    mask = torch.ones_like(ids)
    choices = ("w9", "w12", "w40")
    kw = constrained_kwargs(target, tok, {2}, Constraint("choice", choices=choices))
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=5, **kw)[0, 4:].tolist()
    with torch.inference_mode():
        logits = target(input_ids=ids, attention_mask=mask).logits[0, -1]  # [V]
    legal = [tok.convert_tokens_to_ids(c) for c in choices]
    best = legal[int(torch.argmax(logits[legal]))]  # the constrained target's greedy token, by hand
    free = int(torch.argmax(logits))
    assert free not in legal  # the constraint changes the answer here (else the test would prove nothing)
    assert out == [best, 2]  # then the grammar is complete: only EOS is legal


@pytest.mark.skipif(not engine_takes_constraints(), reason="the engine does not take constraints yet (core)")
def test_served_constrained_answers_are_the_targets_own_constrained_decoding(models):
    import httpx

    from mmspec import SpecDecoder
    from mmspec.inputs import processor_inputs
    from mmspec.serve.app import create_app
    from mmspec.serve.messages import build_prompt
    from mmspec.serve.protocol import parse_messages
    from mmspec.serve.service import ServeConfig, Service

    tok, target = models
    proc = make_processor(tok)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok)
    service = Service(dec, proc, ServeConfig(model_name="m"))
    served = ThreadServer(create_app(service))  # on a free loopback port, started
    url = served.url + "/v1/chat/completions"
    try:
        msgs = [{"role": "user", "content": "w5 w6 w7"}]
        choices = ["w9", "w12", "w40"]
        so = {"choice": choices}
        r = httpx.post(url, json={"messages": msgs, "temperature": 0, "max_tokens": 8, "logprobs": True,
                                  "structured_outputs": so}, timeout=120).json()
        prompt = build_prompt(proc, tok, parse_messages(msgs))
        inputs = processor_inputs(proc, prompt, [])
        kw = constrained_kwargs(target, tok, dec.eos_ids, Constraint("choice", choices=tuple(choices)))
        n = inputs["input_ids"].shape[1]
        ref = target.generate(**inputs, do_sample=False, max_new_tokens=8, **kw)[0, n:].tolist()
        got = [t["token_id"] for t in r["choices"][0]["logprobs"]["content"]]
        assert got == [t for t in ref if t not in dec.eos_ids], (got, ref)
        assert r["choices"][0]["message"]["content"] in choices and r["choices"][0]["finish_reason"] == "stop"
        r = httpx.post(url, json={"messages": msgs, "temperature": 1.0, "seed": 3, "n": 4, "max_tokens": 8,
                                  "structured_outputs": so}, timeout=120).json()
        assert all(c["message"]["content"] in choices for c in r["choices"]), json.dumps(r)[:500]
    finally:
        served.stop()
