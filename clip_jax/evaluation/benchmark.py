"""CLIP_benchmark's metrics and result files for datasets in its webdataset layout (see `clip_benchmark`).

Classification: `acc1`, `acc5` (NaN below 5 classes) and `mean_per_class_recall` from the zero-shot logits
(`100 * image_features @ classifier`, prompts `template.format(c=class_name)`). Multilabel: `mean_average_precision`
of those logits against the multi-hot targets. Retrieval: `image_retrieval_recall@k` (for each caption, its image is
among the k best images) and `text_retrieval_recall@k` (for each image, one of its captions is among the k best
captions). Each dataset's result is CLIP_benchmark's JSON record: `dataset`, `model`, `pretrained`, `task`,
`metrics`, `language`; a collection's records are summarised in one CSV row per dataset. Its `linear_probe` task
(`lp_acc1`, `lp_acc5`, `lp_mean_per_class_recall`) trains on the cached image features of a train split (see
`linear_probe`, `probe_features`).
"""

import csv
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.evaluation import metrics as metrics_lib
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.clip_benchmark import BenchmarkDataset
from clip_jax.evaluation.evaluator import EvalSetting, Task, TaskData, register_task
from clip_jax.evaluation.linear_probe import ProbeOptions, ProbeResult, linear_probe
from clip_jax.evaluation.probe_features import cached_features, weights_key
from clip_jax.evaluation.retrieval import evaluate_retrieval
from clip_jax.runtime import ownership, stop_signals, storage
from clip_jax.runtime.stop_signals import never

RECORD_FIELDS = ("dataset", "model", "pretrained", "task", "language")


def classification_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """`acc1`, `acc5`, `mean_per_class_recall` of logits [N, C] and class labels [N]."""
    return {"acc1": metrics_lib.topk_accuracy(logits, labels, 1), "acc5": metrics_lib.topk_accuracy(logits, labels, 5),
            "mean_per_class_recall": metrics_lib.mean_per_class_recall(logits, labels)}


def retrieval_metric_names(recall: dict[str, float]) -> dict[str, float]:
    """Our recall names -> CLIP_benchmark's: text->image is its image retrieval, image->text its text retrieval."""
    renamed = {}
    for key, value in recall.items():
        if key.startswith("text_to_image_recall@"):
            renamed["image_retrieval_recall@" + key.split("@")[1]] = value
        elif key.startswith("image_to_text_recall@"):
            renamed["text_retrieval_recall@" + key.split("@")[1]] = value
    return dict(sorted(renamed.items(), key=lambda kv: (kv[0].split("@")[0], int(kv[0].split("@")[1]))))


def evaluate_benchmark(model, params, dataset: BenchmarkDataset, mesh: Mesh, *, batch_size: int = 256,
                       mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD,
                       recall_ks: Sequence[int] = (1, 5, 10), num_threads: int | None = None,
                       progress: bool = False, should_stop: Callable[[], bool] = never,
                       resize_mode: str = "shortest") -> dict[str, float]:
    """The dataset's metrics under CLIP_benchmark's names (see the module docstring)."""
    if dataset.retrieval is not None:
        recall = evaluate_retrieval(model, params, dataset.retrieval, mesh, batch_size=batch_size, mean=mean, std=std,
                                    ks=recall_ks, progress=progress, should_stop=should_stop, resize_mode=resize_mode)
        return retrieval_metric_names(recall)
    evaluator = ZeroShotEvaluator(model, dataset.classification, mesh, batch_size=batch_size, mean=mean, std=std,
                                  num_threads=num_threads, resize_mode=resize_mode)
    multilabel = dataset.targets is not None
    logits, labels = evaluator.logits(params, progress=progress, check_labels=not multilabel,
                                      should_stop=should_stop)
    if multilabel:  # labels are row indices into the multi-hot targets
        return {"mean_average_precision": metrics_lib.mean_average_precision(logits, dataset.targets[labels])}
    return classification_metrics(logits, labels)


def evaluate_linear_probe(model, params, train: BenchmarkDataset, test: BenchmarkDataset, mesh: Mesh, *,
                          val: BenchmarkDataset | None = None, val_proportion: float = 0.0, fewshot_k: int = -1,
                          options: ProbeOptions = ProbeOptions(), feature_root: str | None = None,
                          mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD,
                          num_threads: int | None = None, progress: bool = False,
                          should_stop: Callable[[], bool] = never, resize_mode: str = "shortest") -> ProbeResult:
    """CLIP_benchmark's `linear_probe` task (see `linear_probe.linear_probe`) on the image features of the train
    split, `val` and `test`, cached under `feature_root` (see `probe_features`); `should_stop` is asked before each
    batch encoded (see `encoder`)."""
    mean, std = tuple(mean), tuple(std)
    key = weights_key(params, model.config.vision.image_size, mean, std, resize_mode) if feature_root else ""

    def features(dataset: BenchmarkDataset):
        evaluator = ZeroShotEvaluator(model, dataset.classification, mesh, mean=mean, std=std,
                                      batch_size=device_batch(mesh, options.batch_size), num_threads=num_threads,
                                      resize_mode=resize_mode)
        return cached_features(feature_root, key, dataset.name, dataset.layout.split, len(dataset.classification),
                               lambda: evaluator.image_features(params, progress=progress, should_stop=should_stop))

    return linear_probe(features(train), features(test), test.classification.class_names,
                        val=features(val) if val is not None else None, val_proportion=val_proportion,
                        fewshot_k=fewshot_k, options=options)


class BenchmarkZeroShot:
    """The `Evaluator` of a CLIP_benchmark dataset's zero-shot task: classification, multilabel or retrieval by
    the dataset's type, its metrics under CLIP_benchmark's names (`evaluate_benchmark`)."""

    def __init__(self, setting: EvalSetting, dataset: BenchmarkDataset, recall_ks: Sequence[int] = (1, 5, 10)):
        self.setting, self.dataset, self.recall_ks = setting, dataset, tuple(recall_ks)
        self.name = dataset.name

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        s = self.setting
        return evaluate_benchmark(s.model, weights, self.dataset, s.mesh, batch_size=device_batch(s.mesh, s.batch_size),
                                  mean=s.mean, std=s.std, recall_ks=self.recall_ks, num_threads=s.num_threads,
                                  progress=s.progress, should_stop=should_stop, resize_mode=s.resize_mode)


class LinearProbeEvaluator:
    """The `Evaluator` of CLIP_benchmark's `linear_probe` task (`evaluate_linear_probe`): `lp_acc1`, `lp_acc5`,
    `lp_mean_per_class_recall` on the test split; `last` keeps the whole `ProbeResult` of the latest run (its weight
    decay, the images it trained on)."""

    def __init__(self, setting: EvalSetting, train: BenchmarkDataset, test: BenchmarkDataset, *,
                 val: BenchmarkDataset | None = None, val_proportion: float = 0.0, fewshot_k: int = -1,
                 options: ProbeOptions = ProbeOptions(), feature_root: str | None = None):
        self.setting, self.train, self.test, self.val = setting, train, test, val
        self.val_proportion, self.fewshot_k, self.options, self.feature_root = (val_proportion, fewshot_k, options,
                                                                                  feature_root)
        self.name, self.last = test.name, None

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        s = self.setting
        self.last = evaluate_linear_probe(s.model, weights, self.train, self.test, s.mesh, val=self.val,
                                          val_proportion=self.val_proportion, fewshot_k=self.fewshot_k,
                                          options=self.options, feature_root=self.feature_root, mean=s.mean,
                                          std=s.std, num_threads=s.num_threads, progress=s.progress,
                                          should_stop=should_stop, resize_mode=s.resize_mode)
        return dict(self.last.metrics)


def _zeroshot_task(setting: EvalSetting, data: TaskData, options: Mapping[str, Any]) -> BenchmarkZeroShot:
    return BenchmarkZeroShot(setting, data.test, options.get("recall_ks", (1, 5, 10)))


def _linear_probe_task(setting: EvalSetting, data: TaskData, options: Mapping[str, Any]) -> LinearProbeEvaluator:
    return LinearProbeEvaluator(setting, data.train, data.test, val=data.val,
                                **{k: options[k] for k in ("val_proportion", "fewshot_k", "options", "feature_root")
                                   if k in options})


# CLIP_benchmark's tasks, the ones `benchmark eval --task` and `zeroshot --benchmark` run
register_task(Task("zeroshot_classification", ("classification", "multilabel"), _zeroshot_task))
register_task(Task("zeroshot_retrieval", ("retrieval",), _zeroshot_task))
register_task(Task("linear_probe", ("classification",), _linear_probe_task, trains=True))


def device_batch(mesh: Mesh, batch_size: int) -> int:
    """An encoding batch: `batch_size` rounded up to a multiple of the devices and of the processes."""
    step = math.lcm(mesh.size, jax.process_count())
    return -(-batch_size // step) * step


def model_label(model: str) -> str:
    """The `model` of a result record: the name, or a model-config file's name without `.json`."""
    return os.path.splitext(os.path.basename(model))[0] if model.endswith(".json") else model


def result_record(dataset: BenchmarkDataset, metrics: dict[str, float], *, model: str, pretrained: str,
                  language: str = "en", task: str | None = None) -> dict:
    """CLIP_benchmark's result JSON for one dataset (`task`: the dataset's zero-shot task unless given)."""
    return {"dataset": dataset.name, "model": model, "pretrained": pretrained, "task": task or dataset.layout.task,
            "metrics": metrics, "language": language}


def _slug(text: str) -> str:
    return text.replace("/", "_").replace(os.sep, "_")


def result_filename(record: dict) -> str:
    """`{dataset}_{pretrained}_{model}_{language}_{task}.json`, CLIP_benchmark's default name (the dataset without
    its `wds/` prefix, slashes made underscores)."""
    parts = [record["dataset"].removeprefix("wds/"), *(str(record[k]) for k in ("pretrained", "model", "language",
                                                                                 "task"))]
    return "_".join(_slug(p) for p in parts) + ".json"


def write_record(record: dict, directory: str) -> str:
    """Writes one result JSON into `directory`; returns its path. NaN metrics are written as NaN, like
    CLIP_benchmark's files."""
    path = os.path.join(directory, result_filename(record))
    write_record_file(record, path, change="give another output folder")
    return path


def write_record_file(record: dict, path: str, *, change: str = "give another --output") -> None:
    """Writes one result JSON to `path` (its folder made when missing)."""
    ownership.claim_file(path, writing="the result", change=change)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def check_result_file(path: str, identity: Mapping[str, str]) -> None:
    """Before a result is evaluated: `path` can be written, and holds no file or the same result (a record whose
    `RECORD_FIELDS` are `identity`, the file its CLIP_benchmark name says: evaluated again, it is replaced) or a
    file the folder's manifest names as clip_jax's. Anything else is refused (`ownership.ForeignFiles`)."""
    storage.check_output_file(path, what="the result", change="give --output a path you can write to", remote=False)
    if not os.path.exists(path) or _same_result(path, identity):
        return
    folder, name = os.path.split(os.path.abspath(path))
    if name not in ownership.owned_names(folder):
        raise ownership.ForeignFiles(f"the result would replace {path}, which is not this result's record and "
                                     "which clip_jax did not write: give another --output")


def _same_result(path: str, identity: Mapping[str, str]) -> bool:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "metrics" in record and all(
        record.get(field) == identity[field] for field in RECORD_FIELDS)


def write_result_file(record: dict, path: str) -> None:
    """Writes the result JSON `path` whole (staged beside it, then renamed), with no manifest beside it: the file
    is clip_jax's by its name and fields (`check_result_file`), so a working folder gets no other file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    staging = os.path.join(folder, f"{ownership.OWN_PREFIX}-partial-{os.path.basename(path)}.{os.getpid()}")
    with stop_signals.unfinished(staging):
        with open(staging, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(staging, path)


def write_summary(records: Sequence[dict], path: str) -> None:
    """One CSV row per dataset: the record's fields, then every metric that occurs (empty where a dataset has
    none of that name)."""
    names = []
    for record in records:
        names.extend(k for k in record["metrics"] if k not in names)
    ownership.claim_file(path, writing="the summary", change="give another path")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*RECORD_FIELDS, *names])
        for record in records:
            cells = [record["metrics"].get(n, "") for n in names]
            writer.writerow([record[k] for k in RECORD_FIELDS] + ["nan" if isinstance(c, float) and math.isnan(c)
                                                                   else c for c in cells])
