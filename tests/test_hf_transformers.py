"""Hugging Face transformers both ways: an export loads in transformers' CLIPModel and CLIPProcessor with OpenCLIP's
tokens and features, and a CLIPModel folder written by transformers is a checkpoint wherever clip_jax takes one."""

import argparse
import dataclasses
import json
import os

import jax
import numpy as np
import open_clip
import pytest
import torch
import transformers
from hf_layouts import cosines, embedded, in_layout
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image

import clip_jax
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import benchmark_cli, zeroshot
from clip_jax.interop import convert, export, hf_clip, hf_folder, weight_files
from clip_jax.interop.export import export_open_clip
from clip_jax.interop.opener import load_pretrained_variables, open_model
from clip_jax.models import get_model_config
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD
from clip_jax.runtime import ownership

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)  # neither OpenAI's nor transformers' defaults: the files must carry them
TEXTS = ["a photo of a shoe", "A Bag!!  with\tspaces", "it's 42 degrees, isn't it?", "café naïve résumé",
         " ".join(["long"] * 90)]  # the last one is cut to the context, ending in the end-of-text token
# Image sizes (height, width) whose centre crop both libraries place alike (see the crop test below).
SIZES = [(37, 53), (64, 48), (32, 32), (101, 40), (31, 90)]


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _export(tmp_path, open_clip_cfg, seed):
    folder = tmp_path / "export"
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(open_clip_cfg, seed=seed)), open_clip_cfg)
    assert export_open_clip(params, get_model_config(open_clip_cfg), str(folder), mean=MEAN, std=STD) is None
    return folder, params


@pytest.mark.slow
@pytest.mark.parametrize("activation", [{}, {"quick_gelu": True}])
def test_an_export_loads_in_transformers_with_open_clips_tokens_and_features(tmp_path, activation):
    cfg = {**TINY_77, **activation}
    folder, _ = _export(tmp_path, cfg, seed=4)
    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    processor = transformers.CLIPProcessor.from_pretrained(str(folder), backend="pil")
    reference, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    reference.eval()
    images = _images(SIZES)
    inputs = processor(text=TEXTS, images=images, return_tensors="pt", padding="max_length", truncation=True)

    tokens = open_clip.get_tokenizer(f"local-dir:{folder}")(TEXTS)
    assert inputs["input_ids"].shape == tokens.shape == (len(TEXTS), 77)
    for ids, expected in zip(inputs["input_ids"].tolist(), tokens.tolist()):
        end = expected.index(49407) + 1
        assert ids[:end] == expected[:end]  # then transformers pads with the end-of-text token, OpenCLIP with 0
    pixels = torch.stack([preprocess(image) for image in images])
    np.testing.assert_array_equal(inputs["pixel_values"].numpy(), pixels.numpy())

    with torch.no_grad():
        out = model(**inputs)
        expected_image = reference.encode_image(pixels, normalize=True)
        expected_text = reference.encode_text(tokens, normalize=True)
    np.testing.assert_allclose(out.image_embeds.numpy(), expected_image.numpy(), atol=1e-4)
    np.testing.assert_allclose(out.text_embeds.numpy(), expected_text.numpy(), atol=1e-4)
    assert model.logit_scale.item() == reference.logit_scale.item()


def test_transformers_crops_an_odd_margin_one_pixel_before_open_clip(tmp_path):
    """A known difference of the two image pipelines, not of the export: for a margin of 4k + 3 pixels, OpenCLIP
    (torchvision) starts the crop at round((4k + 3) / 2) = 2k + 2 and transformers at (4k + 3) // 2 = 2k + 1. The
    pixels are otherwise the same."""
    folder, _ = _export(tmp_path, TINY_77, seed=1)
    processor = transformers.CLIPProcessor.from_pretrained(str(folder), backend="pil")
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    (image,) = _images([(32 + 7, 32)])
    ours = processor(images=image, return_tensors="pt")["pixel_values"][0].numpy()
    theirs = preprocess(image).numpy()
    assert not np.array_equal(ours, theirs)
    np.testing.assert_array_equal(ours[:, 1:], theirs[:, :-1])


def test_the_transformers_files_describe_the_model(tmp_path):
    folder, params = _export(tmp_path, TINY_77, seed=2)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "clip" and config["projection_dim"] == 48
    assert config["text_config"]["projection_dim"] == config["vision_config"]["projection_dim"] == 48
    assert config["text_config"]["hidden_act"] == config["vision_config"]["hidden_act"] == "gelu"
    assert config["text_config"]["eos_token_id"] == 49407
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    assert (preprocessor["image_mean"], preprocessor["image_std"]) == (list(MEAN), list(STD))
    assert preprocessor["size"] == {"shortest_edge": 32} and preprocessor["crop_size"] == {"height": 32, "width": 32}
    # transformers' own CLIPModel of that config has exactly the tensors written, of the same shapes
    built = transformers.CLIPModel(transformers.CLIPConfig(**config))
    written = weight_files.read_arrays(str(folder / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in built.state_dict().items()} == {k: v.shape for k, v in written.items()}
    # the folder holds both layouts and is read as OpenCLIP's, as before
    assert open_model(str(folder)).config == dataclasses.replace(get_model_config(TINY_77), name="export")


@pytest.mark.parametrize("options", [{}, {"quick_gelu": True}, {"act_kwargs": {"approximate": "tanh"},
                                                                "norm_kwargs": {"eps": 1e-6}}])
def test_conversion_both_ways_is_bit_for_bit(options):
    towers = {k: {**TINY_77[k], **{o: v for o, v in options.items() if o != "quick_gelu"}}
              for k in ("vision_cfg", "text_cfg")}
    config = get_model_config({**TINY_77, **towers, **({"quick_gelu": True} if "quick_gelu" in options else {})})
    assert hf_clip.config_from_hf(hf_clip.hf_config(config), name=config.name) == config
    state_dict = state_dict_numpy(open_clip_model({**TINY_77}, seed=6))
    hf_state_dict = hf_clip.to_hf_state_dict(state_dict, config)
    back = hf_clip.from_hf_state_dict(hf_state_dict, config, "model.safetensors")
    assert back.keys() == state_dict.keys()
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
        assert back[key].dtype == value.dtype


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A CLIPModel folder as transformers writes it (openai/clip-vit-large-patch14's layout, model and processor),
    its LayerNorms and biases moved from their init; and the model."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-clip"
    config = transformers.CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 2},
        vision_config={"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 3,
                       "image_size": 32, "patch_size": 8},
        projection_dim=24)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                       image_mean=list(MEAN), image_std=list(STD)).save_pretrained(str(folder))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    return folder, model


def _hf_features(model, pixels, tokens):
    with torch.no_grad():
        image = model.get_image_features(pixel_values=torch.from_numpy(np.asarray(pixels)).permute(0, 3, 1, 2))
        text = model.get_text_features(input_ids=torch.from_numpy(np.asarray(tokens)).long())
    image, text = image.pooler_output.numpy(), text.pooler_output.numpy()
    return (image / np.linalg.norm(image, axis=-1, keepdims=True), text / np.linalg.norm(text, axis=-1, keepdims=True))


@pytest.mark.slow
def test_a_transformers_folder_is_a_checkpoint_with_its_model_and_preprocessing(hf_model):
    folder, reference = hf_model
    model, params, _, eval_transform = clip_jax.create_model_and_transforms(None, pretrained=str(folder))
    assert model.config.quick_gelu and model.config.vision.width == 48 and model.config.embed_dim == 24
    pixels = np.stack([eval_transform(image) for image in _images(SIZES)])
    normalised = (np.asarray(_images([(32, 32)])[0], np.float32) / 255 - np.array(MEAN)) / np.array(STD)
    np.testing.assert_allclose(eval_transform(_images([(32, 32)])[0]), normalised, atol=1e-6)  # the folder's mean/std
    tokens = clip_jax.get_tokenizer(model.config)(TEXTS)
    image_f = model.apply({"params": params}, pixels, method="encode_image")
    text_f = model.apply({"params": params}, tokens, method="encode_text")
    expected_image, expected_text = _hf_features(reference, pixels, tokens)
    np.testing.assert_allclose(image_f, expected_image, atol=1e-5)
    np.testing.assert_allclose(text_f, expected_text, atol=1e-5)

    # benchmark eval --pretrained and the trainer's pretrained= read the same weights
    loaded = benchmark_cli.load_model(argparse.Namespace(pretrained=str(folder), model=None))
    assert loaded[3:5] == (MEAN, STD)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded[1]), jax.device_get(params))
    variables = load_pretrained_variables(str(folder), model.config)
    jax.tree.map(np.testing.assert_array_equal, variables["params"], jax.device_get(params))

    # and back: the weights exported again are transformers' own, bit for bit
    state_dict = convert.variables_to_open_clip(variables, model.config)
    again = hf_clip.to_hf_state_dict(state_dict, model.config)
    assert again.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(again[key], value.numpy(), err_msg=key)


@pytest.mark.slow
def test_the_eval_script_takes_a_transformers_folder(hf_model, tmp_path):
    folder, _ = hf_model
    output = tmp_path / "report.json"
    assert zeroshot.main(["--checkpoint", str(folder), "--demo", "--limit", "64", "--no-progress",
                          "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["model"] == "tiny-clip" and report["mean"] == list(MEAN) and report["std"] == list(STD)


def test_a_transformers_folder_of_another_model_or_with_damaged_weights_gets_one_line(hf_model, tmp_path, capsys):
    folder, _ = hf_model
    assert zeroshot.main(["--model", "ViT-B-32-quickgelu", "--checkpoint", str(folder), "--demo"]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1
    assert f"{folder} holds another model than ViT-B-32-quickgelu" in error and "vision width 48 (not 768)" in error

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((folder / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:5000])
    assert zeroshot.main(["--checkpoint", str(damaged), "--demo"]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1
    assert "model.safetensors is not a readable safetensors file" in error

    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(InvalidInput, match="is a transformers 'bert' model; clip_jax reads CLIPModel"):
        clip_jax.create_model_and_transforms(None, pretrained=str(other))


@pytest.mark.slow
def test_a_model_transformers_cannot_hold_is_exported_for_open_clip_alone(tmp_path, capsys):
    """A SigLIP head has a logit_bias CLIPModel lacks: OpenCLIP's files are written, transformers' are not, and
    those an earlier export of clip_jax's left there (of another model) are removed; a file of someone else's
    stays."""
    siglip = {**TINY_77, "init_logit_scale": 2.3, "init_logit_bias": -10.0}
    params = convert.from_open_clip({**state_dict_numpy(open_clip_model(TINY_77, seed=3)),
                                     "logit_bias": np.float32(-10.0)}, siglip)
    source, model_json = tmp_path / "siglip.npz", tmp_path / "siglip.json"
    weight_files.save_params(str(source), params)
    model_json.write_text(json.dumps(siglip))
    folder, _ = _export(tmp_path, TINY_77, seed=3)  # an earlier export, with transformers' files
    (folder / "README.md").write_text("my model card\n")
    assert export.main([str(source), str(folder), "--model", str(model_json)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == ("note: no transformers files: siglip has no CLIPModel counterpart, as it has a "
                           "logit_bias (a SigLIP head)")
    assert sorted(os.listdir(folder)) == [".clip_jax-written", "README.md", "open_clip_config.json",
                                          "open_clip_model.safetensors"]
    reference, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    assert reference.logit_bias.item() == -10.0


def test_an_export_never_replaces_a_transformers_file_of_someone_elses(tmp_path, capsys):
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "bert"}\n')
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    source = tmp_path / "tiny.npz"
    weight_files.save_params(str(source), convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77)), TINY_77))
    model_json = tmp_path / "tiny.json"
    model_json.write_text(json.dumps(TINY_77))
    assert export.main([str(source), str(out), "--model", str(model_json)]) == 2
    error = capsys.readouterr().err
    assert "holds 1 file clip_jax did not write (config.json)" in error and len(error.strip().splitlines()) == 1
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert export.main([str(source), str(out), "--model", str(model_json), "--no-transformers"]) == 0
    assert (out / "config.json").read_bytes() == before["config.json"]
    assert ownership.foreign_names(str(out)) == ["config.json"]


def test_openais_config_layout_reads_as_the_quickgelu_model_it_is(tmp_path):
    """openai/clip-vit-large-patch14's config.json, as older transformers wrote it: every field dumped, the legacy
    `*_config_dict` beside `*_config`, token ids bos 0 / eos 2 / pad 1 (eos 2 makes CLIPModel pool the largest id)."""
    generation = {"id2label": {"0": "LABEL_0"}, "max_length": 20, "dropout": 0.0, "attention_dropout": 0.0,
                  "initializer_range": 0.02, "initializer_factor": 1.0}
    text = {"model_type": "clip_text_model", "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
            "num_hidden_layers": 12, "max_position_embeddings": 77, "vocab_size": 49408, "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-05, "projection_dim": 768, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
            **generation}
    vision = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "image_size": 224,
              "patch_size": 14, "num_attention_heads": 16, "num_hidden_layers": 24, "hidden_act": "quick_gelu",
              "layer_norm_eps": 1e-05, "projection_dim": 768, "num_channels": 3, **generation}
    folder = tmp_path / "clip-vit-large-patch14"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPModel"], "model_type": "clip",
        "initializer_factor": 1.0, "logit_scale_init_value": 2.6592, "projection_dim": 768,
        "text_config": text, "text_config_dict": {"hidden_size": 768, "intermediate_size": 3072},
        "vision_config": vision, "vision_config_dict": {"hidden_size": 1024, "patch_size": 14},
        "torch_dtype": "float32", "transformers_version": "4.16.0.dev0"}))
    expected = dataclasses.replace(get_model_config("ViT-L-14-quickgelu"), name="clip-vit-large-patch14")
    assert open_model(str(folder)).config == expected
    with pytest.raises(InvalidInput, match=r"holds another model than ViT-L-14 \(its config.json: quick_gelu True "
                                           r"\(not False\)\): leave the model out"):
        load_pretrained_variables(str(folder), "ViT-L-14")
    with pytest.raises(FileNotFoundError, match="no model weights in .*clip-vit-large-patch14: a transformers"):
        load_pretrained_variables(str(folder), "ViT-L-14-quickgelu")  # the model matches; the weights are not there


@pytest.mark.slow
def test_embed_takes_a_transformers_folder_and_gives_its_features(hf_model, tmp_path):
    from clip_jax.evaluation import embed

    folder, reference = hf_model
    photos = tmp_path / "photos"
    photos.mkdir()
    for i, image in enumerate(_images(SIZES)):
        image.save(photos / f"{i}.png")
        (photos / f"{i}.txt").write_text(TEXTS[i])
    out = tmp_path / "out"
    assert embed.main(["--input_dataset", str(photos), "--output_folder", str(out), "--clip_model", str(folder)]) == 0
    model, _, _, eval_transform = clip_jax.create_model_and_transforms(None, pretrained=str(folder))
    pixels = np.stack([eval_transform(image) for image in _images(SIZES)])
    expected_image, expected_text = _hf_features(reference, pixels, clip_jax.get_tokenizer(model.config)(TEXTS[:5]))
    for got, expected in ((np.load(out / "img_emb" / "img_emb_0.npy"), expected_image),
                          (np.load(out / "text_emb" / "text_emb_0.npy"), expected_text)):
        assert got.dtype == np.float16 and got.shape == expected.shape
        cosine = np.sum(got.astype(np.float32) * expected, axis=-1) / np.linalg.norm(got.astype(np.float32), axis=-1)
        assert cosine.min() >= 0.999, cosine



@pytest.mark.parametrize("layout", ["processor", "preprocessor"])
def test_embed_reads_a_clip_folder_in_either_transformers_layout_as_transformers_does(hf_model, tmp_path, layout):
    """The image processor's mean .25/.5/.75 and std .2/.3/.4 at 32 px: transformers' own pixels and token ids
    into transformers' model give what `embed` gives of the folder."""
    folder, reference = hf_model
    vocabulary = tmp_path / "vocabulary"  # CLIPTokenizer's vocab.json and merges.txt, read by from_pretrained
    vocabulary.mkdir()
    for name, text in hf_folder.clip_tokenizer_files(77).items():
        (vocabulary / name).write_text(text)
    processor = transformers.CLIPProcessor(
        image_processor=transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32,
                                                                                                  "width": 32},
                                                           image_mean=[0.25, 0.5, 0.75], image_std=[0.2, 0.3, 0.4]),
        tokenizer=transformers.CLIPTokenizer.from_pretrained(str(vocabulary)))
    saved = in_layout(folder, layout, tmp_path, processor)
    photos = tmp_path / "photos"
    photos.mkdir()
    images = _images(SIZES, seed=7)
    for i, image in enumerate(images):
        image.save(photos / f"{i}.png")
        (photos / f"{i}.txt").write_text(TEXTS[i])
    inputs = processor(text=TEXTS, images=images, return_tensors="pt", padding="max_length", truncation=True)
    with torch.no_grad():
        expected_image = reference.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output.numpy()
        expected_text = reference.get_text_features(input_ids=inputs["input_ids"]).pooler_output.numpy()
    image_emb, text_emb = embedded(saved, photos, tmp_path / "out")
    assert cosines(image_emb, expected_image).min() >= 0.9999
    assert cosines(text_emb, expected_text).min() >= 0.9999


def test_a_folder_without_an_image_processor_says_what_it_assumes_in_one_line(hf_model, tmp_path, capsys):
    folder, _ = hf_model
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    opened = open_model(str(bare))
    assert opened.normalization() == (OPENAI_MEAN, OPENAI_STD) and opened.resize_mode == "shortest"
    note = capsys.readouterr().out.strip()
    assert note == (f"note: {bare} has no image processor (processor_config.json or preprocessor_config.json): "
                    "assuming CLIPImageProcessor's defaults: size 32, mean (0.4815, 0.4578, 0.4082), std (0.2686, "
                    "0.2613, 0.2758), resize the shortest side to 32 px, then a 32 px center crop (save the model's "
                    "processor beside it, or give --mean/--std, to read it otherwise)")
