"""HFCaptioner on a tiny encoder-decoder BLIP built from config, and the caption view fed by
images rebuilt from the target's pixel_values when no PIL images are passed."""

import pytest
import torch
from PIL import Image
from transformers import (
    BertTokenizerFast,
    BlipConfig,
    BlipForConditionalGeneration,
    BlipImageProcessorPil,
    BlipProcessor,
    BlipTextConfig,
    BlipVisionConfig,
)

from helpers.tiny import make_prompt
from mmspec import SpecDecoder
from mmspec.models.captioner import HFCaptioner

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "red", "blue", "square", "circle", "of"]


@pytest.fixture(scope="module")
def blip_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("blip")
    (d / "vocab.txt").write_text("\n".join(WORDS))
    tok = BertTokenizerFast(str(d / "vocab.txt"))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    torch.manual_seed(0)
    vc = BlipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          image_size=32, patch_size=8)
    tc = BlipTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, encoder_hidden_size=32, bos_token_id=tok.bos_token_id,
                        sep_token_id=tok.sep_token_id, eos_token_id=tok.sep_token_id, pad_token_id=0)
    model = BlipForConditionalGeneration(BlipConfig(vision_config=vc.to_dict(), text_config=tc.to_dict()))
    proc = BlipProcessor(image_processor=BlipImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok)
    model.save_pretrained(d / "model")
    proc.save_pretrained(d / "model")
    return d / "model"


def test_blip_captioner_loads_offline_and_captions(blip_dir):
    cap = HFCaptioner.from_pretrained(str(blip_dir), max_new_tokens=6)
    out = cap.caption([Image.new("RGB", (40, 40), (255, 0, 0)), Image.new("RGB", (40, 40), (0, 0, 255))])
    assert len(out) == 2 and all(isinstance(c, str) and c for c in out)
    assert all(set(c.split()) <= set(WORDS) for c in out)  # decoded from the BLIP vocabulary


def test_caption_view_rebuilds_images_from_pixel_values(target, draft_shared, tok):
    seen = []

    class Spy:
        def caption(self, images):
            seen.extend(images)
            return ["w7 w8"] * len(images)

    ids, pv = make_prompt(2, 16, seed=12)
    ref = target.generate(input_ids=ids, pixel_values=pv, do_sample=False, max_new_tokens=10)[0, ids.shape[1]:]
    dec = SpecDecoder(target, draft_shared, tok, views="C", captioner=Spy())
    assert dec.generate(ids, pv, max_new_tokens=10).token_ids == ref.tolist()
    assert len(seen) == 2 and all(isinstance(im, Image.Image) and im.size == (32, 32) for im in seen)


def test_decoder_only_captioner_takes_its_recorded_prompt_and_refuses_one_without_the_image_token():
    """A captioner dir from `mmspec train` records its prompt; from_pretrained uses it when none is
    given. A decoder-only VLM prompted without its image token fails with a clear error, not a
    shape error from inside transformers."""
    import json

    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError
    from mmspec.world import make_sample

    path = default_path() / "captioner"
    recorded = json.loads((path / "mmspec.json").read_text())["captioner_prompt"]
    cap = HFCaptioner.from_pretrained(str(path), max_new_tokens=12)
    assert cap.prompt == recorded and "<image>" in recorded
    chart, scene = make_sample("chartqa", "test", 0).images[0], make_sample("vqav2", "test", 0).images[0]
    captions = cap.caption([chart, scene])
    assert all(captions) and captions[0] != captions[1]  # it sees the image: two images, two captions
    with pytest.raises(MMSpecError, match="no prompt was given.*--captioner-prompt"):
        HFCaptioner(cap.model, cap.processor)
    with pytest.raises(MMSpecError, match="prompt 'USER: Describe it. ASSISTANT:' has no '<image>'.*--captioner-prompt"):
        HFCaptioner(cap.model, cap.processor, prompt="USER: Describe it. ASSISTANT:")
    given = "USER: <image> What is shown? ASSISTANT:"
    assert HFCaptioner.from_pretrained(str(path), prompt=given).prompt == given  # a given prompt wins


def test_bench_loads_a_trained_captioner_with_its_recorded_prompt_and_refuses_a_bad_one():
    """`mmspec bench run --captioner DIR` without --captioner-prompt uses the prompt the checkpoint
    records; a prompt without the image token fails at load, before any method runs."""
    import json

    from mmspec.bench.backend import load_models
    from mmspec.bench.config import BenchConfig
    from mmspec.embedded import default_path
    from mmspec.errors import MMSpecError

    root = default_path()
    dirs = {"target": str(root / "target"), "draft": str(root / "draft"), "captioner": str(root / "captioner")}
    models = load_models(BenchConfig(**dirs))
    recorded = json.loads((root / "captioner" / "mmspec.json").read_text())["captioner_prompt"]
    assert models.captioner.prompt == recorded
    with pytest.raises(MMSpecError, match="--captioner-prompt"):
        load_models(BenchConfig(**dirs, captioner_prompt="Describe it."))


def test_prompt_check_lets_processors_that_insert_the_image_token_through():
    """BLIP-2-style processors put the image tokens into input_ids themselves, so a prompt without
    the token (or no prompt) is fine there; a processor that does not is refused."""
    from types import SimpleNamespace

    from mmspec.errors import MMSpecError

    class Model:
        config = SimpleNamespace(is_encoder_decoder=False, image_token_id=5)

        def eval(self):
            return self

    class Processor:
        def __init__(self, inserts: bool):
            self.inserts = inserts

        def convert_ids_to_tokens(self, i):
            return "<img>"

        def __call__(self, images, text, return_tensors):
            ids = [7, 8] + ([5, 5] if self.inserts else [])  # [L]
            return {"input_ids": torch.tensor([ids])}

    for prompt in ("Question: what is shown? Answer:", None):
        assert HFCaptioner(Model(), Processor(inserts=True), prompt=prompt).prompt == prompt
        with pytest.raises(MMSpecError, match="'<img>'"):
            HFCaptioner(Model(), Processor(inserts=False), prompt=prompt)
