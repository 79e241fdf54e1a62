"""mmspec.train: the LLaVA two-stage recipe, scaled down, for the embedded target / draft / captioner.

Modules (each docstring says what it owns):
- ``config``     size presets, stage / recipe dataclasses, ``build_llava``
- ``data``       examples, views (multimodal / text / caption), label masking, batching
- ``pooling``    ``pooled_image_features`` (pre-projector 2-D pooling, with the engine's own pooling function)
- ``recipe``     one stage's training loop, LR schedule, held-out metrics
- ``checkpoint`` fp16 HF directories (``save_half``, ``save_checkpoint``)
- ``pack``       the whole embedded pack in order; ``cli`` the ``mmspec train`` sub-app

Nothing is imported here, so ``import mmspec.train`` stays cheap.
"""
