"""Hugging Face transformers' SiglipModel both ways: a clip_jax SigLIP model written as a SiglipModel folder loads in
transformers with clip_jax's embeddings and logits, a folder transformers wrote is read with transformers' own, the
conversions are exact both ways, SigLIP's "squash" eval transform gives SiglipImageProcessor's pixels, and what
clip_jax does not build (a tower without its head, ...) is refused in one line."""

import dataclasses
import io
import json
import os
import random

import jax
import numpy as np
import open_clip
import pytest
import torch
import transformers
from PIL import Image

from hf_layouts import moved_from_init, off_init

from clip_jax.data.transforms import eval_crop, normalize
from clip_jax.errors import InvalidInput
from clip_jax.interop import convert, hf_folder, hf_siglip
from clip_jax.interop.opener import open_model
from clip_jax.models.clip import create_model, init_params
from clip_jax.models.registry import get_model_config

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)  # not SigLIP's 0.5: the files must carry them
TOWER = {"no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6}}
# Towers of different widths, heads, MLP ratios and GELUs (SiglipModel: one hidden_act per tower).
SIGLIP = {"embed_dim": 64, "init_logit_bias": -10, "custom_text": True,
          "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16,
                         "pool_type": "map", "no_ln_pre": True, "norm_kwargs": {"eps": 1e-6},
                         "act_kwargs": {"approximate": "tanh"}},
          "text_cfg": {"context_length": 16, "vocab_size": 120, "width": 48, "heads": 2, "layers": 3,
                       "mlp_ratio": 3.5, **TOWER}}
TEXTS = ["a photo of a cat", "two red birds on the grass", "a big blue dog with a small cat " * 3]
SIZES = [(37, 53), (64, 48), (101, 40), (31, 90), (20, 17)]  # (height, width), none square
# Smooth non-square images (photographs rather than noise), where transformers' default image processor (torchvision)
# and PIL differ by at most one 8-bit step (see the squash test).
SMOOTH = [(37, 53), (64, 48), (101, 40), (150, 200), (333, 500)]


def _noise(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _smooth(sizes):
    images = []
    for h, w in sizes:
        y, x = np.mgrid[0:h, 0:w]
        rgb = 128 + 100 * np.stack([np.sin(x / 5.0), np.cos(y / 7.0), np.sin((x + y) / 9.0)], axis=-1)
        images.append(Image.fromarray(rgb.astype(np.uint8)))
    return images


def _pixels(images, mode="squash"):
    return np.stack([normalize(eval_crop(image, 32, mode), MEAN, STD) for image in images])


class ToyTokenizer:
    """A SentencePiece tokenizer trained here, saved with transformers' SiglipTokenizer: an object with
    `save(folder)`, whose files `hf_folder.saved_tokenizer` gives to `write_hf_files`."""

    def __init__(self, folder):
        import sentencepiece

        words = "a photo of the cat dog bird on grass red blue green big small picture with two three".split()
        pick = random.Random(0)
        sentences = [" ".join(pick.choice(words) for _ in range(8)) for _ in range(300)]
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=40,
                                                 pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
        (folder / "toy.model").write_bytes(model.getvalue())
        self.hf = transformers.SiglipTokenizer(vocab_file=str(folder / "toy.model"), model_max_length=16)

    def save(self, folder):
        """Refuses to replace a file, as clip_jax's SentencePieceTokenizer does."""
        assert not {"spiece.model", "tokenizer_config.json"} & set(os.listdir(folder)), os.listdir(folder)
        return list(self.hf.save_pretrained(str(folder)))


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """A clip_jax SigLIP model written as a SiglipModel folder: (folder, config, model, params)."""
    config = get_model_config(SIGLIP)
    model = create_model(config)
    params = off_init(init_params(model, jax.random.key(0)), seed=1)
    folder = tmp_path_factory.mktemp("siglip") / "export"
    folder.mkdir()
    tokenizer = ToyTokenizer(tmp_path_factory.mktemp("tokenizer"))
    tokenizer_files = hf_folder.saved_tokenizer(tokenizer)
    names = hf_folder.hf_files(config, tokenizer_files)
    hf_folder.write_hf_files(str(folder), convert.to_open_clip(params, config), config, mean=MEAN, std=STD,
                             tokenizer_files=tokenizer_files, resize_mode="squash")
    assert sorted(os.listdir(folder)) == sorted(names)
    assert names == ("config.json", "model.safetensors", "preprocessor_config.json", "spiece.model",
                     "tokenizer_config.json")
    # written again over them (an export of the same folder again)
    hf_folder.write_hf_files(str(folder), convert.to_open_clip(params, config), config, mean=MEAN, std=STD,
                             tokenizer_files=tokenizer_files, resize_mode="squash")
    return folder, config, model, params


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    """A SiglipModel folder as transformers writes it (exact GELU in the image tower, tanh in the text tower, the
    text tower narrower than the image tower and projected to its width), with the image processor; and the
    model."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-siglip"
    config = transformers.SiglipConfig(
        text_config={"vocab_size": 200, "hidden_size": 32, "intermediate_size": 80, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 12, "projection_size": 48},
        vision_config={"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 3,
                       "image_size": 32, "patch_size": 8, "hidden_act": "gelu", "layer_norm_eps": 1e-5})
    torch.manual_seed(0)
    model = moved_from_init(transformers.SiglipModel(config).eval())
    model.save_pretrained(str(folder))
    transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32}, image_mean=list(MEAN),
                                         image_std=list(STD)).save_pretrained(str(folder))
    return folder, model


def _features(model, pixels, tokens):
    with torch.no_grad():
        image = model.get_image_features(pixel_values=torch.from_numpy(np.asarray(pixels)).permute(0, 3, 1, 2))
        text = model.get_text_features(input_ids=torch.from_numpy(np.asarray(tokens)).long())
    return image.pooler_output.numpy(), text.pooler_output.numpy()


def test_an_export_loads_in_transformers_with_our_embeddings_and_logits(ours):
    folder, config, model, params = ours
    reference = transformers.SiglipModel.from_pretrained(str(folder)).eval()
    processor = transformers.SiglipProcessor.from_pretrained(str(folder), backend="pil")
    images = _noise(SIZES)
    inputs = processor(text=TEXTS, images=images, return_tensors="pt", padding="max_length", max_length=16,
                       truncation=True)
    pixels, tokens = _pixels(images), inputs["input_ids"].numpy()
    np.testing.assert_array_equal(inputs["pixel_values"].permute(0, 2, 3, 1).numpy(), pixels)

    image = model.apply({"params": params}, pixels, normalize=False, method="encode_image")
    text = model.apply({"params": params}, tokens, normalize=False, method="encode_text")
    expected_image, expected_text = _features(reference, pixels, tokens)
    np.testing.assert_allclose(image, expected_image, atol=1e-5)
    np.testing.assert_allclose(text, expected_text, atol=1e-5)

    assert reference.logit_scale.item() == float(params["logit_scale"])
    assert reference.logit_bias.item() == float(params["logit_bias"])
    with torch.no_grad():  # no attention_mask: SigLIP's text tower attends to the padding too, as it was trained
        logits = reference(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits_per_image.numpy()
    image_n, text_n, scale, bias = model.apply({"params": params}, pixels, tokens)
    np.testing.assert_allclose(scale * np.asarray(image_n) @ np.asarray(text_n).T + bias, logits, atol=1e-4)


def test_the_transformers_files_describe_the_model(ours):
    folder, config, _, _ = ours
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["SiglipModel"] and saved["model_type"] == "siglip"
    assert saved["vision_config"]["hidden_act"] == "gelu_pytorch_tanh" and saved["text_config"]["hidden_act"] == "gelu"
    assert saved["text_config"]["projection_size"] == 64 and saved["text_config"]["max_position_embeddings"] == 16
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"height": 32, "width": 32} and "do_center_crop" not in preprocessor
    assert (preprocessor["image_mean"], preprocessor["image_std"]) == (list(MEAN), list(STD))
    # transformers' own SiglipModel of that config has exactly the tensors written, of the same shapes
    from clip_jax.interop.weight_files import read_arrays

    built = transformers.SiglipModel(transformers.SiglipConfig(**saved))
    written = read_arrays(str(folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in built.state_dict().items()} == {k: v.shape for k, v in written.items()}
    # and the folder reads back as the model it holds, with its preprocessing
    assert hf_folder.hf_model_config(str(folder)) == dataclasses.replace(config, name="export")
    opened = open_model(str(folder))
    assert (opened.config.vision, opened.config.embed_dim) == (config.vision, config.embed_dim)
    assert opened.preprocessing == {"mean": MEAN, "std": STD, "resize_mode": "squash"}


def test_a_transformers_folder_reads_as_its_model_with_its_embeddings(theirs):
    folder, reference = theirs
    opened = open_model(str(folder))
    config = opened.config
    assert (config.vision.block.gelu_approximate, config.text.block.gelu_approximate) == ("none", "tanh")
    assert (config.vision.block.norm_eps, config.text.block.norm_eps) == (1e-5, 1e-6)
    assert (config.embed_dim, config.text.width, config.text.context_length) == (48, 32, 12)
    assert opened.preprocessing == {"mean": MEAN, "std": STD, "resize_mode": "squash"}
    model, params = create_model(config), opened.variables()["params"]
    pixels = _pixels(_noise(SIZES, seed=3))
    tokens = np.random.default_rng(4).integers(0, 200, (4, 12)).astype(np.int32)
    expected_image, expected_text = _features(reference, pixels, tokens)
    image = model.apply({"params": params}, pixels, normalize=False, method="encode_image")
    text = model.apply({"params": params}, tokens, normalize=False, method="encode_text")
    np.testing.assert_allclose(image, expected_image, atol=1e-5)
    np.testing.assert_allclose(text, expected_text, atol=1e-5)



def test_transformers_siglip_tokenizers_attention_mask_is_not_how_the_text_tower_reads(theirs, tmp_path):
    """The README's note: transformers 5's SiglipTokenizer returns an attention_mask, with which SiglipModel masks the
    padding; the text tower attends to it (as trained), so ours is transformers' given `input_ids` alone."""
    folder, reference = theirs
    inputs = ToyTokenizer(tmp_path).hf(TEXTS, padding="max_length", max_length=12, truncation=True,
                                       return_tensors="pt")
    assert "attention_mask" in inputs and not inputs["attention_mask"].all()
    opened = open_model(str(folder))
    ours = create_model(opened.config).apply(opened.variables(), inputs["input_ids"].numpy(), normalize=False,
                                             method="encode_text")
    with torch.no_grad():
        alone = reference.get_text_features(input_ids=inputs["input_ids"]).pooler_output.numpy()
        masked = reference.get_text_features(**inputs).pooler_output.numpy()
    np.testing.assert_allclose(ours, alone, atol=1e-5)
    assert np.abs(np.asarray(ours) - masked).max() > 1e-2

def test_conversion_both_ways_is_bit_for_bit(ours, theirs):
    _, config, _, params = ours
    for options in ({}, {"quick_gelu": True, "vision_cfg": {**SIGLIP["vision_cfg"], "act_kwargs": {}}}):
        variant = get_model_config({**SIGLIP, **options})
        assert hf_siglip.config_from_hf(hf_siglip.hf_config(variant), name=variant.name) == variant
    # ours -> transformers -> ours
    state_dict = convert.to_open_clip(params, config)
    back = hf_siglip.from_hf_state_dict(hf_siglip.to_hf_state_dict(state_dict, config), config, "model.safetensors")
    assert back.keys() == state_dict.keys()
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
    # transformers' -> ours (params) -> transformers', the tensors of transformers' own model
    folder, reference = theirs
    held = hf_folder.hf_model_config(str(folder))
    params = convert.from_open_clip(hf_folder.read_hf_state_dict(str(folder), held), held)
    again = hf_siglip.to_hf_state_dict(convert.to_open_clip(params, held), held)
    assert again.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(again[key], value.numpy(), err_msg=key)


def test_squash_gives_siglip_image_processors_pixels(ours):
    """On non-square images: transformers' PIL image processor, and OpenCLIP's "squash" eval transform, exactly.
    transformers' default SiglipImageProcessor resizes with torchvision, whose antialiased bicubic on uint8 rounds
    differently from Pillow's and, for noise, may run the two 1-D passes in the other order (Pillow runs the larger
    reduction first; its 8-bit intermediate is clipped), up to 13 8-bit steps apart on random pixels; on smooth
    images it is within one 8-bit step (1/255/std after normalisation), the tolerance here."""
    folder = ours[0]
    images = _noise(SIZES, seed=5) + _smooth(SMOOTH)
    pixels = _pixels(images)
    pil = transformers.AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    assert type(pil).__name__ == "SiglipImageProcessorPil"
    got = pil(images=images, return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(got, pixels)
    preprocess = open_clip.image_transform(32, is_train=False, mean=MEAN, std=STD, resize_mode="squash",
                                           interpolation="bicubic")
    got = np.stack([preprocess(image).permute(1, 2, 0).numpy() for image in images])
    np.testing.assert_allclose(got, pixels, atol=1e-6)

    default = transformers.AutoImageProcessor.from_pretrained(str(folder))
    assert type(default).__name__ == "SiglipImageProcessor"  # the torchvision backend
    smooth = _smooth(SMOOTH)
    got = default(images=smooth, return_tensors="np")["pixel_values"].transpose(0, 2, 3, 1)
    step = 1 / 255 / np.asarray(STD, np.float32)
    assert np.all(np.abs(got - _pixels(smooth)) <= step + 1e-5)
    # and the default mode is the shortest side and a center crop, as before
    assert eval_crop(images[0], 32).shape == (32, 32, 3) and not np.array_equal(eval_crop(images[0], 32),
                                                                               eval_crop(images[0], 32, "squash"))


def _refusal(folder, config_json: dict, name: str = "config.json") -> str:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(config_json))
    with pytest.raises(InvalidInput) as info:
        if name == "config.json":
            hf_folder.hf_model_config(str(folder))
        else:
            hf_folder.hf_preprocessing(str(folder))
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert str(folder / name) in message, message
    return message


def test_what_clip_jax_does_not_build_is_refused_in_one_line(tmp_path, ours):
    siglip = json.loads((ours[0] / "config.json").read_text())
    siglip2 = {**siglip, "model_type": "siglip2", "architectures": ["Siglip2Model"],
               "vision_config": {**siglip["vision_config"], "num_patches": 20}}
    assert "num_patches=20" in _refusal(tmp_path / "a", siglip2)  # a Siglip2Model's position grid is a square
    no_head = {**siglip, "vision_config": {**siglip["vision_config"], "vision_use_head": False}}
    assert "vision_config.vision_use_head=false" in _refusal(tmp_path / "b", no_head)
    narrow = {**siglip, "text_config": {**siglip["text_config"], "projection_size": 32}}
    assert "text_config.projection_size=32 is not vision_config.hidden_size=64" in _refusal(tmp_path / "c", narrow)
    oblong = {**siglip, "vision_config": {**siglip["vision_config"], "image_size": [32, 48]}}
    assert "vision_config.image_size=[32, 48]" in _refusal(tmp_path / "d", oblong)
    mixed = {**siglip, "vision_config": {**siglip["vision_config"], "hidden_act": "quick_gelu"}}
    assert "one tower is QuickGELU" in _refusal(tmp_path / "e", mixed)
    assert "is a transformers 'bert' model; clip_jax reads CLIPModel and SiglipModel" in _refusal(
        tmp_path / "f", {"model_type": "bert"})
    # the image processor: a crop after the squash, an oblong size
    squash = json.loads((ours[0] / "preprocessor_config.json").read_text())
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps(siglip))
    assert "do_center_crop=true: a 24 x 24 px crop after squashing to 32 x 32" in _refusal(
        tmp_path / "g", {**squash, "do_center_crop": True, "crop_size": {"height": 24, "width": 24}},
        "preprocessor_config.json")
    assert "size={'height': 32, 'width': 48}" in _refusal(tmp_path / "g", {**squash, "size": {"height": 32,
                                                                                        "width": 48}},
                                                         "preprocessor_config.json")
    # a SigLIP export needs its tokenizer; a model SiglipModel cannot hold says why
    folder, config, _, params = ours
    with pytest.raises(InvalidInput, match="is a SigLIP model, whose transformers files include its SentencePiece"):
        hf_folder.write_hf_files(str(tmp_path), convert.to_open_clip(params, config), config, mean=MEAN, std=STD)
    with_ln_pre = get_model_config({**SIGLIP, "vision_cfg": {**SIGLIP["vision_cfg"], "no_ln_pre": False}})
    assert hf_folder.hf_unsupported(with_ln_pre) == ("it has a LayerNorm before the image blocks (ln_pre; "
                                                     "SiglipModel has none)")
    assert hf_folder.hf_unsupported(config) is None


def test_a_siglip_folder_without_an_image_processor_is_read_with_siglips_defaults_named_in_one_line(theirs, tmp_path,
                                                                                                   capsys):
    folder, _ = theirs
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    assert open_model(str(bare)).preprocessing == {"mean": (0.5,) * 3, "std": (0.5,) * 3, "resize_mode": "squash"}
    note = capsys.readouterr().out.strip()
    assert len(note.splitlines()) == 1 and note.startswith(f"note: {bare} has no image processor")
    assert ("assuming SiglipImageProcessor's defaults: size 32, mean (0.5, 0.5, 0.5), std (0.5, 0.5, 0.5), resize the "
            "whole image squashed to 32 x 32 px") in note
