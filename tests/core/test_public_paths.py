"""Users' imports keep working across the redesign: what ``mmspec/__init__.py`` exports and the
module paths the README and docs name import the same names (training lives in ``mmspec.train``:
the stubs at ``mmspec.align`` and ``mmspec.heads.train`` that named the new paths are gone)."""

import importlib

import pytest

PUBLIC = {
    "mmspec": ["SpecDecoder", "GenerationResult", "GenerationStats", "MMSpecError", "load_embedded"],
    "mmspec.heads": ["VARIANTS", "FeatureHead", "HeadConfig", "build_head", "is_head_dir", "load_head"],
    "mmspec.world": ["FAMILIES", "make_sample"],
    "mmspec.bench.datasets": ["BenchSample"],
    "mmspec.events": ["EventStream"],
    "mmspec.substitutes": ["MAKERS"],
    "mmspec.embedded": ["load_embedded", "default_path"],
    "mmspec.inputs": ["load_images", "frame_prompt", "processor_inputs"],
    "mmspec.errors": ["MMSpecError"],
    "mmspec.models": ["ModelAdapter", "adapter_for", "load_model", "load_tokenizer"],
    "mmspec.models.captioner": ["HFCaptioner", "FixedCaptioner"],
    "mmspec.models.rows": ["RowCache", "full_attention"],
    "mmspec.batch": ["BatchScheduler", "StepEvent", "SpeculationPolicy"],
    "mmspec.heads.formats": ["load_external_head", "export_head", "detect_format"],
    "mmspec.train.loop": ["fit", "FitConfig"],
    "mmspec.train.align": ["AlignConfig", "train_align", "world_pairs"],
    "mmspec.train.head": ["HeadTrainConfig", "train_head", "world_sequences", "llava_instruct_sequences"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_documented_paths_import_their_names(module):
    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"
