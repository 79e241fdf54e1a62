"""Moved: head training lives in :mod:`mmspec.train.head` (one training home, issue 35)."""

raise ImportError("mmspec.heads.train moved to mmspec.train.head: import HeadTrainConfig, train_head, "
                  "world_sequences, llava_instruct_sequences from mmspec.train.head")
