"""`python -m clip_jax.benchmark eval`, CLIP_benchmark's command line: the linear probe against an independent one
(OpenCLIP's features of the exported model, scikit-learn's logistic regression with its regularisation chosen on a
validation split) on a small Fashion-MNIST set in CLIP_benchmark's layout, the feature cache, the zero-shot tasks on
the code of `zeroshot --benchmark`, and every bad input in one line."""

import csv
import io
import json

import numpy as np
import open_clip
import pytest
import torch
from open_clip_reference import TINY_77, open_clip_model, state_dict_numpy
from PIL import Image
from test_clip_benchmark import write_dataset
from trainer_run import tiny_config

from clip_jax.data import fashion_mnist
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import benchmark_cli, linear_probe, probe_features, zeroshot
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.interop import convert
from clip_jax.interop import export as export_lib
from clip_jax.interop.export import export_open_clip
from clip_jax.models import get_model_config
from clip_jax.training import trainer as train_lib

NUM_TRAIN, NUM_TEST = 1000, 500
TEMPLATES = ["a photo of a {c}.", "a {c}."]
PROBE = ("--task", "linear_probe", "--fewshot_epochs", "100", "--batch_size", "32")

pytestmark = pytest.mark.usefixtures("orbax_writes_replicated_arrays_whole")  # saves not split per device


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="png")
    return out.getvalue()


def _samples(split: str, count: int):
    images, labels = fashion_mnist.load(split)
    return [{"png": _png(images[i]), "cls": str(int(labels[i])).encode()} for i in range(count)], labels[:count]


@pytest.fixture(scope="module")
def fashion(tmp_path_factory):
    """Fashion-MNIST in CLIP_benchmark's layout: the first 1,000 train and 500 test images, as PNG shards."""
    root = tmp_path_factory.mktemp("datasets") / "fashion"
    train, train_labels = _samples("train", NUM_TRAIN)
    test, test_labels = _samples("test", NUM_TEST)
    write_dataset(root, test, class_names=fashion_mnist.CLASS_NAMES, templates=TEMPLATES, per_shard=200)
    write_dataset(root, train, split="train", per_shard=400, exist_ok=True)
    return {"root": root, "train_labels": train_labels, "test_labels": test_labels}


@pytest.fixture(scope="module")
def shards(fashion_mnist_shards):
    return fashion_mnist_shards(2048)


@pytest.fixture(scope="module")
def run(shards, fashion, tmp_path_factory):
    """The trainer tests' model briefly trained (3 epochs of 2,048 Fashion-MNIST images, a linear probe on `fashion`
    after epoch 2 and at the end): its run directory and its export, which OpenCLIP loads."""
    logs = tmp_path_factory.mktemp("logs")
    train_lib.train(tiny_config(shards, logs, epochs=3, linear_probe_data=str(fashion["root"]),
                                linear_probe_frequency=2))
    folder = logs / "tiny-export"
    export_lib.export(str(logs / "run"), str(folder))
    return logs / "run", folder


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny random-init model (OpenCLIP's init, perturbed), exported: cheap, for the tests that need no learnt
    features."""
    folder = tmp_path_factory.mktemp("export") / "tiny-export"
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, seed=7)), TINY_77)
    export_open_clip(params, get_model_config(TINY_77), str(folder), mean=OPENAI_MEAN, std=OPENAI_STD)
    return folder


def _eval(export, fashion, out, *extra):
    argv = ["eval", "--dataset", "wds/fashion", "--dataset_root", str(fashion["root"].parent), "--pretrained",
            str(export), "--output", str(out / "{dataset}_{pretrained}_{model}_{task}.json"), "--num_workers", "2",
            *extra]
    return benchmark_cli.main(argv)


@pytest.fixture(scope="module")
def probed(run, fashion, tmp_path_factory):
    """`eval --task linear_probe` of the run directory (the default validation fifth): its record and feature
    root. CLIP_benchmark's 10 epochs of batches of 64 are 130 steps on 800 images, too few to converge: 100 epochs
    of 32 are 2,500."""
    out = tmp_path_factory.mktemp("results")
    assert _eval(run[0], fashion, out, *PROBE, "--feature_root", str(out / "features")) == 0
    (path,) = [p for p in out.iterdir() if p.suffix == ".json"]
    return path, json.loads(path.read_text()), out / "features"


def _open_clip_features(export, split):
    """OpenCLIP's L2-normalised image features of the exported model, its own transform of the same images."""
    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{export}")
    images, _ = fashion_mnist.load(split)
    count = NUM_TRAIN if split == "train" else NUM_TEST
    batch = torch.stack([transform(Image.fromarray(images[i])) for i in range(count)])
    with torch.no_grad():
        features = model.eval().encode_image(batch).numpy()
    return features / np.linalg.norm(features, axis=1, keepdims=True)


def _sklearn_probe(train_x, train_y, test_x, test_y):
    """Logistic regression, C chosen on a stratified validation fifth, refit on all of train: test top-1."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    fit_x, val_x, fit_y, val_y = train_test_split(train_x, train_y, test_size=0.2, stratify=train_y, random_state=0)
    scores = {c: LogisticRegression(C=c, max_iter=3000).fit(fit_x, fit_y).score(val_x, val_y)
              for c in np.logspace(0, 4, 9)}
    best = max(scores, key=scores.get)
    return LogisticRegression(C=best, max_iter=3000).fit(train_x, train_y).score(test_x, test_y)


@pytest.mark.slow
def test_the_linear_probe_is_within_1_5_points_of_scikit_learns(probed, run, fashion):
    path, record, features = probed
    assert path.name == "fashion_run_tiny_linear_probe.json"
    assert {k: record[k] for k in ("dataset", "model", "pretrained", "task", "language")} == {
        "dataset": "wds/fashion", "model": "tiny", "pretrained": "run", "task": "linear_probe",
        "language": "en"}
    assert sorted(record["metrics"]) == ["lp_acc1", "lp_acc5", "lp_mean_per_class_recall"]
    train_x, test_x = (_open_clip_features(run[1], s) for s in ("train", "test"))
    theirs = _sklearn_probe(train_x, fashion["train_labels"], test_x, fashion["test_labels"])
    assert 0.3 < theirs < 0.95  # informative: well above chance (0.1), not saturated
    assert abs(record["metrics"]["lp_acc1"] - theirs) <= 0.015, (record["metrics"], theirs)
    assert record["metrics"]["lp_acc1"] < record["metrics"]["lp_acc5"] <= 1

    # The cache holds the same L2-normalised features OpenCLIP computes, complete files only.
    (key,) = [p for p in features.iterdir() if not p.name.startswith(".")]
    cached = {p.name: np.load(p) for p in (key / "wds_fashion").iterdir()}
    assert sorted(cached) == ["test.npz", "train.npz"]
    np.testing.assert_allclose(cached["train.npz"]["features"], train_x, atol=2e-4)
    np.testing.assert_array_equal(cached["test.npz"]["labels"], fashion["test_labels"])


@pytest.mark.slow
def test_a_second_run_reads_the_cache_and_a_killed_write_leaves_no_complete_file(probed, run, fashion, tmp_path,
                                                                                 monkeypatch):
    _, record, features = probed

    def no_encoding(*args, **kwargs):
        raise AssertionError("the features were cached")

    monkeypatch.setattr(ZeroShotEvaluator, "image_features", no_encoding)
    assert _eval(run[0], fashion, tmp_path, *PROBE, "--feature_root", str(features)) == 0
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["metrics"] == record["metrics"]  # same features, same seed
    monkeypatch.undo()

    def killed(file, **arrays):
        file.write(b"PK\x03\x04 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(probe_features.np, "savez", killed)
    root = tmp_path / "killed"
    assert _eval(run[0], fashion, tmp_path, "--task", "linear_probe", "--feature_root", str(root)) == 130  # Ctrl-C
    files = [p.name for p in root.rglob("*") if p.is_file()]
    assert not any(name.endswith(".npz") and not name.startswith(".clip_jax") for name in files), files


@pytest.mark.slow
def test_zero_shot_tasks_write_the_records_of_zeroshot_benchmark(export, fashion, tmp_path):
    assert _eval(export, fashion, tmp_path, "--batch_size", "100") == 0  # --task auto: zeroshot_classification
    (path,) = tmp_path.glob("*.json")
    assert path.name == "fashion_tiny-export_tiny-export_zeroshot_classification.json"
    ours = json.loads(path.read_text())
    out = tmp_path / "zeroshot"
    assert zeroshot.main(["--checkpoint", str(export), "--benchmark", str(fashion["root"]), "--output-dir", str(out),
                          "--no-progress", "--batch-size", "100"]) == 0
    (theirs,) = out.glob("*.json")
    assert ours == json.loads(theirs.read_text())

    assert benchmark_cli.main(["build", str(path), "--output", str(tmp_path / "benchmark.csv")]) == 0
    with open(tmp_path / "benchmark.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["task"] == "zeroshot_classification" and float(row["acc1"]) == ours["metrics"]["acc1"]


def test_a_record_of_an_export_names_its_model_not_the_folder(fashion, tmp_path):
    """The model of an export (`model_name` in its open_clip_config.json) is the record's `model`, as it is of the
    run it came from; the folder's name is the record's `pretrained`. OpenCLIP still loads the folder."""
    model_file = tmp_path / "tiny-77.json"
    model_file.write_text(json.dumps(TINY_77))
    config = get_model_config(str(model_file))
    folder = tmp_path / "exported"
    params = convert.from_open_clip(state_dict_numpy(open_clip_model(TINY_77, seed=7)), TINY_77)
    export_open_clip(params, config, str(folder), mean=OPENAI_MEAN, std=OPENAI_STD)
    out = tmp_path / "results"
    assert _eval(folder, fashion, out, "--batch_size", "100", "--output", str(out / "{pretrained}_{model}.json")) == 0
    (path,) = out.glob("*.json")
    record = json.loads(path.read_text())
    assert (path.name, record["model"], record["pretrained"]) == ("exported_tiny-77.json", "tiny-77", "exported")
    open_clip.create_model_and_transforms(f"local-dir:{folder}")


@pytest.mark.slow
def test_the_trainer_logs_the_probe_of_benchmark_eval_beside_its_other_metrics(run, fashion, tmp_path):
    """`linear_probe_data`: probed after epoch 2 of 3 (`linear_probe_frequency=2`) and at the end, each a record of
    metrics.jsonl; the last one is what `benchmark eval --task linear_probe` (CLIP_benchmark's defaults) says of
    the run's final checkpoint."""
    records = [json.loads(line) for line in (run[0] / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in records if "lp_acc1" in r]
    assert [r["step"] for r in probes] == [64, 96]
    assert all(sorted(k for k in r if k != "step") == ["lp_acc1", "lp_acc5", "lp_mean_per_class_recall"]
               for r in probes)
    assert _eval(run[0], fashion, tmp_path, "--task", "linear_probe", "--feature_root", str(tmp_path / "f")) == 0
    (path,) = tmp_path.glob("*.json")
    theirs = json.loads(path.read_text())["metrics"]
    assert theirs["lp_acc1"] > 0.3  # well above chance (0.1)
    for name, value in theirs.items():  # features encoded in batches of other sizes: a test image may flip
        assert abs(probes[-1][name] - value) <= 0.01, (name, probes[-1], theirs)


def test_a_linear_probe_folder_that_is_missing_or_has_no_train_split_is_one_config_line(fashion, tmp_path):
    from clip_jax.training.config_checks import check_config

    config = tiny_config(("/data/{0..1}.tar", "ViT-B-32"), tmp_path, linear_probe_data=str(tmp_path / "nowhere"))
    with pytest.raises(InvalidInput, match=r"^bad config: linear_probe_data='.*nowhere' does not exist: give a "
                                           r"CLIP_benchmark classification dataset folder with train and test splits$"):
        check_config(config, num_devices=8)
    test_only = tmp_path / "test-only"
    test_only.mkdir()
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        (test_only / name).write_text((fashion["root"] / name).read_text())
    (test_only / "test").symlink_to(fashion["root"] / "test")
    config.linear_probe_data = str(test_only)
    with pytest.raises(InvalidInput) as error:
        check_config(config, num_devices=8)
    assert str(error.value).count("\n") == 0
    assert "linear_probe_data='" in str(error.value) and "needs a 'train' split the probe trains on" in str(
        error.value) and "train/nshards.txt" in str(error.value)


def test_skip_existing_leaves_a_result_alone(export, fashion, tmp_path, capsys):
    (tmp_path / "fashion_tiny-export_tiny-export_zeroshot_classification.json").write_text("{}")
    assert _eval(export, fashion, tmp_path, "--skip_existing") == 0
    assert "skipped" in capsys.readouterr().out
    assert (tmp_path / "fashion_tiny-export_tiny-export_zeroshot_classification.json").read_text() == "{}"


# ---------------------------------------------------------------------------------------------------------------
# The probe's parts against plain computations


def test_fewshot_keeps_k_per_class_and_refuses_a_class_with_fewer():
    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 0])
    keep = linear_probe.fewshot_indices(labels, 2, seed=3, class_names=["a", "b", "c"])
    assert np.bincount(labels[keep]).tolist() == [2, 2, 2] and list(keep) == sorted(keep)
    assert list(keep) == list(linear_probe.fewshot_indices(labels, 2, seed=3, class_names=["a", "b", "c"]))
    with pytest.raises(InvalidInput, match=r"--fewshot_k 3 is more than class 2 \('c'\) has .* \(2 images\)"):
        linear_probe.fewshot_indices(labels, 3, seed=0, class_names=["a", "b", "c"])


def test_the_validation_split_takes_a_share_of_every_class():
    labels = np.repeat(np.arange(4), [10, 5, 20, 2])
    train, val = linear_probe.validation_split(labels, 0.2, seed=0)
    assert np.bincount(labels[val]).tolist() == [2, 1, 4, 1]
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(labels)))


@pytest.mark.slow
def test_separable_features_are_learnt_and_strong_decay_shrinks_the_weights():
    rng = np.random.default_rng(0)
    centers = np.eye(3, 8)
    labels = rng.integers(0, 3, 120)
    features = centers[labels] + 0.05 * rng.normal(size=(120, 8))
    features /= np.linalg.norm(features, axis=1, keepdims=True)
    options = linear_probe.ProbeOptions(epochs=20, batch_size=16)
    weights, bias = linear_probe.fit_classifiers(features, labels, 3, [0.0, 10.0], options)
    logits = features @ weights[0] + bias[0]
    assert (logits.argmax(1) == labels).all()
    assert np.abs(weights[1]).sum() < 0.5 * np.abs(weights[0]).sum()

    # Few-shot: k per class first, the validation share carved off those k, the refit on all k.
    result = linear_probe.linear_probe((features, labels), (features, labels), ["a", "b", "c"], fewshot_k=4,
                                       val_proportion=0.25, options=options)
    assert result.num_train == 12 and len(result.val_scores) >= 7 and result.metrics["lp_acc1"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line each


def _error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_a_dataset_without_a_train_split_is_named(export, fashion, tmp_path, capsys):
    assert _eval(export, fashion, tmp_path, "--task", "linear_probe", "--train_split", "training") == 2
    assert "wds/fashion has no 'training' split" in _error(capsys)


def test_fewshot_k_larger_than_a_class_is_named(export, fashion, tmp_path, capsys):
    args = ("--task", "linear_probe", "--fewshot_k", "500", "--feature_root", str(tmp_path / "f"))
    assert _eval(export, fashion, tmp_path, *args) == 2
    assert "--fewshot_k 500 is more than class 0 ('t-shirt') has in the train split" in _error(capsys)


@pytest.mark.parametrize("what", ["text", "folder", "missing"])
def test_a_pretrained_that_is_not_a_model_is_named(export, fashion, tmp_path, capsys, what):
    pretrained = tmp_path / "weights"
    if what == "text":
        pretrained = tmp_path / "notes.txt"
        pretrained.write_text("not weights\n")
    elif what == "folder":
        pretrained.mkdir()
    assert _eval(pretrained, fashion, tmp_path, *(("--model", "ViT-B-32") if what == "text" else ())) == 2
    assert str(pretrained) in _error(capsys)


def test_a_retrieval_task_on_a_classification_set_is_refused(export, fashion, tmp_path, capsys):
    assert _eval(export, fashion, tmp_path, "--task", "zeroshot_retrieval") == 2
    assert "--task zeroshot_retrieval needs a retrieval dataset; wds/fashion is classification" in _error(capsys)


@pytest.mark.parametrize("flags, message", [
    (["--dataset", "cifar10"], "--dataset 'cifar10': only CLIP_benchmark's webdataset sets are read, named wds/NAME"),
    (["--dataset_root", "/data/{name}"], "--dataset_root '/data/{name}' cannot be formatted (KeyError: 'name')"),
    (["--output", "{dataset}_{size}.json"], "--output '{dataset}_{size}.json' cannot be formatted"),
    (["--dataset", "wds/cars"], "CLIP_benchmark dataset 'wds/cars' is not there: looked for"),
])
def test_a_bad_dataset_name_root_or_output_is_named(export, fashion, tmp_path, capsys, flags, message):
    assert _eval(export, fashion, tmp_path, *flags) == 2  # argparse keeps the last of a repeated flag
    assert message in _error(capsys)
