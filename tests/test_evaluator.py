"""One evaluator interface (`clip_jax.evaluation.evaluator`): an evaluation written once, as a test would write a new
one, runs unchanged in the trainer, at its cadence beside the config's evaluations, and in
`python -m clip_jax.benchmark eval` as a registered task, and both give the same number for the same weights."""

import io
import json

import numpy as np
import pytest
from PIL import Image
from test_clip_benchmark import write_dataset
from trainer_run import tiny_config

from clip_jax.data import fashion_mnist
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import benchmark_cli
from clip_jax.evaluation.benchmark import device_batch
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.evaluator import TASKS, Task, register_task
from clip_jax.runtime.stop_signals import never
from clip_jax.training import trainer as train_lib
from clip_jax.training.evaluations import Scheduled


class FeatureSpread:
    """A new evaluation: how alike a dataset's image features are, their mean pairwise cosine."""

    def __init__(self, setting, dataset):
        self.setting, self.dataset, self.name = setting, dataset, dataset.name

    def run(self, weights, should_stop=never):
        s = self.setting
        evaluator = ZeroShotEvaluator(s.model, self.dataset.classification, s.mesh, mean=s.mean, std=s.std,
                                      batch_size=device_batch(s.mesh, s.batch_size))
        features, _ = evaluator.image_features(weights, should_stop=should_stop)
        features = np.asarray(features, np.float64)
        cosines = features @ features.T
        n = len(features)
        return {"mean_cosine": float((cosines.sum() - np.trace(cosines)) / (n * (n - 1)))}


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory):
    """64 Fashion-MNIST test images in CLIP_benchmark's layout, as `wds/fashion`."""
    root = tmp_path_factory.mktemp("datasets") / "fashion"
    images, labels = fashion_mnist.load("test")

    def png(image):
        out = io.BytesIO()
        Image.fromarray(image).save(out, format="png")
        return out.getvalue()

    write_dataset(root, [{"png": png(images[i]), "cls": str(int(labels[i])).encode()} for i in range(64)],
                  class_names=fashion_mnist.CLASS_NAMES, templates=["a photo of a {c}."])
    return root


def test_an_evaluator_written_once_runs_in_the_trainer_and_in_benchmark_eval(fashion_mnist_shards, dataset_root,
                                                                             tmp_path):
    from clip_jax.evaluation import clip_benchmark

    dataset = clip_benchmark.open_dataset(clip_benchmark.read_layout(str(dataset_root), "test", name="wds/fashion"))
    spread = Scheduled("spread", 0, lambda setting: FeatureSpread(setting, dataset))  # after the last step only
    config = tiny_config(fashion_mnist_shards(2048), tmp_path, train_num_samples=512)
    with train_lib.Trainer(config, evaluators=[spread]) as trainer:
        results = trainer.train()
    in_training = results["spread_mean_cosine"]
    recorded = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert recorded[-1]["step"] == results["step"] and recorded[-1]["spread_mean_cosine"] == in_training
    assert 0 < in_training < 1

    register_task(Task("feature_spread", ("classification",), lambda setting, data, options: FeatureSpread(
        setting, data.test)))
    try:
        with pytest.raises(InvalidInput, match="a task named 'feature_spread' is registered already"):
            register_task(Task("feature_spread", ("classification",), lambda *args: None))
        out = tmp_path / "record.json"
        assert benchmark_cli.main(["eval", "--dataset", "wds/fashion", "--dataset_root", str(dataset_root.parent),
                                   "--task", "feature_spread", "--pretrained", str(tmp_path / "run"), "--output",
                                   str(out), "--workers", "2"]) == 0
    finally:
        TASKS.pop("feature_spread")
    record = json.loads(out.read_text())
    assert (record["dataset"], record["task"]) == ("wds/fashion", "feature_spread")
    assert record["metrics"]["mean_cosine"] == pytest.approx(in_training, abs=1e-5)  # the same weights, other batches
