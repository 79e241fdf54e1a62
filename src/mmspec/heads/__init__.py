"""Feature-level draft heads (EAGLE, EAGLE-3, MSD) that draft from the target's hidden states.

:mod:`.model` owns the head itself (config, weights, save/load, :func:`build_head`);
:mod:`mmspec.drafting.heads` drafts with it on the engine; :mod:`mmspec.train.head` trains it on
the target's own answers (``mmspec train head``).
"""

from mmspec.heads.directory import describe_head, head_kind, is_head_dir, load_head
from mmspec.heads.model import VARIANTS, FeatureHead, HeadConfig, build_head

__all__ = ["VARIANTS", "FeatureHead", "HeadConfig", "build_head", "describe_head", "head_kind", "is_head_dir",
           "load_head"]
