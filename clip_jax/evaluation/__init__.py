"""Zero-shot classification and image-text retrieval, by OpenCLIP's protocol.

    from clip_jax import evaluation

    dataset = evaluation.open_classification_set("imagenet-val", "/data/imagenet/val")
    evaluator = evaluation.ZeroShotEvaluator(model, dataset, mesh, batch_size=256, mean=mean, std=std)
    metrics = evaluator(params)  # {"top1": 0.753, "top5": 0.944, "num_images": 50000}; call again with new params

Modules: `sources` (image folders, TFDS, in-memory arrays, retrieval shards), `datasets` (classification sets with
their class names and prompts), `batches` (the eval transform, padded batches), `encoder` (the image and text towers
over the mesh), `classifier` and `classification` (zero-shot accuracy), `retrieval` and `metrics` (recall@k, ranks),
`prompts` (class names and templates), `validation` (loss and recall on held-out shards during training),
`clip_benchmark` (LAION's CLIP_benchmark webdataset layout), `benchmark` (its metrics and result files),
`linear_probe` and `probe_features` (its linear probe and the cached features it trains on), `embed` with
`embed_parts`, `embed_reader` and `embed_writer` (a collection's embeddings in clip-retrieval's layout). The command
lines are `python -m clip_jax.zeroshot`, `python -m clip_jax.benchmark` (`benchmark_cli`, CLIP_benchmark's flags)
and `python -m clip_jax.embed`.
"""

from clip_jax.evaluation.benchmark import evaluate_benchmark
from clip_jax.evaluation.classification import ZeroShotEvaluator, evaluate_zeroshot
from clip_jax.evaluation.classifier import build_zeroshot_classifier, zeroshot_logits
from clip_jax.evaluation.clip_benchmark import BenchmarkDataset, find_datasets, open_dataset, read_layout
from clip_jax.evaluation.datasets import (KINDS, ClassificationSet, demo_set, image_folder_set, open_classification_set,
                                          tfds_set)
from clip_jax.evaluation.encoder import ShardedEncoder
from clip_jax.evaluation.metrics import (average_precision, label_ranks, mean_average_precision, mean_per_class_recall,
                                         retrieval_recall, topk_accuracy)
from clip_jax.evaluation.prompts import imagenet_class_names, imagenet_wnids, templates
from clip_jax.evaluation.retrieval import evaluate_retrieval
from clip_jax.evaluation.sources import RetrievalSet, load_retrieval_set

__all__ = [
    "KINDS", "BenchmarkDataset", "ClassificationSet", "RetrievalSet", "ShardedEncoder", "ZeroShotEvaluator",
    "average_precision", "build_zeroshot_classifier", "demo_set", "evaluate_benchmark", "evaluate_retrieval",
    "evaluate_zeroshot", "find_datasets", "image_folder_set", "imagenet_class_names", "imagenet_wnids", "label_ranks",
    "load_retrieval_set", "mean_average_precision", "mean_per_class_recall", "open_classification_set",
    "open_dataset", "read_layout", "retrieval_recall", "templates", "tfds_set", "topk_accuracy", "zeroshot_logits",
]
