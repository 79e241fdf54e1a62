"""The server's seed promise (issue 61, docs/serve.md): the same request and seed give the same
answer, alone or in any batch, with ``tree="auto"`` and ``--speculate auto`` too (an in-process
server over tiny models and the real scheduler)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers.servers import ThreadServer  # noqa: E402
from helpers.tiny import make_llava, make_processor, make_tokenizer, noisy_copy  # noqa: E402


def test_a_seed_fixes_the_answer_under_tree_auto_and_speculate_auto():
    from mmspec import SpecDecoder
    from mmspec.serve.app import create_app
    from mmspec.serve.service import ServeConfig, Service

    tok = make_tokenizer()
    target = make_llava(0)
    dec = SpecDecoder(target, noisy_copy(target, 1), tok, tree="auto", prefix_cache_mb=0)
    service = Service(dec, make_processor(tok), ServeConfig(model_name="m", speculate="auto", metrics=False))
    served = ThreadServer(create_app(service))  # on a free loopback port, started
    url = served.url + "/v1/chat/completions"

    def ask(seed: int, content: str = "w5 w6 w7 w8") -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                "temperature": 1.0, "seed": seed}
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    try:
        alone = [ask(5) for _ in range(3)]
        with ThreadPoolExecutor(6) as pool:  # the same request among others with other seeds, together
            batched = list(pool.map(lambda i: ask(5) if i % 2 else ask(100 + i, "w9 w10"), range(6)))
        assert len(set(alone)) == 1, alone
        assert batched[1] == batched[3] == batched[5] == alone[0], (alone, batched)
    finally:
        served.stop()
