"""mmspec.train: every ``mmspec train`` job, on one loop.

Modules (each docstring says what it owns):
- ``loop``       :func:`~mmspec.train.loop.fit`, the one training loop: budgets, warm-up + cosine,
                 clipping, progress, loss history, checkpoints kept on Ctrl-C, resume, DDP
- ``config``     size presets (the shipped pack's shapes), stage / recipe dataclasses, ``build_llava``
- ``data``       examples, views (multimodal / text / caption), label masking, loss weights, batching
- ``pooling``    ``pooled_image_features`` (pre-projector 2-D pooling, with the engine's own pooling function)
- ``recipe``     one stage of the LLaVA recipe on the loop, LR schedule, held-out metrics
- ``distill``    a target's own greedy answers (resumable JSONL) for training drafts on them
- ``evaluate``   the quality figures: fact recall, questions answered right, captions, tau M vs T
- ``checkpoint`` fp16 HF directories (``save_half``, ``save_checkpoint``)
- ``pack``       the whole embedded pack in order
- ``head``       feature-level draft heads (EAGLE / EAGLE-3 / MSD): losses, data, DDP (``train head``)
- ``align``      the substitute encoder fitted to the draft's video features (``train align``)
- ``video``      the embedded Video-LLaVA pair (``train video``)

The command line is :mod:`mmspec.cli.train`. Nothing is imported here, so ``import mmspec.train``
stays cheap. ``train`` may use ``bench`` (its JSONL store and metrics); the decoder side
(``models/``, ``embedded.py``) and ``bench`` never import ``train``.
"""
