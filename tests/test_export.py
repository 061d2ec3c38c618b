"""A trained run leaves clip_jax as OpenCLIP's `local-dir:` folder and comes back as a pretrained start: the export
loads in OpenCLIP with the run's preprocessing and features, and fine-tuning (also at a larger image size, as
L/14 went from 224 to 336 px) continues from the pretrained loss."""

import contextlib
import io
import json
import os
import re

import jax
import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from trainer_run import losses, tiny_config

import clip_jax
from clip_jax.evaluation import zeroshot
from clip_jax.interop import export
from clip_jax.interop.opener import open_model, read_run_config, run_model
from clip_jax.training import trainer as train_lib

HALF = (0.5, 0.5, 0.5)  # the LAION recipe's mean and std, not OpenCLIP's defaults: the export must carry them

pytestmark = pytest.mark.usefixtures("orbax_writes_replicated_arrays_whole")  # saves not split per device


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    """1,024 Fashion-MNIST training images in 4 shards."""
    return fashion_mnist_shards(1024)


@pytest.fixture(scope="module")
def base_run(shards, tmp_path_factory):
    """A 28 px run of 96 steps (checkpoints 80, 88, 96 kept)."""
    logs = tmp_path_factory.mktemp("logs")
    train_lib.train(tiny_config(shards, logs, train_num_samples=1024, epochs=6,
                                image_mean=HALF, image_std=HALF))
    return logs / "run"


@pytest.fixture(scope="module")
def exported(base_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "model"
    assert export.main([str(base_run), str(out)]) == 0
    return out


def _image(seed=0, size=(53, 37)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _assert_open_clip_agrees(folder, run_or_folder, texts=("a photo of a shoe", "a bag")):
    """OpenCLIP's `local-dir:` load and clip_jax's agree on preprocessing, tokens and features."""
    reference, _, reference_eval = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    reference.eval()
    name = f"local-dir:{folder}" if run_or_folder is None else open_model(str(folder)).config
    model, params, _, eval_transform = clip_jax.create_model_and_transforms(name, pretrained=run_or_folder)
    images = [_image(seed) for seed in range(3)]
    ours = np.stack([eval_transform(image) for image in images])
    theirs = torch.stack([reference_eval(image) for image in images])
    np.testing.assert_array_equal(ours, theirs.permute(0, 2, 3, 1).numpy())  # the same pixels, normalised alike

    tokens = clip_jax.get_tokenizer(f"local-dir:{folder}")(list(texts))
    np.testing.assert_array_equal(tokens, open_clip.get_tokenizer(f"local-dir:{folder}")(list(texts)).numpy())
    image_f = model.apply({"params": params}, ours, method="encode_image")
    text_f = model.apply({"params": params}, tokens, method="encode_text")
    with torch.no_grad():
        expected_image = reference.encode_image(theirs, normalize=True).numpy()
        expected_text = reference.encode_text(torch.from_numpy(np.asarray(tokens)).long(), normalize=True).numpy()
    np.testing.assert_allclose(image_f, expected_image, atol=1e-5)
    np.testing.assert_allclose(text_f, expected_text, atol=1e-5)


@pytest.mark.slow
def test_an_exported_run_loads_in_open_clip_with_its_preprocessing_and_features(base_run, exported):
    saved = json.loads((exported / "open_clip_config.json").read_text())
    assert saved["preprocess_cfg"] == {"size": 28, "mode": "RGB", "mean": list(HALF), "std": list(HALF),
                                       "interpolation": "bicubic", "resize_mode": "shortest"}
    assert saved["model_cfg"]["vision_cfg"]["image_size"] == 28
    _assert_open_clip_agrees(exported, None)  # clip_jax reads the folder
    _assert_open_clip_agrees(exported, str(base_run))  # clip_jax reads the run


@pytest.mark.slow
def test_the_export_folder_is_a_checkpoint_for_the_eval_script(shards, base_run, exported, tmp_path):
    reports = {}
    for name, checkpoint in (("run", base_run), ("export", exported)):
        output = tmp_path / f"{name}.json"
        # no --mean/--std: each checkpoint's own (the run's config, the folder's preprocess_cfg) is used; the
        # export also names its model
        model = ["--model", shards[1]] if name == "run" else []
        assert zeroshot.main([*model, "--checkpoint", str(checkpoint), "--demo", "--limit", "128",
                              "--no-progress", "--output", str(output)]) == 0
        reports[name] = json.loads(output.read_text())
    for report in reports.values():
        assert report["mean"] == list(HALF) and report["std"] == list(HALF)
    top1 = {name: [m["top1"] for m in report["results"].values()] for name, report in reports.items()}
    assert top1["export"] == top1["run"]


@pytest.mark.slow
def test_a_named_step_is_exported_and_bad_sources_get_one_line(base_run, tmp_path, capsys):
    assert export.main([str(base_run), str(tmp_path / "step80"), "--step", "80"]) == 0
    model = run_model(read_run_config(str(base_run)))
    exported_80 = clip_jax.load_pretrained(str(tmp_path / "step80"), model)
    checkpoint_80 = clip_jax.load_pretrained(str(base_run / "checkpoints" / "80"), model)
    jax.tree.map(np.testing.assert_array_equal, exported_80, checkpoint_80)
    assert not np.array_equal(exported_80["visual"]["proj"],
                              clip_jax.load_pretrained(str(base_run), model)["visual"]["proj"])
    assert export.main([str(base_run), str(tmp_path / "x"), "--step", "5"]) == 2
    assert "no checkpoint of step 5" in capsys.readouterr().err
    assert export.main([str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_fine_tuning_from_a_pretrained_run_continues_from_its_loss(shards, base_run, tmp_path):
    train_lib.train(tiny_config(shards, tmp_path, train_num_samples=512, lr=1e-4, warmup=1,
                                pretrained=str(base_run), image_mean=HALF, image_std=HALF))
    base, tuned = losses(base_run), losses(tmp_path / "run")
    fresh_start = np.mean([base[s] for s in range(1, 5)])  # ~4.25 (chance: ln 64 = 4.16)
    pretrained_end = np.mean([base[s] for s in range(89, 97)])  # ~3.2
    tuned_start = np.mean([tuned[s] for s in range(1, 5)])  # ~3.0: the learning rate is low, the params barely move
    assert fresh_start > pretrained_end + 0.6, (fresh_start, pretrained_end)
    assert abs(tuned_start - pretrained_end) < 0.35, (tuned_start, pretrained_end)
    assert tuned_start < fresh_start - 0.8, (tuned_start, fresh_start)
    assert sorted(tuned) == list(range(1, 9))  # a new run: its own schedule from step 0
    # Continued, the run takes its own checkpoint, not the pretrained weights.
    with train_lib.Trainer(tiny_config(shards, tmp_path, train_num_samples=512, pretrained=str(base_run),
                                       resume="latest", image_mean=HALF, image_std=HALF)) as trainer:
        assert trainer.step == 8


@pytest.mark.slow
def test_fine_tuning_at_a_larger_image_size_end_to_end(shards, base_run, exported, tmp_path):
    """28 -> 42 px (as 224 -> 336 px) from the exported folder, the text tower locked; then exported again and
    loaded by OpenCLIP at the new size."""
    train_lib.train(tiny_config(shards, tmp_path, train_num_samples=512, lr=1e-4, warmup=1, pretrained=str(exported),
                                force_image_size=42, lock_text=True, image_mean=HALF, image_std=HALF))
    base, tuned = losses(base_run), losses(tmp_path / "run")
    assert tuned[1] < np.mean([base[s] for s in range(1, 5)]) - 0.3, (tuned[1], base[1])
    model = run_model(read_run_config(str(tmp_path / "run")))
    params = clip_jax.load_pretrained(str(tmp_path / "run"), model)
    assert params["visual"]["positional_embedding"].shape == (37, 32)  # 6 x 6 patches of 7 px, and the class token
    start = clip_jax.load_pretrained(str(exported), model)  # resized from 4 x 4 as the run started
    jax.tree.map(np.testing.assert_array_equal, params["transformer"], start["transformer"])  # locked
    assert not np.array_equal(params["visual"]["proj"], start["visual"]["proj"])

    model, _, _, eval_transform = clip_jax.create_model_and_transforms(None, pretrained=str(tmp_path / "run"))
    assert model.config.vision.image_size == 42 and eval_transform(_image()).shape == (42, 42, 3)

    out = tmp_path / "exported-42"
    assert export.main([str(tmp_path / "run"), str(out)]) == 0
    assert json.loads((out / "open_clip_config.json").read_text())["preprocess_cfg"]["size"] == 42
    _assert_open_clip_agrees(out, None)


@pytest.mark.slow
def test_the_readme_example_prints_open_clips_label_and_probabilities(exported, tmp_path):
    """The README's example, run on an export, prints what OpenCLIP computes from the same folder: the label of the
    largest probability and the probabilities themselves."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                  if "create_model_and_transforms(\"local-dir:" in block]
    photo = tmp_path / "photo.jpg"
    _image(seed=4, size=(64, 48)).save(photo)
    code = example.replace("exported/", f"{exported}/").replace("photo.jpg", str(photo))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    label, probs = printed.getvalue().split(" [", 1)
    probs = np.array(probs.strip().rstrip("]").split(), np.float64)

    labels = ["a photo of a sneaker", "a photo of a bag", "a photo of a dress"]
    reference, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    reference.eval()
    with torch.no_grad():
        image_f = reference.encode_image(preprocess(Image.open(photo))[None], normalize=True)
        text_f = reference.encode_text(open_clip.get_tokenizer(f"local-dir:{exported}")(labels), normalize=True)
        expected = torch.softmax(100.0 * image_f.double() @ text_f.double().T, dim=-1)[0].numpy()
    assert label == labels[int(np.argmax(expected))]
    # Relative, since the tiny model is sure of itself (here 8.4e-25, 3.6e-9 and 1 - 3.6e-9): a probability's
    # relative error is its logit's error. Measured: 2.1e-5 at most (float32 features either side, the logits 100x
    # their cosine; numpy prints 8 digits), so 1e-4 leaves 5x.
    np.testing.assert_allclose(probs, expected, rtol=1e-4, atol=0)


def test_the_eval_script_needs_a_model_name_without_a_checkpoint(capsys):
    with pytest.raises(SystemExit):
        zeroshot.parse_args(["--demo"])
    assert "--model is needed without a --checkpoint" in capsys.readouterr().err
