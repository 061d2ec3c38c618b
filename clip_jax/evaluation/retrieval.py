"""Image-text retrieval recall@k over webdataset shards of images with one or more captions each (COCO, Flickr).

Images are encoded in batches split over the mesh, captions likewise; recall is computed on the host from the
gathered features (see `metrics.retrieval_recall` for the definition and the tie rule). Every process reads and
decodes all images (the sets are small: 5,000 images for COCO, 1,000 for Flickr30k).
"""

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput
from clip_jax.evaluation.batches import pad_rows
from clip_jax.evaluation.classifier import tokenize_for
from clip_jax.evaluation.encoder import ShardedEncoder, round_up
from clip_jax.evaluation.metrics import retrieval_recall
from clip_jax.evaluation.sources import RetrievalSet
from clip_jax.runtime.stop_signals import never


def first_images(retrieval_set: RetrievalSet, n: int) -> RetrievalSet:
    """The first `n` images of the set and their captions."""
    if n >= retrieval_set.num_images:
        return retrieval_set
    keep = int(np.searchsorted(retrieval_set.caption_image, n))  # captions are grouped by image, in image order
    return RetrievalSet(retrieval_set.urls, retrieval_set.captions[:keep], retrieval_set.caption_image[:keep], n)


def encode_retrieval_images(encoder: ShardedEncoder, params, retrieval_set: RetrievalSet, *, batch_size: int,
                            mean: Sequence[float], std: Sequence[float], progress: bool = False,
                            should_stop: Callable[[], bool] = never, resize_mode: str = "shortest") -> np.ndarray:
    """Normalised features float32 [N, E] of the set's first `num_images` images, with `params` placed by
    `encoder.place`; `should_stop` is asked before each batch (see `encoder`)."""
    bar = None
    if progress:
        import tqdm

        bar = tqdm.tqdm(total=retrieval_set.num_images, desc="retrieval images", unit="img")
    image_size = encoder.model.config.vision.image_size
    features, count = [], 0
    for images in retrieval_set.image_batches(batch_size=batch_size, image_size=image_size, mean=mean, std=std,
                                              resize_mode=resize_mode):
        images = images[:retrieval_set.num_images - count]
        real = len(images)
        # one shape every step
        features.append(encoder.encode_images(params, pad_rows(images, batch_size), should_stop=should_stop)[:real])
        count += real
        if bar is not None:
            bar.update(real)
        if count == retrieval_set.num_images:
            break
    if bar is not None:
        bar.close()
    if count != retrieval_set.num_images:
        raise InvalidInput(f"the retrieval shards yielded {count} images, {retrieval_set.num_images} expected: they "
                           "changed while being read")
    return np.concatenate(features)


def evaluate_retrieval(model, params, retrieval_set: RetrievalSet, mesh: Mesh, *, batch_size: int = 256,
                       mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD,
                       ks: Sequence[int] = (1, 5, 10), text_batch_size: int = 1024,
                       progress: bool = False, should_stop: Callable[[], bool] = never,
                       resize_mode: str = "shortest") -> dict[str, float]:
    """Recall@k image->text and text->image, plus `num_images` and `num_captions`. `batch_size` (at most the
    number of images) is rounded up to a multiple of the number of devices; `should_stop` is asked before each
    batch (see `encoder`)."""
    batch_size = round_up(min(batch_size, retrieval_set.num_images), mesh.size)
    progress = progress and jax.process_index() == 0
    encoder = ShardedEncoder(model, mesh)
    params = encoder.place(params)
    tokens = tokenize_for(model, retrieval_set.captions)
    image_features = encode_retrieval_images(encoder, params, retrieval_set, batch_size=batch_size, mean=mean,
                                             std=std, progress=progress, should_stop=should_stop,
                                             resize_mode=resize_mode)
    bar = None
    if progress:
        import tqdm

        bar = tqdm.tqdm(total=len(tokens), desc="retrieval captions", unit="caption")
    text_features = encoder.encode_texts(params, tokens, text_batch_size, progress=bar.update if bar else None,
                                         should_stop=should_stop)
    if bar is not None:
        bar.close()
    metrics = retrieval_recall(image_features, text_features, retrieval_set.caption_image, ks)
    metrics.update(num_images=retrieval_set.num_images, num_captions=len(retrieval_set.captions))
    return metrics
