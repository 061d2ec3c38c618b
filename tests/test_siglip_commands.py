"""A transformers SiglipModel folder (saved with its image processor and a SentencePiece tokenizer) is a checkpoint
the commands take as is: `embed` gives transformers' embeddings of non-square images and their captions, `zeroshot`
transformers' predictions, each through the folder's own tokenizer; a tokenizer that is missing, on the Hub, or
another model's is one line before anything compiles."""

import io
import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers
from hf_layouts import in_layout
from PIL import Image

from clip_jax.data import fashion_mnist
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation import embed, zeroshot
from clip_jax.models import get_model_config
from clip_jax.text.model_tokenizer import tokenizer_for
from clip_jax.text.sentencepiece_tokenizer import train_sentencepiece

CAPTIONS = ["a red Dress, on a model!", "two ankle boots", "A bag; leather (brown)", "trousers 2024", "a shirt"]
SIZES = [(37, 53), (64, 48), (101, 40), (31, 90), (50, 20)]  # (height, width): none square
LIMIT = 256  # demo test images
MEAN, STD = (0.25, 0.5, 0.75), (0.2, 0.3, 0.4)  # not SiglipImageProcessor's 0.5: the folder must carry them
DEMO_MODEL = pathlib.Path(__file__).resolve().parent.parent / "configs" / "models" / "demo-tiny.json"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny SiglipModel transformers wrote, beside its SiglipImageProcessor (mean and std not its defaults) and a
    SigLIP-style vocabulary trained on the demo's captions and prompts; (folder, the model, transformers' tokenizer
    and image processor)."""
    root = tmp_path_factory.mktemp("siglip")
    texts = fashion_mnist.captions(np.arange(3000) % 10, seed=0) + CAPTIONS
    texts += [p for name in fashion_mnist.CLASS_NAMES for p in fashion_mnist.zeroshot_prompts(name)]
    vocab = train_sentencepiece(texts, root / "vocab", 300, "siglip", context_length=16)
    config = transformers.SiglipConfig(
        text_config={"vocab_size": vocab.vocab_size, "hidden_size": 48, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"hidden_size": 48, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 8})
    torch.manual_seed(0)
    model = transformers.SiglipModel(config).eval()
    with torch.no_grad():  # norms, biases, the probe and positions off their init
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(("bias", "probe", "position_embedding.weight")):
                p.add_(0.2 * torch.randn_like(p))
    path = root / "tiny-siglip"
    model.save_pretrained(str(path))
    transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32}, image_mean=list(MEAN),
                                         image_std=list(STD)).save_pretrained(str(path))
    for name in ("spiece.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(root / "vocab" / name, path / name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return path, model, tokenizer, transformers.SiglipImageProcessorPil.from_pretrained(str(path))


def _unit(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _transformers_features(model, tokenizer, processor, images=None, texts=None):
    with torch.no_grad():
        if images is not None:
            pixels = processor(images=images, return_tensors="pt")["pixel_values"]
            return _unit(model.get_image_features(pixel_values=pixels).pooler_output.numpy())
        ids = tokenizer(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
        return _unit(model.get_text_features(input_ids=ids["input_ids"]).pooler_output.numpy())


@pytest.mark.parametrize("layout", ["processor", "preprocessor"])
def test_embed_gives_transformers_embeddings_of_non_square_images_and_their_captions(folder, tmp_path, layout):
    """The folder as transformers 5 saves it (`processor_config.json`) and as transformers 4 did; its text tower
    fed `input_ids` alone (see the README: SigLIP attends to the padding)."""
    path, model, tokenizer, processor = folder
    path = in_layout(path, layout, tmp_path, transformers.SiglipProcessor(image_processor=processor,
                                                                           tokenizer=tokenizer))
    data, out = tmp_path / "images", tmp_path / "out"
    data.mkdir()
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    for i, (image, caption) in enumerate(zip(images, CAPTIONS)):
        image.save(data / f"{i:03d}.png")
        (data / f"{i:03d}.txt").write_text(caption)
    assert embed.main(["--input_dataset", str(data), "--output_folder", str(out), "--clip_model", str(path),
                       "--batch_size", "8"]) == 0
    image_emb, text_emb = np.load(out / "img_emb" / "img_emb_0.npy"), np.load(out / "text_emb" / "text_emb_0.npy")
    expected_image = _transformers_features(model, tokenizer, processor, images=images)
    expected_text = _transformers_features(model, tokenizer, processor, texts=CAPTIONS)
    assert np.min(np.sum(_unit(image_emb) * expected_image, axis=1)) >= 0.9999
    assert np.min(np.sum(_unit(text_emb) * expected_text, axis=1)) >= 0.9999


def test_zeroshot_makes_transformers_predictions(folder, tmp_path):
    path, model, tokenizer, processor = folder
    output = tmp_path / "zeroshot.json"
    assert zeroshot.main(["--checkpoint", str(path), "--demo", "--limit", str(LIMIT), "--no-progress",
                          "--output", str(output)]) == 0
    ours = json.loads(output.read_text())["results"]["fashion-mnist:test"]

    grey, labels = fashion_mnist.load("test")
    images = [Image.fromarray(x).convert("RGB") for x in grey[:LIMIT]]
    image_f = _transformers_features(model, tokenizer, processor, images=images)
    classes = np.stack([_unit(_transformers_features(model, tokenizer, processor,
                                                     texts=fashion_mnist.zeroshot_prompts(name)).mean(axis=0))
                        for name in fashion_mnist.CLASS_NAMES])
    ranked = np.argsort(-(image_f @ classes.T), axis=1)  # no bias: it shifts every class alike
    top1 = np.mean(ranked[:, 0] == labels[:LIMIT])
    top5 = np.mean(np.any(ranked[:, :5] == labels[:LIMIT, None], axis=1))
    assert (ours["top1"], ours["top5"]) == pytest.approx((top1, top5), abs=1e-9)
    assert 0 < top1 < 1  # a random model: a check that can tell predictions apart


def test_a_tokenizer_that_is_not_there_or_is_another_models_is_one_line(folder, tmp_path, capsys):
    path = folder[0]
    assert zeroshot.main(["--model", "ViT-B-16-SigLIP", "--demo", "--limit", "8"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "timm/ViT-B-16-SigLIP is a Hugging Face Hub name, which clip_jax does not download" in error

    empty = tmp_path / "empty"
    empty.mkdir()
    siglip = json.loads((path / "config.json").read_text())
    config = get_model_config({"embed_dim": 48, "init_logit_bias": -10.0, "custom_text": True,
                               "vision_cfg": {"image_size": 32, "layers": 1, "width": 48, "patch_size": 8,
                                              "head_width": 12, "pool_type": "map", "no_ln_pre": True},
                               "text_cfg": {"context_length": 16, "vocab_size": siglip["text_config"]["vocab_size"],
                                            "width": 48, "heads": 2, "layers": 1, "pool_type": "last",
                                            "no_causal_mask": True, "proj_bias": True,
                                            "hf_tokenizer_name": str(empty)}})
    with pytest.raises(MissingInput, match=f"{empty} holds no tokenizer"):
        tokenizer_for(config)
    demo = json.loads(DEMO_MODEL.read_text())  # CLIP's vocabulary, given the SigLIP folder's tokenizer
    clip = get_model_config({**demo, "text_cfg": {**demo["text_cfg"], "hf_tokenizer_name": str(path)}})
    with pytest.raises(InvalidInput, match=r"tokens but .*text tower 49,408: it is another model's"):
        tokenizer_for(clip)


@pytest.mark.slow
def test_a_run_starts_from_the_folder_with_its_tokenizer_and_exports_what_transformers_loads(folder, tmp_path,
                                                                                             fashion_mnist_shards):
    """Pretrained from the SiglipModel folder (weights and tokenizer), the sigmoid loss, zero-shot at the end, then
    exported: transformers loads the export (its tokenizer included) with the run's embeddings."""
    from trainer_run import tiny_config

    from clip_jax.interop import hf_folder
    from clip_jax.interop.export import export
    from clip_jax.interop.opener import open_model
    from clip_jax.models import create_model
    from clip_jax.models.open_clip_json import open_clip_model_cfg
    from clip_jax.training import trainer as train_lib

    path, _, tokenizer, processor = folder
    model_file = tmp_path / "tiny-siglip.json"  # the folder's architecture, as a run's config names a model
    model_file.write_text(json.dumps(open_clip_model_cfg(hf_folder.hf_model_config(str(path)))))
    pattern, _ = fashion_mnist_shards(512)
    results = train_lib.train(tiny_config((pattern, str(model_file)), tmp_path, train_num_samples=512,
                                          loss="siglip", pretrained=str(path), zeroshot_data="demo",
                                          zeroshot_samples=256))
    assert 0 <= results["zeroshot_top1"] <= 1

    run = open_model(str(tmp_path / "run"))
    # the run reads the pretrained folder's tokenizer, kept in the run directory
    assert run.config.text.tokenizer == str(tmp_path / "run" / "tokenizer")
    assert (tmp_path / "run" / "tokenizer" / "spiece.model").read_bytes() == (path / "spiece.model").read_bytes()
    other = tmp_path / "other"  # the same vocabulary, cased: another tokenizer
    other.mkdir()
    for name in ("spiece.model", "special_tokens_map.json"):
        shutil.copy(path / name, other / name)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**settings, "do_lower_case": False}))
    with pytest.raises(InvalidInput, match="was trained with the tokenizer kept in .*run/tokenizer, and this start "
                                           "reads the tokenizer in .*other, another one"):  # before anything is built
        train_lib.train(tiny_config((pattern, str(model_file)), tmp_path, train_num_samples=512, loss="siglip",
                                    pretrained=str(path), tokenizer=str(other), resume="latest"))
    export(str(tmp_path / "run"), str(tmp_path / "exported"))
    reference = transformers.SiglipModel.from_pretrained(str(tmp_path / "exported")).eval()
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    assert exported(CAPTIONS)["input_ids"] == tokenizer(CAPTIONS)["input_ids"]
    ids = np.asarray(exported(CAPTIONS, padding="max_length", max_length=16, truncation=True)["input_ids"])
    ours = create_model(run.config).apply(run.variables(), ids, method="encode_text")
    expected = _transformers_features(reference, exported, processor, texts=CAPTIONS)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-5)
    again = open_model(str(tmp_path / "exported"))  # as OpenCLIP's folder, its tokenizer the one beside it
    assert again.config.text.tokenizer == str(tmp_path / "exported")
    np.testing.assert_array_equal(again.tokenizer(CAPTIONS), ids)


def _oblong(rng, tall: bool):
    """An image 3:1 or more, whose middle square is one colour and its ends another (a crop sees the middle only)."""
    image = np.empty((20, 96, 3), np.uint8)
    image[:] = rng.integers(0, 256, 3, dtype=np.uint8)
    image[:, 38:58] = rng.integers(0, 256, 3, dtype=np.uint8)
    image = np.clip(image + rng.normal(0, 12, image.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(image.transpose(1, 0, 2) if tall else image)


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


def test_zeroshot_and_benchmark_eval_squash_images_as_the_folders_processor_does(folder, tmp_path):
    """Oblong images, which a crop and the SiglipImageProcessor's squash see differently: the commands score them
    as transformers does given the processor's pixels (a crop would score otherwise)."""
    from test_clip_benchmark import write_dataset

    from clip_jax.data.transforms import eval_crop, normalize
    from clip_jax.evaluation import benchmark_cli

    path, model, tokenizer, processor = folder
    rng = np.random.default_rng(3)
    images = [_oblong(rng, tall=i % 2 == 0) for i in range(32)]
    classes, template = fashion_mnist.CLASS_NAMES, "a photo of a {c}."
    text = _transformers_features(model, tokenizer, processor, texts=[template.format(c=c) for c in classes])
    top2 = np.sort(_transformers_features(model, tokenizer, processor, images=images) @ text.T, axis=1)[:, -2:]
    images = [image for image, margin in zip(images, top2[:, 1] - top2[:, 0]) if margin > 1e-3]  # no near ties
    assert len(images) >= 20
    squashed = _transformers_features(model, tokenizer, processor, images=images)
    labels = np.argmax(squashed @ text.T, axis=1)  # transformers' predictions: what the commands must get right
    with torch.no_grad():  # the control: transformers' model given center crops predicts otherwise
        crops = np.stack([normalize(eval_crop(image, 32), MEAN, STD) for image in images]).transpose(0, 3, 1, 2)
        cropped = model.get_image_features(pixel_values=torch.from_numpy(crops)).pooler_output.numpy()
    assert np.mean(np.argmax(cropped @ text.T, axis=1) == labels) <= 0.5
    write_dataset(tmp_path / "oblong", [{"png": _png(image), "cls": str(label).encode()}
                                        for image, label in zip(images, labels)],
                  dataset_type="classification", class_names=classes, templates=[template])

    report = tmp_path / "zeroshot.json"
    assert zeroshot.main(["--checkpoint", str(path), "--benchmark", str(tmp_path / "oblong"), "--output-dir",
                          str(tmp_path / "records"), "--no-progress", "--output", str(report)]) == 0
    record = next(iter(json.loads(report.read_text())["results"].values()))
    assert record["metrics"]["acc1"] == 1.0
    result = tmp_path / "benchmark.json"
    assert benchmark_cli.main(["eval", "--dataset", "wds/oblong", "--dataset_root", str(tmp_path), "--pretrained",
                               str(path), "--output", str(result)]) == 0
    assert json.loads(result.read_text())["metrics"]["acc1"] == 1.0
    # similarity squashes them too: each image's most probable prompt is transformers' prediction
    from clip_jax.interop import similarity

    for i, image in enumerate(images[:8]):
        image.save(tmp_path / f"{i}.png")
    probabilities = tmp_path / "similarity.json"
    assert similarity.main(["--checkpoint", str(path), "--images", *[str(tmp_path / f"{i}.png") for i in range(8)],
                            "--labels", ",".join(template.format(c=c) for c in classes),
                            "--json", str(probabilities)]) == 0
    rows = json.loads(probabilities.read_text())["images"]
    assert [int(np.argmax(row["probabilities"])) for row in rows] == labels[:8].tolist()


def test_a_run_keeps_its_tokenizers_files_and_a_resume_reading_another_is_one_line(folder, tmp_path):
    """`RUN/tokenizer/` gets the files the folder's tokenizer is read from (not the model's weights); a resume
    reading other files, or the model's own BPE, is refused naming the copy; a fresh start replaces the copy."""
    from clip_jax.text.model_tokenizer import with_run_tokenizer
    from clip_jax.runtime import ownership
    from clip_jax.runtime.run_directory import RunDirectory
    from clip_jax.runtime.run_layout import TOKENIZER
    from clip_jax.training.run_tokenizer import check_run_tokenizer, keep_run_tokenizer

    path = folder[0]
    directory = RunDirectory(str(tmp_path / "logs" / "run"))
    directory.record([TOKENIZER])
    keep_run_tokenizer(directory, str(path))
    kept = tmp_path / "logs" / "run" / TOKENIZER
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "special_tokens_map.json", "spiece.model",
                                                      "tokenizer_config.json"]
    assert all((kept / p.name).read_bytes() == (path / p.name).read_bytes() for p in kept.iterdir())
    check_run_tokenizer(directory, str(path), resuming=True)  # the same files: the resume goes on
    check_run_tokenizer(directory, str(kept), resuming=True)

    other = tmp_path / "other"
    train_sentencepiece(CAPTIONS * 20, other, 40, "siglip", context_length=16)
    for named, reads in ((str(other), f"the tokenizer in {other}, another one"),
                         (None, "the model config's own tokenizer")):
        with pytest.raises(InvalidInput) as refused:
            check_run_tokenizer(directory, named, resuming=True)
        assert str(refused.value) == (f"the run {directory.path} was trained with the tokenizer kept in {kept}, and "
                                      f"this start reads {reads}: resume with --config.tokenizer={kept}, or start "
                                      "another run with --config.name")
        check_run_tokenizer(directory, named, resuming=False)  # a fresh start may read another

    # the run's model reads its copy, whatever folder its config named
    demo = json.loads(DEMO_MODEL.read_text())
    model = with_run_tokenizer(get_model_config(demo), {"tokenizer": str(other)}, str(kept))
    assert model.text.tokenizer == str(kept)

    keep_run_tokenizer(directory, str(other))  # a fresh start with another tokenizer: the copy replaced
    assert sorted(p.name for p in kept.iterdir()) == ["special_tokens_map.json", "spiece.model",
                                                      "tokenizer_config.json"]
    assert (kept / "spiece.model").read_bytes() == (other / "spiece.model").read_bytes()
    keep_run_tokenizer(directory, None)  # and with none, removed
    assert not kept.exists() and ownership.foreign_names(directory.path) == []
