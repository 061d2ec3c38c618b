"""Zero-shot top-k accuracy over a classification set, data-parallel over the mesh and split over processes.

Process p of P reads images p, p + P, p + 2P, ... of the set; every step each process contributes
`batch_size / P` rows (the last ones padded and masked), the mesh encodes the global batch, and the counts of
correct rows are summed over the whole mesh, so every process gets the same, global result.
"""

import dataclasses
import functools
import math
import os
from collections.abc import Iterator, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from clip_jax.data.eval_sets import PaddedCollate
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput
from clip_jax.evaluation.classifier import build_zeroshot_classifier, zeroshot_logits
from clip_jax.evaluation.datasets import ClassificationSet, eval_image
from clip_jax.evaluation.metrics import label_ranks
from clip_jax.evaluation.sharded import replicate, round_up
from clip_jax.parallel import make_global_batch, replicated


@dataclasses.dataclass(frozen=True)
class _EvalItem:
    image_size: int

    def __call__(self, item):
        return {"image": eval_image(item["image"], self.image_size), "label": np.int32(item["label"])}


def process_share(num_items: int, process_index: int, process_count: int) -> int:
    """How many of `num_items` process `process_index` reads (items `process_index::process_count`)."""
    return len(range(process_index, num_items, process_count))


def _local_batches(dataset: ClassificationSet, *, local_batch: int, steps: int, image_size: int, mean, std,
                   num_threads: int, process_index: int, process_count: int) -> Iterator[dict[str, np.ndarray]]:
    """`steps` batches of this process's rows: {"images": float32 [b, S, S, 3], "labels": int32 [b],
    "valid": bool [b]}; rows past the end of the process's share are padding."""
    items = grain.MapDataset.source(dataset.source)[process_index::process_count].map(_EvalItem(image_size))
    collate = PaddedCollate(local_batch, tuple(mean), tuple(std))
    batches = iter(items.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                                           prefetch_buffer_size=2 * local_batch))
                   .batch(local_batch, batch_fn=collate))
    for _ in range(steps):
        batch = next(batches, None)
        if batch is None:  # this process's share ended before the others'
            batch = {"images": np.zeros((local_batch, image_size, image_size, 3), np.float32),
                     "labels": np.full(local_batch, -1, np.int32), "valid": np.zeros(local_batch, bool)}
        yield batch


@functools.partial(jax.jit, static_argnums=0)
def _image_features(model, params, images):
    return model.apply({"params": params}, images, method="encode_image")  # [B, E], split like images


@functools.partial(jax.jit, static_argnums=(0, 1))
def _count_correct(mesh, ks, features, classifier, labels, valid):
    """[len(ks) + 1] int32: rows whose label ranks below each k, and the number of real rows."""
    ranks = label_ranks(zeroshot_logits(features, classifier), labels)  # [B]
    counts = [jnp.sum((ranks < k) & valid, dtype=jnp.int32) for k in ks] + [jnp.sum(valid, dtype=jnp.int32)]
    return jax.lax.with_sharding_constraint(jnp.stack(counts), replicated(mesh))


def evaluate_zeroshot(model, params, dataset: ClassificationSet, mesh: Mesh, *, batch_size: int = 256,
                      classifier: np.ndarray | None = None, mean: Sequence[float] = OPENAI_MEAN,
                      std: Sequence[float] = OPENAI_STD, ks: Sequence[int] = (1, 5), text_batch_size: int = 1024,
                      num_threads: int | None = None, progress: bool = False) -> dict[str, float]:
    """Zero-shot accuracy of `model` with `params` on `dataset`: {"top1": ..., "top5": ..., "num_images": N}.

    Every process calls it with the same arguments; each reads only its share of the images (see the module
    docstring). `batch_size` is the global batch, a multiple of the number of devices (smaller sets use fewer
    rows). `params` may be host arrays or arrays on the mesh (any sharding). Top-k is reported for the k in `ks` not above the number of classes; ties between classes count for
    the lower class index. `classifier` [E, C] is built from `dataset.prompts` when not given.
    """
    process_index, process_count = jax.process_index(), jax.process_count()
    if batch_size % mesh.size or batch_size % process_count:
        raise InvalidInput(f"eval batch size {batch_size} must be a multiple of the {mesh.size} devices (and of the "
                         f"{process_count} processes)")
    if len(dataset) == 0:
        raise InvalidInput(f"zero-shot dataset {dataset.name} has no images")
    params = replicate(params, mesh)
    if classifier is None:
        classifier = build_zeroshot_classifier(model, params, dataset.prompts, mesh, text_batch_size=text_batch_size,
                                               progress=progress)
    num_classes = classifier.shape[1]
    if num_classes != len(dataset.class_names):
        raise InvalidInput(f"the classifier has {num_classes} classes but {dataset.name} has "
                         f"{len(dataset.class_names)} class names")
    ks = tuple(k for k in ks if k <= num_classes)

    num_images = len(dataset)
    batch_size = min(batch_size, round_up(num_images, math.lcm(mesh.size, process_count)))  # no wasted rows
    local_batch = batch_size // process_count
    steps = -(-process_share(num_images, 0, process_count) // local_batch)
    shares = [process_share(num_images, p, process_count) for p in range(process_count)]
    batches = _local_batches(dataset, local_batch=local_batch, steps=steps,
                             image_size=model.config.vision.image_size, mean=mean, std=std,
                             num_threads=num_threads or min(32, os.cpu_count() or 1),
                             process_index=process_index, process_count=process_count)
    bar = None
    if progress and process_index == 0:
        import tqdm

        bar = tqdm.tqdm(total=num_images, desc=dataset.name, unit="img")  # counts steps dispatched
    classifier = replicate(np.asarray(classifier, np.float32), mesh)
    counts = []
    for step, batch in enumerate(batches):
        labels = batch["labels"][batch["valid"]]
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise InvalidInput(f"{dataset.name} has label {int(bad[0])} but {num_classes} class names (labels "
                             f"0..{num_classes - 1}): give one class name per label")
        batch = make_global_batch(batch, mesh)
        features = _image_features(model, params, batch["images"])  # the image tower compiles once per shape
        counts.append(_count_correct(mesh, ks, features, classifier, batch["labels"], batch["valid"]))
        if bar is not None:
            bar.update(sum(min(local_batch, max(0, share - step * local_batch)) for share in shares))
    if bar is not None:
        bar.close()
    totals = np.sum([np.asarray(c) for c in counts], axis=0)
    if int(totals[-1]) != num_images:
        raise RuntimeError(f"evaluated {int(totals[-1])} images of {num_images}")
    metrics = {f"top{k}": float(totals[i]) / num_images for i, k in enumerate(ks)}
    metrics["num_images"] = num_images
    return metrics
