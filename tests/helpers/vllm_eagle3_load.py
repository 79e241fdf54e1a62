"""Run by a Python that has vLLM (not imported by the tests): build vLLM's own EAGLE-3 drafter,
``vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM``, for a target directory and
an exported head directory, and load the head's weights with its own ``load_weights``; print
``RESULT {json}`` (draft_vocab_size, the draft-to-target offsets it holds, or null).

    python vllm_eagle3_load.py TARGET_DIR HEAD_DIR PORT
"""

import json
import sys

from safetensors.torch import load_file
from vllm.config import (
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

target_dir, head_dir, port = sys.argv[1:4]
mc = ModelConfig(model=target_dir, skip_tokenizer_init=True, dtype="float32")
pc = ParallelConfig()
sc = SpeculativeConfig(method="eagle3", model=head_dir, num_speculative_tokens=3, target_model_config=mc,
                       target_parallel_config=pc)
vc = VllmConfig(model_config=mc, speculative_config=sc, parallel_config=pc, device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel(1, 1)
    model = Eagle3LlamaForCausalLM(vllm_config=vc)
    model.load_weights(load_file(f"{head_dir}/model.safetensors").items())
d2t = model.draft_id_to_target_id
print("RESULT " + json.dumps({"draft_vocab_size": model.config.draft_vocab_size,
                              "d2t": None if d2t is None else d2t.tolist()}))
