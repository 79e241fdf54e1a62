"""Model adapters: thin, stateless views over Hugging Face models.

Each family has one module that says how to encode images (and videos), project patch
features, embed tokens and run a forward pass with a caller-owned KV cache: ``llava``
(LLaVA-1.5), ``llava_next`` (AnyRes tiles), ``llava_onevision`` (images and video),
``video_llava``, ``qwen2_vl`` (Qwen2-VL and Qwen2.5-VL: dynamic resolution, multimodal RoPE,
video) and ``causal_lm`` (any text-only LM, as a draft). Each registers itself by
``config.model_type`` (``@register``, into :data:`mmspec.models.base.ADAPTERS`); a new family is
one module and its name in this package's import line below (``base`` never imports a family: the
families import it). Adapters never keep state on the model: the engine owns the caches.

Beside them: ``loading`` (checkpoints, tokenizers, the vocabulary check), ``cache``
(preallocated KV caches), ``captioner`` (the C view's image-to-text models), ``pooling`` (the P
view) and ``substitute`` (the E view's encoders).
"""

# The families: importing one registers its adapter in base.ADAPTERS (nothing else happens at import).
from mmspec.models import causal_lm, llava, llava_next, llava_onevision, qwen2_vl, video_llava  # noqa: F401
from mmspec.models.base import ModelAdapter, adapter_for
from mmspec.models.loading import load_model, load_tokenizer

__all__ = ["ModelAdapter", "adapter_for", "load_model", "load_tokenizer"]
