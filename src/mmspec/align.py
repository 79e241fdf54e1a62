"""Moved: the substitute encoder's alignment lives in :mod:`mmspec.train.align` (one training home, issue 35)."""

raise ImportError("mmspec.align moved to mmspec.train.align: import AlignConfig, train_align, world_pairs "
                  "from mmspec.train.align")
