"""Which LM shapes make speculative decoding pay on this CPU? One-token decode and 6-token
verify latency of random-weight Llama LMs (latency does not depend on weight values), for
the embedded target/draft and candidate replacements.

    python perf/cpu_shapes.py            # 1 thread, ~30 s; run on a quiet machine
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from mmspec.models.base import cache_argument

SHAPES = [  # (name, hidden, layers, intermediate)
    ("target now 6x256", 256, 6, 768), ("target 8x384", 384, 8, 1152), ("target 12x384", 384, 12, 1152),
    ("target 8x512", 512, 8, 1536), ("draft now 4x128", 128, 4, 384), ("draft 2x128", 128, 2, 384),
    ("draft 1x256", 256, 1, 768), ("draft 1x192", 192, 1, 576),
]


@torch.inference_mode()
def latency_ms(hidden: int, layers: int, inter: int, vocab: int = 1347, ctx: int = 100,
               reps: int = 60) -> tuple[float, float, float]:
    """(one-token decode ms, 6-token verify ms, params in millions), medians over reps."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=4,
                                         num_key_value_heads=4, max_position_embeddings=1024)).eval()
    cache = DynamicCache(config=model.config)
    kv = {cache_argument(model): cache}  # the keyword this transformers takes the cache by
    model(input_ids=torch.randint(0, vocab, (1, ctx)), **kv)  # prefill [1, ctx]
    one, six = [], []
    for _ in range(reps):
        t = time.perf_counter()
        model(input_ids=torch.tensor([[5]]), **kv)
        one.append(time.perf_counter() - t)
        cache.crop(-1)
    for _ in range(reps // 3):
        t = time.perf_counter()
        model(input_ids=torch.randint(0, vocab, (1, 6)), **kv)
        six.append(time.perf_counter() - t)
        cache.crop(-6)
    n = sum(p.numel() for p in model.parameters())
    return statistics.median(one) * 1e3, statistics.median(six) * 1e3, n / 1e6


def main() -> None:
    torch.set_num_threads(1)
    for name, h, layers, i in SHAPES:
        tp, tv, n = latency_ms(h, layers, i)
        print(f"{name:18s} {n:5.2f}M  one-token {tp:5.2f} ms   6-token verify {tv:5.2f} ms")


if __name__ == "__main__":
    main()
