"""mmspec.train: the LLaVA two-stage recipe, scaled down, for the embedded target / draft / captioner.

Modules (each docstring says what it owns):
- ``config``     size presets (the shipped pack's shapes), stage / recipe dataclasses, ``build_llava``
- ``data``       examples, views (multimodal / text / caption), label masking, loss weights, batching
- ``pooling``    ``pooled_image_features`` (pre-projector 2-D pooling, with the engine's own pooling function)
- ``recipe``     one stage's training loop, LR schedule, held-out metrics
- ``distill``    a target's own greedy answers (resumable JSONL) for training drafts on them
- ``evaluate``   the quality figures: fact recall, questions answered right, captions, tau M vs T
- ``checkpoint`` fp16 HF directories (``save_half``, ``save_checkpoint``)
- ``pack``       the whole embedded pack in order; ``cli`` the ``mmspec train`` sub-app

Nothing is imported here, so ``import mmspec.train`` stays cheap. ``train`` may use ``bench``
(its JSONL store and metrics); the decoder side (``models/``, ``embedded.py``) and ``bench``
never import ``train``.
"""
