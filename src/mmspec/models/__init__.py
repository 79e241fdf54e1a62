"""Model adapters: thin, stateless views over Hugging Face models.

Each family (LLaVA, a plain causal LM, ...) has one module that says how to encode images,
project patch features, embed tokens and run a forward pass with a caller-owned KV cache.
Adding LLaVA-NeXT, LLaVA-OneVision or Qwen2-VL means adding one module and one line in
:data:`mmspec.models.base.ADAPTERS`. Adapters never keep state on the model: the engine owns
the caches.
"""

from mmspec.models.base import ModelAdapter, adapter_for
from mmspec.models.loading import load_model, load_tokenizer

__all__ = ["ModelAdapter", "adapter_for", "load_model", "load_tokenizer"]
