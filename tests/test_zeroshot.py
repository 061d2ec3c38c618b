"""Zero-shot classification: the protocol's data, parity with OpenCLIP's classifier and eval loop, the tie rule,
several processes, the command line and its errors."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import open_clip
import pytest
import torch
import torchvision
from open_clip_reference import TINY, TINY_77, open_clip_model, state_dict_numpy
from PIL import Image
from xla_flags import xla_flags

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.evaluation import (ClassificationSet, ZeroShotEvaluator, build_zeroshot_classifier, evaluate_zeroshot,
                                 image_folder_set, imagenet_class_names, imagenet_wnids, label_ranks,
                                 open_classification_set, templates, zeroshot, zeroshot_logits)
from clip_jax.evaluation.prompts import class_prompts
from clip_jax.evaluation.sources import ArraySource
from clip_jax.interop import convert, weight_files
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh

SOME_CLASSES = ["tench", "great white shark", "potter's wheel", "Dungeness crab", "T-shirt", "missile",
                "ping-pong ball"]


@pytest.fixture(scope="module")
def torch_model():
    return open_clip_model(TINY_77, seed=5)


@pytest.fixture(scope="module")
def params(torch_model):
    return convert.from_open_clip(state_dict_numpy(torch_model), TINY_77)


@pytest.fixture(scope="module")
def mesh():
    return create_mesh()


@pytest.fixture(scope="module")
def tiny_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny77.json"
    path.write_text(json.dumps(TINY_77))
    return str(path)


@pytest.fixture(scope="module")
def model(tiny_json):
    return create_model(tiny_json)  # one module for every test, so compiled functions are shared


def _random_params(seed):
    """Random params of TINY_77, from OpenCLIP's init (cheaper than compiling ours)."""
    return convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, seed=seed)), TINY_77)


def _smooth_image(rng, height, width):
    """A photo-like RGB image: a coarse random grid upsampled bilinearly."""
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


def _image_folder(root, classes, per_class, seed=0):
    rng = np.random.default_rng(seed)
    for c in classes:
        os.makedirs(root / c)
        for i in range(per_class):
            image = _smooth_image(rng, int(rng.integers(24, 60)), int(rng.integers(24, 60)))
            image.save(root / c / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


# ---------------------------------------------------------------------------------------------------------------
# The protocol's data


def test_shipped_class_names_and_templates_are_open_clips():
    from open_clip import zero_shot_metadata as metadata

    assert imagenet_class_names() == tuple(metadata.IMAGENET_CLASSNAMES)
    for ours, theirs in ((templates("openai_imagenet"), metadata.OPENAI_IMAGENET_TEMPLATES),
                         (templates("simple_imagenet"), metadata.SIMPLE_IMAGENET_TEMPLATES)):
        assert [t.format("Dungeness crab") for t in ours] == [f("Dungeness crab") for f in theirs]
    assert len(templates("openai_imagenet")) == 80 and len(templates("simple_imagenet")) == 7


def test_wnids_are_imagenet_1k_in_label_order():
    import tensorflow_datasets

    tfds_labels = os.path.join(os.path.dirname(tensorflow_datasets.__file__), "image_classification",
                               "imagenet_resized_labels.txt")
    with open(tfds_labels) as f:
        assert imagenet_wnids() == tuple(sorted(f.read().split()))
    assert imagenet_wnids()[0] == "n01440764" and imagenet_class_names()[0] == "tench"


def test_a_folder_of_the_1000_wnids_gets_the_curated_names(tmp_path):
    for wnid in imagenet_wnids():
        os.makedirs(tmp_path / wnid)
    _smooth_image(np.random.default_rng(0), 30, 40).save(tmp_path / "n01440764" / "a.png")
    dataset = image_folder_set(str(tmp_path))
    assert dataset.class_names == imagenet_class_names()
    assert dataset.prompts[0][0] == "a bad photo of a tench." and len(dataset.prompts[999]) == 80


# ---------------------------------------------------------------------------------------------------------------
# Parity with OpenCLIP


@pytest.mark.slow
def test_classifier_and_logits_equal_open_clips(torch_model, params, mesh, model):
    expected = open_clip.build_zero_shot_classifier(
        torch_model, tokenizer=open_clip.tokenize, classnames=SOME_CLASSES,
        templates=open_clip.OPENAI_IMAGENET_TEMPLATES, num_classes_per_batch=3).numpy()  # [E, C]
    # 100 prompts per batch: two classes per batch, the last batch padded with an empty class
    classifier = build_zeroshot_classifier(model, params,
                                           class_prompts(SOME_CLASSES, templates("openai_imagenet")), mesh,
                                           text_batch_size=200)
    assert classifier.shape == expected.shape == (48, len(SOME_CLASSES))
    np.testing.assert_allclose(classifier, expected, atol=1e-5)

    rng = np.random.default_rng(0)
    images = rng.standard_normal((12, 32, 32, 3)).astype(np.float32)
    with torch.no_grad():
        torch_features = torch_model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2), normalize=True)
        expected_logits = (100.0 * torch_features @ torch.from_numpy(expected)).numpy()
    features = model.apply({"params": params}, images, method="encode_image")
    logits = np.asarray(zeroshot_logits(features, jnp.asarray(classifier)))
    np.testing.assert_allclose(logits, expected_logits, atol=1e-4)
    assert np.ptp(logits) > 1  # the test is not vacuous: the classes are told apart


def _open_clip_accuracy(torch_model, classifier, loader):
    """The loop of `open_clip_train.zero_shot.run` (whose `accuracy` fails under numpy 2): top-1/top-5 by
    `torch.topk` of `100 * image_features @ classifier`."""
    correct1 = correct5 = n = 0
    with torch.inference_mode():
        for images, target in loader:
            logits = 100.0 * torch_model(image=images)[0] @ classifier
            hits = logits.topk(5, 1, True, True)[1].t() == target.view(1, -1)
            correct1 += int(hits[:1].sum())
            correct5 += int(hits[:5].sum())
            n += len(images)
    return correct1 / n, correct5 / n


@pytest.mark.slow
def test_accuracy_on_an_image_folder_equals_open_clips_eval(tmp_path, torch_model, tiny_json, capsys):
    """The whole path: OpenCLIP checkpoint file -> our script; vs. OpenCLIP's ImageFolder + eval transform +
    classifier + its own zero-shot loop."""
    folder = _image_folder(tmp_path / "val", ["bag", "boot", "coat", "dress", "shirt", "sandal"], per_class=7)
    checkpoint = tmp_path / "epoch_1.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in torch_model.state_dict().items()}},
               checkpoint)
    output = tmp_path / "metrics.json"
    assert zeroshot.main(["--model", tiny_json, "--checkpoint", str(checkpoint), "--imagenet-val", str(folder),
                          "--batch-size", "16", "--output", str(output), "--no-progress", "--workers", "2"]) == 0
    ours = json.loads(output.read_text())["results"]["imagenet-val"]

    dataset = torchvision.datasets.ImageFolder(str(folder), transform=open_clip.image_transform(
        32, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD))
    classifier = open_clip.build_zero_shot_classifier(torch_model, tokenizer=open_clip.tokenize,
                                                      classnames=dataset.classes,
                                                      templates=open_clip.OPENAI_IMAGENET_TEMPLATES)
    top1, top5 = _open_clip_accuracy(torch_model, classifier, torch.utils.data.DataLoader(dataset, batch_size=10))
    assert ours["num_images"] == 42 and ours["num_classes"] == 6 and ours["num_templates"] == 80
    assert (ours["top1"], ours["top5"]) == (top1, top5)
    assert 0 < top1 < 1  # neither all right nor all wrong
    assert "imagenet-val" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Ranking and counting


def test_label_ranks_break_exact_ties_by_class_index_and_never_count_nan():
    rng = np.random.default_rng(1)
    logits = rng.integers(-2, 3, (200, 7)).astype(np.float32)  # many exact ties
    logits[5, 3] = np.nan
    labels = rng.integers(0, 7, 200)
    labels[5] = 3
    expected = []
    for row, label in zip(logits.astype(np.float64), labels):
        if np.isnan(row[label]):
            expected.append(7)
            continue
        order = sorted(range(7), key=lambda c: (-row[c], c))  # best first, lower index first among equals
        expected.append(order.index(label))
    np.testing.assert_array_equal(label_ranks(jnp.asarray(logits), jnp.asarray(labels)), expected)


def test_accuracy_counts_every_image_once_with_padding_and_small_class_counts(mesh, model):
    """Accuracy from our loop equals top-k computed directly from features of the same transformed images."""
    params = _random_params(1)
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (37, 20, 27), dtype=np.uint8)  # greyscale, resized and cropped to 32
    labels = rng.integers(0, 4, 37)
    names = ("cat", "dog", "car", "tree")
    dataset = ClassificationSet("toy", ArraySource(images, labels), names,
                                class_prompts(names, ["a photo of a {}.", "a {}."]))
    metrics = evaluate_zeroshot(model, params, dataset, mesh, batch_size=16, num_threads=2, text_batch_size=200)
    assert set(metrics) == {"top1", "num_images"}  # top-5 of 4 classes is not reported
    assert metrics["num_images"] == 37

    from clip_jax.data.transforms import normalize
    from clip_jax.evaluation.batches import eval_image

    batch = normalize(np.stack([eval_image(x, 32) for x in images]), OPENAI_MEAN, OPENAI_STD)
    features = np.asarray(jax.jit(model.apply, static_argnames="method")({"params": params}, batch,
                                                                          method="encode_image"), np.float64)
    classifier = build_zeroshot_classifier(model, params, dataset.prompts, mesh, text_batch_size=200)
    predicted = np.argmax(features @ classifier, axis=1)
    assert metrics["top1"] == np.mean(predicted == labels)


def test_an_evaluator_built_once_gives_each_params_their_own_result(mesh, model):
    """The trainer keeps one evaluator for the whole run: called with new params, it answers as a fresh one would."""
    dataset = open_classification_set("demo").head(40)
    evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=16, num_threads=2, text_batch_size=200)
    for seed in (6, 7):
        params = _random_params(seed)
        assert evaluator(params) == evaluate_zeroshot(model, params, dataset, mesh, batch_size=16, num_threads=2,
                                                      text_batch_size=200)


def test_an_evaluator_asks_its_should_stop_before_every_batch_and_gives_way_at_once(mesh, model):
    """The check a trainer hands over is asked once per batch encoded (prompts, then images); the first True ends
    the evaluation there with `CutShort`, before that batch is encoded."""
    from clip_jax.runtime.stop_signals import CutShort

    def stop_at(n):
        asked = []

        def should_stop():
            asked.append(len(asked) + 1)
            return len(asked) >= n

        return asked, should_stop

    dataset = open_classification_set("demo").head(40)
    evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=16, num_threads=2, text_batch_size=200)
    params = _random_params(6)
    asked, never = stop_at(10**6)
    assert evaluator(params, should_stop=never) == evaluator(params)
    batches = len(asked)
    assert batches >= 4  # the prompts in one batch or more, the 40 images in 3
    asked, should_stop = stop_at(batches)
    with pytest.raises(CutShort):
        evaluator(params, should_stop=should_stop)
    assert len(asked) == batches


_WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, params_path, model_json = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from clip_jax.interop.weight_files import load_params
from clip_jax.evaluation import demo_set, evaluate_zeroshot
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh
metrics = evaluate_zeroshot(create_model(model_json), load_params(params_path), demo_set().head(33), create_mesh(),
                            batch_size=16, num_threads=2, text_batch_size=200)
print("METRICS " + json.dumps(metrics))
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_processes_each_get_the_global_result(tmp_path, mesh, tiny_json, model):
    """33 images over 2 processes x 4 devices, 8 rows per process and step: process 0 reads 17 images in 3 steps,
    process 1 reads 16 and pads its third step entirely."""
    params = _random_params(3)
    weight_files.save_params(str(tmp_path / "params.npz"), params)
    expected = evaluate_zeroshot(model, params, open_classification_set("demo").head(33), mesh, batch_size=16,
                                 text_batch_size=200)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = xla_flags(4)
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(port), str(pid), str(tmp_path / "params.npz"),
                                 tiny_json], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for pid in range(2)]
    outputs = [w.communicate(timeout=240) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("METRICS "))[8:])
               for out, _ in outputs]
    assert results[0] == results[1] == expected
    assert expected["num_images"] == 33


# ---------------------------------------------------------------------------------------------------------------
# The command line and its errors


def test_the_demo_runs_end_to_end_and_writes_json(tmp_path, tiny_json, capsys):
    checkpoint = str(tmp_path / "random_init.npz")
    weight_files.save_params(checkpoint, _random_params(4))
    output = tmp_path / "out" / "demo.json"
    assert zeroshot.main(["--model", tiny_json, "--checkpoint", checkpoint, "--demo", "--limit", "300",
                          "--batch-size", "12", "--output", str(output), "--no-progress"]) == 0
    report = json.loads(output.read_text())
    metrics = report["results"]["fashion-mnist:test"]
    assert metrics["num_images"] == 300 and metrics["num_classes"] == 10 and metrics["num_templates"] == 4
    assert 0 <= metrics["top1"] <= metrics["top5"] <= 1 and metrics["images_per_s"] > 0
    assert report["batch_size"] == 16 and report["num_devices"] == 8  # rounded up to a multiple of the devices
    out = capsys.readouterr().out
    assert "fashion-mnist:test" in out and "top5" in out


def _prepare_tfds(data_dir, folder):
    """A TFDS ArrayRecord dataset (built offline, without TensorFlow) of the images of an image folder."""
    import tensorflow_datasets as tfds

    classes = sorted(os.listdir(folder))

    class ClipJaxTestFolder(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3), encoding_format="png"),
                "label": tfds.features.ClassLabel(names=classes)}))

        def _split_generators(self, dl_manager):
            return {"test": self._generate_examples()}

        def _generate_examples(self):
            for label, name in enumerate(classes):
                for file in sorted(os.listdir(folder / name)):
                    yield f"{name}/{file}", {"image": (folder / name / file).read_bytes(), "label": label}

    ClipJaxTestFolder(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return "clip_jax_test_folder"


def test_a_tfds_dataset_is_read_without_tensorflow(tmp_path, tiny_json, params, capsys):
    folder = _image_folder(tmp_path / "val", ["bag", "boot", "coat", "dress", "shirt", "sandal"], per_class=3)
    for path in folder.glob("*/*.jpg"):  # TFDS stores every image as PNG here
        Image.open(path).save(path.with_suffix(".png"))
        path.unlink()
    name = _prepare_tfds(tmp_path / "tfds", folder)
    checkpoint = str(tmp_path / "p.npz")
    weight_files.save_params(checkpoint, params)
    output = tmp_path / "m.json"
    assert zeroshot.main(["--model", tiny_json, "--checkpoint", checkpoint, "--tfds", name, "--tfds-data-dir",
                          str(tmp_path / "tfds"), "--imagenet-val", str(folder), "--templates", "simple_imagenet",
                          "--batch-size", "16", "--output", str(output), "--no-progress"]) == 0
    results = json.loads(output.read_text())["results"]
    from_tfds, from_folder = results[f"{name}:test"], results["imagenet-val"]
    assert from_tfds["num_images"] == from_folder["num_images"] == 18 and from_tfds["num_templates"] == 7
    assert (from_tfds["top1"], from_tfds["top5"]) == (from_folder["top1"], from_folder["top5"])


def test_unknown_dataset_kind_and_no_dataset_are_refused(capsys):
    with pytest.raises(ValueError, match="unknown zero-shot dataset kind 'imagenet'; choose one of imagenet-val"):
        open_classification_set("imagenet", "/data")
    with pytest.raises(SystemExit):
        zeroshot.main(["--model", "ViT-B-32"])
    assert "no dataset" in capsys.readouterr().err


def test_a_missing_tfds_dataset_is_named(tmp_path, tiny_json, capsys):
    assert zeroshot.main(["--model", tiny_json, "--tfds", "no_such_dataset", "--tfds-data-dir", str(tmp_path)]) == 2
    assert "cannot open TFDS dataset 'no_such_dataset'" in capsys.readouterr().err


def test_an_empty_folder_is_refused(tmp_path, tiny_json, capsys):
    assert zeroshot.main(["--model", tiny_json, "--imagenet-val", str(tmp_path)]) == 2
    assert f"no class folders in '{tmp_path}'" in capsys.readouterr().err
    os.makedirs(tmp_path / "cat")
    assert zeroshot.main(["--model", tiny_json, "--imagenet-val", str(tmp_path)]) == 2
    assert "no images" in capsys.readouterr().err


def test_class_names_that_do_not_match_the_labels_are_refused(tmp_path, tiny_json, mesh, model, params, capsys):
    folder = _image_folder(tmp_path / "val", ["a", "b", "c"], per_class=1)
    names = tmp_path / "names.txt"
    names.write_text("alpha\nbeta\n")
    assert zeroshot.main(["--model", tiny_json, "--imagenet-val", str(folder), "--class-names", str(names)]) == 2
    assert "2 class names were given for the 3 classes of image folder" in capsys.readouterr().err

    dataset = ClassificationSet("toy", ArraySource(np.zeros((8, 8, 8), np.uint8), np.arange(8) % 3), ("x", "y"),
                                (("a {}.",), ("b {}.",)))
    with pytest.raises(ValueError, match="toy has label 2 but 2 class names"):
        evaluate_zeroshot(model, params, dataset, mesh, batch_size=16, text_batch_size=200)


def test_a_checkpoint_of_another_model_is_refused_by_the_script(tmp_path, tiny_json, params, capsys):
    weight_files.save_params(str(tmp_path / "p.npz"), params)
    assert zeroshot.main(["--model", "ViT-B-32", "--checkpoint", str(tmp_path / "p.npz"), "--demo"]) == 2
    assert "does not match model 'ViT-B-32'" in capsys.readouterr().err
    assert zeroshot.main(["--model", tiny_json, "--checkpoint", str(tmp_path), "--demo"]) == 2
    assert "no complete checkpoint in" in capsys.readouterr().err


def test_a_text_tower_without_the_full_vocabulary_is_refused(tmp_path, capsys):
    small = tmp_path / "small_vocab.json"
    small.write_text(json.dumps(TINY))
    assert zeroshot.main(["--model", str(small), "--demo", "--limit", "8"]) == 2
    assert "text vocabulary of 600 tokens" in capsys.readouterr().err
