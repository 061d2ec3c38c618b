"""CLIP_benchmark's datasets and metrics: LAION's own `clip-benchmark` package scores the OpenCLIP model of an export of
clip_jax params on small datasets in its webdataset layout, and `python -m clip_jax.zeroshot --benchmark` must report
the same numbers; the metrics against independent computations; and every bad file named in one clear error."""

import csv
import io
import json
import math
import os
import tarfile

import numpy as np
import open_clip
import pytest
import torch
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image
from xla_flags import xla_flags

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation import clip_benchmark, zeroshot
from clip_jax.evaluation import metrics as metrics_lib
from clip_jax.interop import convert, weight_files
from clip_jax.interop.export import export_open_clip
from clip_jax.models import get_model_config

CLASSES = ["bag", "boot", "coat", "dress", "shirt", "sandal"]
TEMPLATES = ["a photo of a {c}.", "a {c}, seen from afar.", "{c}"]
RECALL_K = [1, 2, 5]


# ---------------------------------------------------------------------------------------------------------------
# Writing datasets in CLIP_benchmark's layout (with the standard library's tarfile, not the code under test)


def _image(rng, fmt: str) -> tuple[str, bytes]:
    """A photo-like RGB image of random size, encoded: (extension, bytes)."""
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    size = (int(rng.integers(24, 60)), int(rng.integers(24, 60)))
    image = Image.fromarray(coarse).resize(size, Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, **{"webp": {"format": "webp", "lossless": True}, "png": {"format": "png"},
                       "jpg": {"format": "jpeg", "quality": 90}}[fmt])
    return fmt, out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_dataset(root, samples, *, dataset_type=None, class_names=None, templates=None, split="test",
                  per_shard=8, exist_ok=False):
    """`samples`: dicts of extension -> bytes (the sample key is added); written as shards of `per_shard`
    (`exist_ok`: another split of a dataset folder written before)."""
    root.mkdir(parents=True, exist_ok=exist_ok)
    (root / split).mkdir()
    if dataset_type:
        (root / "dataset_type.txt").write_text(dataset_type + "\n")
    if class_names:
        (root / "classnames.txt").write_text("\n".join(class_names) + "\n")
    if templates:
        (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    shards = [samples[i:i + per_shard] for i in range(0, len(samples), per_shard)]
    for index, shard in enumerate(shards):
        with tarfile.open(root / split / f"{index}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for number, files in enumerate(shard):
                for ext, data in files.items():
                    _add(tar, f"s{index:03d}{number:04d}.{ext}", data)
    (root / split / "nshards.txt").write_text(f"{len(shards)}\n")
    return root


def classification_samples(num=30, seed=0):
    rng = np.random.default_rng(seed)
    formats = ("webp", "png", "jpg")
    return [dict([_image(rng, formats[i % 3]), ("cls", str(i % len(CLASSES)).encode())]) for i in range(num)]


def retrieval_samples(num=12, seed=1):
    rng = np.random.default_rng(seed)
    words = ["red", "blue", "small", "large", "striped", "dotted", "round", "square", "bright", "dark"]
    samples = []
    for i in range(num):
        captions = [" ".join(rng.choice(words, 3)) + f" thing {i}" for _ in range(2 + i % 2)]
        samples.append(dict([_image(rng, ("webp", "png")[i % 2]), ("txt", "\n".join(captions).encode())]))
    return samples


def multilabel_samples(num=16, num_classes=4, seed=2):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        target = (rng.random(num_classes) < 0.4).astype(np.int64)
        target[i % num_classes] = 1
        npy = io.BytesIO()
        np.save(npy, target)
        samples.append(dict([_image(rng, "png"), ("npy", npy.getvalue())]))
    return samples


# ---------------------------------------------------------------------------------------------------------------
# The model: clip_jax params with non-trivial values, turned into a real OpenCLIP model


@pytest.fixture(scope="module")
def params():
    """Random params (OpenCLIP's init perturbed: cheaper than compiling ours), as clip_jax holds them."""
    return convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, seed=3)), TINY_77)


@pytest.fixture(scope="module")
def exported(params, tmp_path_factory):
    """The OpenCLIP model and eval transform of those params as users get them: `python -m clip_jax.export`'s
    folder loaded by `open_clip.create_model_and_transforms("local-dir:...")`."""
    folder = tmp_path_factory.mktemp("export")
    export_open_clip(params, get_model_config(TINY_77), str(folder), mean=OPENAI_MEAN, std=OPENAI_STD)
    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    return model.eval(), transform


@pytest.fixture(scope="module")
def setup(tmp_path_factory, params):
    """A model config file, a clip_jax checkpoint and a collection of three datasets."""
    root = tmp_path_factory.mktemp("cb")
    model_json = root / "tiny77.json"
    model_json.write_text(json.dumps(TINY_77))
    checkpoint = root / "tiny.npz"
    weight_files.save_params(str(checkpoint), params)
    collection = root / "collection"
    write_dataset(collection / "vtab" / "fashion", classification_samples(), class_names=CLASSES,
                  templates=TEMPLATES)
    write_dataset(collection / "captions", retrieval_samples(), dataset_type="retrieval")
    write_dataset(collection / "tags", multilabel_samples(), dataset_type="multilabel",
                  class_names=["red thing", "round thing", "small thing", "dark thing"], templates=TEMPLATES[:2])
    return {"model": str(model_json), "checkpoint": str(checkpoint), "collection": collection}


@pytest.fixture(scope="module")
def ours(setup, tmp_path_factory):
    """`python -m clip_jax.zeroshot --benchmark COLLECTION`, in-process: the records it wrote, by dataset."""
    out = tmp_path_factory.mktemp("results")
    argv = ["--model", setup["model"], "--checkpoint", setup["checkpoint"], "--benchmark", str(setup["collection"]),
            "--output-dir", str(out), "--recall-k", *map(str, RECALL_K), "--batch-size", "16", "--no-progress",
            "--workers", "2", "--output", str(out / "all.json")]
    assert zeroshot.main(argv) == 0
    records = {}
    for name in os.listdir(out):
        if name.endswith(".json") and name != "all.json":
            record = json.loads((out / name).read_text())
            records[record["dataset"]] = (name, record)
    return out, records


def _benchmark_dataset(folder, name, task, transform):
    """CLIP_benchmark's own reader of its webdataset layout, with the exported model's eval transform."""
    from clip_benchmark.datasets.builder import build_dataset

    return build_dataset(f"wds/{name}", root=str(folder), transform=transform, split="test", task=task)


def _loader(dataset, collate=None):
    batched = dataset.batched(10, collation_fn=collate) if collate else dataset.batched(10)
    return torch.utils.data.DataLoader(batched, batch_size=None, num_workers=0)


# ---------------------------------------------------------------------------------------------------------------
# Agreement with LAION's clip-benchmark


@pytest.mark.slow
def test_classification_equals_clip_benchmarks(setup, ours, exported):
    from clip_benchmark.metrics.zeroshot_classification import run_classification, zero_shot_classifier
    from sklearn.metrics import balanced_accuracy_score

    torch_model, transform = exported
    dataset = _benchmark_dataset(setup["collection"] / "vtab" / "fashion", "vtab/fashion", "zeroshot_classification",
                                 transform)
    assert dataset.classes == CLASSES and dataset.templates == TEMPLATES
    classifier = zero_shot_classifier(torch_model, open_clip.tokenize, dataset.classes, dataset.templates, "cpu",
                                      amp=False)
    logits, target = run_classification(torch_model, classifier, _loader(dataset), "cpu", amp=False)
    assert logits.shape == (30, 6)
    # Its accuracy(): top-k of torch.topk (called here without the float() of a 1-element array NumPy 2 refuses).
    hits = logits.topk(5, 1, True, True)[1].t() == target.view(1, -1)
    acc1, acc5 = float(hits[:1].sum()) / 30, float(hits[:5].sum()) / 30
    recall = balanced_accuracy_score(target.numpy(), logits.argmax(axis=1).numpy())

    name, record = ours[1]["wds/vtab/fashion"]
    assert name == "vtab_fashion_tiny.npz_tiny77_en_zeroshot_classification.json"
    assert {k: record[k] for k in ("dataset", "model", "pretrained", "task", "language")} == {
        "dataset": "wds/vtab/fashion", "model": "tiny77", "pretrained": "tiny.npz",
        "task": "zeroshot_classification", "language": "en"}
    assert record["metrics"] == {"acc1": acc1, "acc5": acc5, "mean_per_class_recall": pytest.approx(recall, abs=1e-12)}
    assert 0 < acc1 < 1 and acc1 < acc5 < 1 and 0 < recall < 1  # informative: neither all right nor all wrong


def test_retrieval_equals_clip_benchmarks(setup, ours, exported):
    from clip_benchmark.datasets.builder import image_captions_collate_fn
    from clip_benchmark.metrics import zeroshot_retrieval

    torch_model, transform = exported
    dataset = _benchmark_dataset(setup["collection"] / "captions", "captions", "zeroshot_retrieval", transform)
    theirs = zeroshot_retrieval.evaluate(torch_model, _loader(dataset, image_captions_collate_fn), open_clip.tokenize,
                                         "cpu", amp=False, recall_k_list=RECALL_K)
    _, record = ours[1]["wds/captions"]
    assert record["task"] == "zeroshot_retrieval"
    assert sorted(record["metrics"]) == sorted(theirs) and len(theirs) == 2 * len(RECALL_K)
    # The same hits: its fractions are float32 means over the 30 captions (image retrieval) or 12 images (text).
    for key, value in theirs.items():
        count = 30 if key.startswith("image_") else 12
        assert round(record["metrics"][key] * count) == round(value * count), key
        assert record["metrics"][key] == pytest.approx(value, abs=1e-7)
    assert any(0 < v < 1 for v in theirs.values())


def test_multilabel_map_equals_clip_benchmarks(setup, ours, exported):
    from clip_benchmark.metrics.zeroshot_classification import (average_precision_per_class, run_classification,
                                                                zero_shot_classifier)

    torch_model, transform = exported
    dataset = _benchmark_dataset(setup["collection"] / "tags", "tags", "zeroshot_classification", transform)
    classifier = zero_shot_classifier(torch_model, open_clip.tokenize, dataset.classes, dataset.templates, "cpu",
                                      amp=False)
    logits, target = run_classification(torch_model, classifier, _loader(dataset), "cpu", amp=False)
    assert target.shape == (16, 4)
    theirs = average_precision_per_class(logits, target).mean().item()
    _, record = ours[1]["wds/tags"]
    assert record["metrics"] == {"mean_average_precision": pytest.approx(theirs, abs=1e-6)}  # float32 torch vs ours


def test_a_collection_writes_one_json_per_dataset_and_a_csv(ours):
    out, records = ours
    assert sorted(records) == ["wds/captions", "wds/tags", "wds/vtab/fashion"]
    with open(out / "benchmark.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["dataset"] for r in rows] == ["wds/captions", "wds/tags", "wds/vtab/fashion"]
    by_name = {r["dataset"]: r for r in rows}
    assert float(by_name["wds/vtab/fashion"]["acc1"]) == records["wds/vtab/fashion"][1]["metrics"]["acc1"]
    assert by_name["wds/tags"]["acc1"] == "" and by_name["wds/captions"]["task"] == "zeroshot_retrieval"
    summary = json.loads((out / "all.json").read_text())["results"]
    assert summary["wds/tags"]["metrics"] == records["wds/tags"][1]["metrics"]


# ---------------------------------------------------------------------------------------------------------------
# Metrics against independent computations


def _numpy_average_precision(scores, targets):
    """Per class: rank images by score (no ties here), precision at each positive, their mean (0 without one)."""
    out = []
    for c in range(scores.shape[1]):
        order = sorted(range(len(scores)), key=lambda i: -scores[i, c])
        hits, precisions = 0, []
        for rank, i in enumerate(order, 1):
            if targets[i, c]:
                hits += 1
                precisions.append(hits / rank)
        out.append(sum(precisions) / len(precisions) if precisions else 0.0)
    return np.array(out)


def test_average_precision_matches_a_plain_loop_and_sklearn():
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(0)
    scores = rng.normal(size=(40, 5))
    targets = (rng.random((40, 5)) < 0.3).astype(int)
    targets[:, 4] = 0  # a class without positives: AP 0, and it still counts in the mean
    ap = metrics_lib.average_precision(scores, targets)
    np.testing.assert_allclose(ap, _numpy_average_precision(scores, targets), rtol=0, atol=1e-12)
    for c in range(4):
        assert ap[c] == pytest.approx(average_precision_score(targets[:, c], scores[:, c]), abs=1e-12)
    assert ap[4] == 0
    assert metrics_lib.mean_average_precision(scores, targets) == pytest.approx(ap.mean(), abs=1e-15)


def test_average_precision_orders_equal_scores_by_image_index():
    # Images 0 and 1 tie; image 1 is the positive, so it ranks second: precision 1/2.
    assert metrics_lib.average_precision(np.array([[1.0], [1.0], [0.0]]), np.array([[0], [1], [0]]))[0] == 0.5


def test_mean_per_class_recall_and_topk_match_plain_loops():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(50, 7))
    labels = rng.integers(0, 6, 50)  # class 6 never occurs: it does not count
    recalls = []
    for c in range(7):
        rows = [i for i in range(50) if labels[i] == c]
        if rows:
            recalls.append(sum(int(np.argmax(logits[i]) == c) for i in rows) / len(rows))
    assert metrics_lib.mean_per_class_recall(logits, labels) == pytest.approx(np.mean(recalls), abs=1e-12)
    for k in (1, 5):
        expected = np.mean([labels[i] in np.argsort(-logits[i])[:k] for i in range(50)])
        assert metrics_lib.topk_accuracy(logits, labels, k) == expected
    assert math.isnan(metrics_lib.topk_accuracy(logits[:, :4], np.minimum(labels, 3), 5))  # 4 classes: no top-5


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one clear error naming the file


@pytest.fixture
def good(tmp_path):
    return write_dataset(tmp_path / "ds", classification_samples(10), class_names=CLASSES, templates=TEMPLATES)


@pytest.mark.parametrize("break_it, error, names", [
    (lambda d: os.remove(d / "test" / "nshards.txt"), MissingInput, "test/nshards.txt"),
    (lambda d: (d / "test" / "nshards.txt").write_text("two\n"), InvalidInput, "test/nshards.txt"),
    (lambda d: (d / "test" / "nshards.txt").write_text("3\n"), MissingInput, "test/2.tar"),
    (lambda d: os.remove(d / "classnames.txt"), MissingInput, "classnames.txt"),
    (lambda d: (d / "classnames.txt").write_text("bag\n\nboot\n"), InvalidInput, "classnames.txt line 2"),
    (lambda d: (d / "zeroshot_classification_templates.txt").write_text("a photo of a {}.\n"), InvalidInput,
     "zeroshot_classification_templates.txt line 1"),
    (lambda d: (d / "zeroshot_classification_templates.txt").write_text("a photo.\n"), InvalidInput,
     "zeroshot_classification_templates.txt line 1"),
    (lambda d: (d / "dataset_type.txt").write_text("segmentation\n"), InvalidInput, "dataset_type.txt"),
])
def test_a_missing_or_malformed_metadata_file_is_named(good, break_it, error, names):
    break_it(good)
    with pytest.raises(error, match=names):
        clip_benchmark.open_dataset(str(good))


@pytest.mark.parametrize("files, message", [
    ({"cls": b"0"}, r"s0000000 has no image"),
    ({"png": None, "cls": b"one"}, r"s0000000\.cls must hold a class index"),
    ({"png": None, "cls": b"6"}, r"s0000000\.cls has label 6 but .*classnames\.txt names 6 classes"),
    ({"png": None}, r"s0000000 has no \.cls file"),
])
def test_a_bad_sample_is_named_with_its_shard(tmp_path, files, message):
    image = classification_samples(1)[0]
    files = {k: (v if v is not None else image["webp"]) for k, v in files.items()}
    folder = write_dataset(tmp_path / "ds", [files], class_names=CLASSES, templates=TEMPLATES)
    with pytest.raises(InvalidInput, match=r"test/0\.tar:" + message):
        clip_benchmark.open_dataset(str(folder))


def test_bad_retrieval_and_multilabel_samples_are_named(tmp_path):
    image = classification_samples(1)[0]["webp"]
    folder = write_dataset(tmp_path / "r", [{"webp": image, "txt": b"\n \n"}], dataset_type="retrieval")
    with pytest.raises(InvalidInput, match=r"0\.tar:s0000000\.txt holds no caption"):
        clip_benchmark.open_dataset(str(folder))
    npy = io.BytesIO()
    np.save(npy, np.ones(3))
    folder = write_dataset(tmp_path / "m", [{"webp": image, "npy": npy.getvalue()}], dataset_type="multilabel",
                           class_names=CLASSES, templates=TEMPLATES)
    with pytest.raises(InvalidInput, match=r"0\.tar:s0000000\.npy holds float64 \(3,\); .* 6 classes"):
        clip_benchmark.open_dataset(str(folder))


def test_a_truncated_shard_is_named(good):
    shard = good / "test" / "0.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(InvalidInput, match=r"test/0\.tar is not a readable tar file"):
        clip_benchmark.open_dataset(str(good))


def test_the_command_line_names_the_file_and_exits_2(setup, good, tmp_path, capsys):
    os.remove(good / "classnames.txt")
    assert zeroshot.main(["--model", setup["model"], "--benchmark", str(good), "--output-dir", str(tmp_path)]) == 2
    assert f"{good}/classnames.txt does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert zeroshot.main(["--model", setup["model"], "--benchmark", str(tmp_path / "empty")]) == 2
    assert "is no CLIP_benchmark dataset" in capsys.readouterr().err
    assert zeroshot.main(["--model", setup["model"], "--benchmark", "https://huggingface.co/datasets/x/y"]) == 2
    assert "are read from local folders" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        zeroshot.main(["--model", setup["model"], "--datasets", "wds/vtab/cifar10"])
    assert "give --benchmark ROOT" in capsys.readouterr().err


def test_the_samples_are_read_back_by_offset(good):
    """Random access returns each sample's own image bytes (CLIP_benchmark's preference: webp, png, jpg)."""
    dataset = clip_benchmark.open_dataset(str(good))
    expected = classification_samples(10)
    source = dataset.classification.source
    for i in (9, 0, 5, 8):
        item = source[i]
        assert item["image"] == next(v for k, v in expected[i].items() if k != "cls")
        assert item["label"] == i % len(CLASSES)
    assert dataset.classification.prompts[1] == ("a photo of a boot.", "a boot, seen from afar.", "boot")


# ---------------------------------------------------------------------------------------------------------------
# In training: zeroshot_data names a CLIP_benchmark dataset


def test_a_trainer_evaluates_a_clip_benchmark_dataset(setup, ours, params, tmp_path):
    """The trainer's zero-shot evaluator (`training.evaluations.open_zeroshot_evaluator`) on the classification
    folder gives the command line's acc1 and acc5 on the same params."""
    from trainer_run import tiny_config

    from clip_jax.runtime.mesh import create_mesh
    from clip_jax.training.config_checks import check_config
    from clip_jax.training.evaluations import open_zeroshot_evaluator

    folder = setup["collection"] / "vtab" / "fashion"
    config = tiny_config(("/data/{000..001}.tar", setup["model"]), tmp_path, zeroshot_data=str(folder))
    check_config(config, num_devices=8)
    evaluator = open_zeroshot_evaluator(config, create_mesh())
    assert evaluator.dataset.name == "wds/fashion" and evaluator.dataset.class_names == tuple(CLASSES)
    metrics = evaluator(params)
    expected = ours[1]["wds/vtab/fashion"][1]["metrics"]
    assert (metrics["top1"], metrics["top5"], metrics["num_images"]) == (expected["acc1"], expected["acc5"], 30)


@pytest.mark.parametrize("dataset, message", [
    ("captions", "dataset_type.txt says retrieval; training's zero-shot evaluation needs a classification dataset"),
    ("broken", "classnames.txt does not exist"),
])
def test_check_config_refuses_a_benchmark_folder_it_cannot_evaluate(setup, tmp_path, dataset, message):
    from trainer_run import tiny_config

    from clip_jax.training.config_checks import check_config

    folder = setup["collection"] / dataset
    if dataset == "broken":
        folder = write_dataset(tmp_path / "broken", classification_samples(2), templates=TEMPLATES)
    config = tiny_config(("/data/{000..001}.tar", setup["model"]), tmp_path, zeroshot_data=str(folder))
    with pytest.raises(ValueError, match=f"zeroshot_data='{folder}': .*{message}"):
        check_config(config, num_devices=8)


def test_fine_tuning_refuses_a_retrieval_folder_in_its_own_name(setup):
    from clip_jax.training.finetune_config import check_finetune_config, default_finetune_config

    c = default_finetune_config()
    c.update(pretrained=setup["checkpoint"], data=str(setup["collection"] / "captions"), train_split="test",
             test_split="test", shift_data="")
    with pytest.raises(ValueError, match="dataset_type.txt says retrieval; fine-tuning needs a classification "
                                         "dataset$"):
        check_finetune_config(c)


def test_head_keeps_the_first_images_and_their_captions(setup):
    retrieval = clip_benchmark.open_dataset(str(setup["collection"] / "captions")).head(3)
    assert retrieval.retrieval.num_images == 3
    assert list(retrieval.retrieval.caption_image) == [0, 0, 1, 1, 1, 2, 2]  # 2, 3, 2 captions
    assert retrieval.retrieval.captions[2].endswith("thing 1")
    classification = clip_benchmark.open_dataset(str(setup["collection"] / "vtab" / "fashion")).head(4)
    assert len(classification.classification) == 4


_WORKER = r"""
import json, os, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, params_path, model_json, collection = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from clip_jax.interop.weight_files import load_params
from clip_jax.evaluation import evaluate_benchmark, open_dataset
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh
model, params, mesh = create_model(model_json), load_params(params_path), create_mesh()
metrics = {name: evaluate_benchmark(model, params, open_dataset(os.path.join(collection, name)), mesh, batch_size=8,
                                    num_threads=2)
           for name in ("vtab/fashion", "tags")}
print("METRICS " + json.dumps(metrics))
"""


@pytest.mark.subprocess
@pytest.mark.slow
def test_two_processes_each_get_the_global_metrics(setup, ours):
    """30 images over 2 processes x 4 devices, 4 rows per process and step: every process gathers all logits and
    reports the single-process numbers (per-class recall and mAP need every image, not counts)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = xla_flags(4)
    workers = [subprocess.Popen([sys.executable, "-c", _WORKER, str(port), str(pid), setup["checkpoint"],
                                 setup["model"], str(setup["collection"])], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for pid in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err[-3000:]
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("METRICS "))[8:])
               for out, _ in outputs]
    assert results[0] == results[1]
    assert results[0]["vtab/fashion"] == ours[1]["wds/vtab/fashion"][1]["metrics"]
    expected_map = ours[1]["wds/tags"][1]["metrics"]["mean_average_precision"]
    assert results[0]["tags"]["mean_average_precision"] == pytest.approx(expected_map, abs=1e-6)


def test_named_datasets_are_found_in_nested_or_flat_folders_and_keep_their_names(tmp_path):
    samples = classification_samples(2)
    write_dataset(tmp_path / "vtab" / "cifar10", samples, class_names=CLASSES, templates=TEMPLATES)
    write_dataset(tmp_path / "wds_vtab-pets", samples, class_names=CLASSES, templates=TEMPLATES)
    write_dataset(tmp_path / "imagenet-a", samples, class_names=CLASSES, templates=TEMPLATES)
    names = tmp_path / "list.txt"
    names.write_text("wds/vtab/cifar10\n# a comment\nwds/vtab/pets  # flat, as LAION's repositories\n\nimagenet-a\n")
    layouts = clip_benchmark.find_named([str(tmp_path)], clip_benchmark.read_names([str(names)]))
    assert [(os.path.relpath(layout.root, tmp_path), layout.name) for layout in layouts] == [
        ("vtab/cifar10", "wds/vtab/cifar10"), ("wds_vtab-pets", "wds/vtab/pets"), ("imagenet-a", "wds/imagenet-a")]
    with pytest.raises(MissingInput, match=r"'wds/vtab/dtd' is not there: looked for .*vtab/dtd, .*wds_vtab-dtd"):
        clip_benchmark.find_named([str(tmp_path)], ["wds/vtab/dtd"])
    # Discovered without names: the path under the root, a leading "wds_" dropped.
    assert [layout.name for layout in clip_benchmark.find_datasets(str(tmp_path))] == [
        "wds/imagenet-a", "wds/vtab/cifar10", "wds/vtab-pets"]
