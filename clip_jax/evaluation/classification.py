"""Zero-shot top-k accuracy over a classification set, data-parallel over the mesh and split over processes.

Process p of P reads images p, p + P, p + 2P, ... of the set; every step each process contributes
`batch_size / P` rows (the last ones padded and masked), the mesh encodes the global batch, and the counts of
correct rows are summed over the whole mesh, so every process gets the same, global result.

`ZeroShotEvaluator` is built once per model and set and called with params as often as needed (a trainer evaluates
every few epochs): the prompt tokens are made once, and the towers compile at the first call only. Each call takes
a `should_stop`, asked before every batch it encodes (see `encoder`).
"""

import functools
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput
from clip_jax.evaluation.batches import classification_batches
from clip_jax.evaluation.classifier import classifier_from_tokens, prompt_tokens, zeroshot_logits
from clip_jax.evaluation.datasets import ClassificationSet
from clip_jax.evaluation.encoder import ShardedEncoder, replicate, round_up
from clip_jax.evaluation.metrics import label_ranks
from clip_jax.runtime.mesh import make_global_batch, replicated
from clip_jax.runtime.stop_signals import never


def process_share(num_items: int, process_index: int, process_count: int) -> int:
    """How many of `num_items` process `process_index` reads (items `process_index::process_count`)."""
    return len(range(process_index, num_items, process_count))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _count_correct(mesh, ks, features, classifier, labels, valid):
    """[len(ks) + 1] int32: rows whose label ranks below each k, and the number of real rows."""
    ranks = label_ranks(zeroshot_logits(features, classifier), labels)  # [B]
    counts = [jnp.sum((ranks < k) & valid, dtype=jnp.int32) for k in ks] + [jnp.sum(valid, dtype=jnp.int32)]
    return jax.lax.with_sharding_constraint(jnp.stack(counts), replicated(mesh))


@functools.partial(jax.jit, static_argnums=(0,))
def _gathered_logits(mesh, features, classifier, labels, valid):
    """Logits [B, C], labels [B] and valid [B] of a global batch, replicated so that every process holds them."""
    out = (zeroshot_logits(features, classifier), labels, valid)
    return jax.lax.with_sharding_constraint(out, replicated(mesh))


@functools.partial(jax.jit, static_argnums=(0,))
def _gathered(mesh, *rows):
    """The rows of a global batch (features [B, E], labels [B], valid [B]), replicated on every process."""
    return jax.lax.with_sharding_constraint(rows, replicated(mesh))


class ZeroShotEvaluator:
    """Zero-shot accuracy of `model` on `dataset`: `evaluator(params) -> {"top1": ..., "top5": ..., "num_images": N}`.

    Every process builds and calls it with the same arguments; each reads only its share of the images (see the
    module docstring). `batch_size` is the global batch, a multiple of the number of devices (smaller sets use fewer
    rows). Top-k is reported for the k in `ks` not above the number of classes; ties between classes count for the
    lower class index.
    """

    def __init__(self, model, dataset: ClassificationSet, mesh: Mesh, *, batch_size: int = 256,
                 mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD, ks: Sequence[int] = (1, 5),
                 text_batch_size: int = 1024, num_threads: int | None = None, resize_mode: str = "shortest"):
        process_count = jax.process_count()
        if batch_size % mesh.size or batch_size % process_count:
            raise InvalidInput(f"eval batch size {batch_size} must be a multiple of the {mesh.size} devices (and of "
                               f"the {process_count} processes)")
        if len(dataset) == 0:
            raise InvalidInput(f"zero-shot dataset {dataset.name} has no images")
        self.model, self.dataset, self.mesh = model, dataset, mesh
        self.encoder = ShardedEncoder(model, mesh)
        self.mean, self.std, self.ks = tuple(mean), tuple(std), tuple(ks)
        self.resize_mode = resize_mode  # the eval transform's: "shortest" then a center crop, or "squash"
        self.text_batch_size = text_batch_size
        self.num_threads = num_threads or min(32, os.cpu_count() or 1)
        num_images = len(dataset)
        batch_size = min(batch_size, round_up(num_images, math.lcm(mesh.size, process_count)))  # no wasted rows
        self.local_batch = batch_size // process_count
        self.steps = -(-process_share(num_images, 0, process_count) // self.local_batch)

    @property
    def name(self) -> str:
        return self.dataset.name

    def run(self, weights, should_stop: Callable[[], bool] = never) -> dict[str, float]:
        """`top1`, `top5` (as many classes there are) and `num_images` of `weights`: the `Evaluator` interface
        (`clip_jax.evaluation.evaluator`)."""
        return self(weights, should_stop=should_stop)

    @functools.cached_property
    def prompt_tokens(self) -> np.ndarray:
        """Token ids [C * T, L] of the set's prompts, made at the first classifier built."""
        return prompt_tokens(self.model, self.dataset.prompts)

    def classifier(self, params, *, progress: bool = False, should_stop: Callable[[], bool] = never) -> np.ndarray:
        """The zero-shot classifier float32 [E, C] of the set's prompts under `params`."""
        return classifier_from_tokens(self.encoder, self.encoder.place(params), self.prompt_tokens,
                                      len(self.dataset.prompts[0]), text_batch_size=self.text_batch_size,
                                      progress=progress, should_stop=should_stop)

    def __call__(self, params, *, classifier: np.ndarray | None = None, progress: bool = False,
                 should_stop: Callable[[], bool] = never) -> dict[str, float]:
        """Accuracy under `params` (host arrays or arrays on the mesh, any sharding). `classifier` [E, C] is built
        from the set's prompts when not given."""
        params = self.encoder.place(params)
        if classifier is None:
            classifier = self.classifier(params, progress=progress, should_stop=should_stop)
        num_classes = classifier.shape[1]
        if num_classes != len(self.dataset.class_names):
            raise InvalidInput(f"the classifier has {num_classes} classes but {self.dataset.name} has "
                               f"{len(self.dataset.class_names)} class names")
        ks = tuple(k for k in self.ks if k <= num_classes)
        classifier = replicate(np.asarray(classifier, np.float32), self.mesh)
        counts = [_count_correct(self.mesh, ks, features, classifier, labels, valid)
                  for features, labels, valid in self._encoded_batches(params, num_classes, progress,
                                                                       should_stop=should_stop)]
        totals = np.sum([np.asarray(c) for c in counts], axis=0)
        num_images = len(self.dataset)
        if int(totals[-1]) != num_images:
            raise RuntimeError(f"evaluated {int(totals[-1])} images of {num_images}")
        metrics = {f"top{k}": float(totals[i]) / num_images for i, k in enumerate(ks)}
        metrics["num_images"] = num_images
        return metrics

    def logits(self, params, *, classifier: np.ndarray | None = None, progress: bool = False,
               check_labels: bool = True, should_stop: Callable[[], bool] = never) -> tuple[np.ndarray, np.ndarray]:
        """Host logits float32 [N, C] and labels int32 [N] of every image, on every process, for metrics that need
        more than counts (per-class recall, average precision). Rows come in batch order (process-interleaved when
        there are several processes), each with its own label. `check_labels=False` lets a source use labels that
        are not class indices (e.g. row indices into multi-hot targets held elsewhere)."""
        params = self.encoder.place(params)
        if classifier is None:
            classifier = self.classifier(params, progress=progress, should_stop=should_stop)
        num_classes = classifier.shape[1]
        classifier = replicate(np.asarray(classifier, np.float32), self.mesh)
        logits, labels = [], []
        for features, batch_labels, valid in self._encoded_batches(params, num_classes, progress, check_labels,
                                                                   should_stop=should_stop):
            rows = [np.asarray(x) for x in _gathered_logits(self.mesh, features, classifier, batch_labels, valid)]
            logits.append(rows[0][rows[2]])
            labels.append(rows[1][rows[2]])
        logits, labels = np.concatenate(logits), np.concatenate(labels)
        if len(labels) != len(self.dataset):
            raise RuntimeError(f"evaluated {len(labels)} images of {len(self.dataset)}")
        return logits, labels

    def image_features(self, params, *, progress: bool = False,
                       should_stop: Callable[[], bool] = never) -> tuple[np.ndarray, np.ndarray]:
        """Host image features float32 [N, E] (L2-normalised) and labels int32 [N] of every image, on every process,
        in the order of `logits` (what a linear probe trains on)."""
        params = self.encoder.place(params)
        features, labels = [], []
        for batch_features, batch_labels, valid in self._encoded_batches(params, len(self.dataset.class_names),
                                                                         progress, should_stop=should_stop):
            rows = [np.asarray(x) for x in _gathered(self.mesh, batch_features, batch_labels, valid)]
            features.append(rows[0][rows[2]].astype(np.float32))
            labels.append(rows[1][rows[2]])
        features, labels = np.concatenate(features), np.concatenate(labels)
        if len(labels) != len(self.dataset):
            raise RuntimeError(f"encoded {len(labels)} images of {len(self.dataset)}")
        return features, labels

    def _encoded_batches(self, params, num_classes: int, progress: bool, check_labels: bool = True, *,
                         should_stop: Callable[[], bool] = never):
        """(image features [B, E], labels [B], valid [B]) of every global batch, on the mesh."""
        process_index, process_count = jax.process_index(), jax.process_count()
        name, num_images, local_batch = self.dataset.name, len(self.dataset), self.local_batch
        batches = classification_batches(self.dataset.source, batch_size=local_batch,
                                         image_size=self.model.config.vision.image_size, mean=self.mean,
                                         std=self.std, num_threads=self.num_threads, process_index=process_index,
                                         process_count=process_count, steps=self.steps, resize_mode=self.resize_mode)
        shares = [process_share(num_images, p, process_count) for p in range(process_count)]
        bar = None
        if progress and process_index == 0:
            import tqdm

            bar = tqdm.tqdm(total=num_images, desc=name, unit="img")  # counts steps dispatched
        for step, batch in enumerate(batches):
            labels = batch["labels"][batch["valid"]]
            bad = labels[(labels < 0) | (labels >= num_classes)]
            if check_labels and bad.size:
                raise InvalidInput(f"{name} has label {int(bad[0])} but {num_classes} class names (labels "
                                   f"0..{num_classes - 1}): give one class name per label")
            batch = make_global_batch(batch, self.mesh)
            # the image tower compiles once per shape
            yield (self.encoder.image_features(params, batch["images"], should_stop=should_stop), batch["labels"],
                   batch["valid"])
            if bar is not None:
                bar.update(sum(min(local_batch, max(0, share - step * local_batch)) for share in shares))
        if bar is not None:
            bar.close()


def evaluate_zeroshot(model, params, dataset: ClassificationSet, mesh: Mesh, *, batch_size: int = 256,
                      classifier: np.ndarray | None = None, mean: Sequence[float] = OPENAI_MEAN,
                      std: Sequence[float] = OPENAI_STD, ks: Sequence[int] = (1, 5), text_batch_size: int = 1024,
                      num_threads: int | None = None, progress: bool = False) -> dict[str, float]:
    """One zero-shot evaluation: `ZeroShotEvaluator(model, dataset, mesh, ...)(params, classifier=classifier)`."""
    evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=batch_size, mean=mean, std=std, ks=ks,
                                  text_batch_size=text_batch_size, num_threads=num_threads)
    return evaluator(params, classifier=classifier, progress=progress)
