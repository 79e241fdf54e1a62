"""Drafting for every row of a step at once: the tree maths every drafter shares (:mod:`.trees`),
the in-batch ensemble of a draft model's views (:mod:`.ensemble`), feature-level heads
(:mod:`.heads`), model-free proposals beside them or alone (:mod:`.proposals`) and adaptive
ensemble weights (:mod:`.weights`). How a view shows the draft the prompt is
:mod:`mmspec.drafting.views` / :mod:`mmspec.multimodal`'s; the model-free searches :mod:`mmspec.drafting.lookup`'s,
the weighting rules :mod:`mmspec.drafting.adaptive`'s, the tree shapes :mod:`mmspec.drafting.tree`'s."""
