"""Zero-shot classification and image-text retrieval of a checkpoint: `python -m clip_jax.zeroshot`.

    python -m clip_jax.zeroshot --model ViT-L-14 --checkpoint open_clip_model.safetensors \\
        --mean 0.5 0.5 0.5 --std 0.5 0.5 0.5 --imagenet-val /data/imagenet/val --output metrics.json

Datasets (any number of them): `--imagenet-val DIR` (class folders, OpenCLIP's layout; the 80 OpenAI templates),
`--tfds NAME` (a prepared ArrayRecord TFDS dataset), `--demo` (Fashion-MNIST test, 10,000 images, its own prompts),
`--retrieval PATTERN` (webdataset shards of images with captions). The batch is split over all devices; the table
is printed and the metrics written as JSON.
"""

import argparse
import json
import math
import os
import sys
import time

import jax
import numpy as np

from clip_jax.data import fashion_mnist
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.errors import InvalidInput, UserError
from clip_jax.evaluation import prompts as prompts_lib
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.classifier import check_vocabulary
from clip_jax.evaluation.datasets import ClassificationSet, open_classification_set
from clip_jax.evaluation.encoder import replicate
from clip_jax.evaluation.retrieval import evaluate_retrieval, first_images
from clip_jax.evaluation.sources import load_retrieval_set
from clip_jax.models import create_model, init_params
from clip_jax.parallel import create_mesh
from clip_jax.pretrained import load_pretrained


def read_checkpoint(checkpoint: str, model_name: str) -> dict:
    """Host params of `model_name` from a training run (run directory, or one `checkpoints/STEP` folder), an
    exported model folder, a clip_jax params file, or an OpenCLIP checkpoint (converted on the fly)."""
    return load_pretrained(checkpoint, model_name)


def _templates(arg: str | None) -> tuple[str, ...] | None:
    if arg is None:
        return None
    if arg in prompts_lib.TEMPLATE_SETS:
        return prompts_lib.templates(arg)
    if not os.path.exists(arg):
        raise InvalidInput(f"--templates {arg!r} is neither a template set ({', '.join(prompts_lib.TEMPLATE_SETS)}) "
                         "nor a file")
    return prompts_lib.check_templates(prompts_lib.read_lines_or_json(arg, "templates"))


def classification_sets(args) -> list[ClassificationSet]:
    class_names = prompts_lib.read_lines_or_json(args.class_names, "class names") if args.class_names else None
    options = {"class_names": class_names, "templates": _templates(args.templates)}
    sets = []
    if args.imagenet_val:
        sets.append(open_classification_set("imagenet-val", args.imagenet_val, **options))
    if args.tfds:
        sets.append(open_classification_set("tfds", args.tfds, split=args.tfds_split, data_dir=args.tfds_data_dir,
                                            **options))
    if args.demo:
        sets.append(open_classification_set("demo", args.demo_dir))
    return [s.head(args.limit) if args.limit else s for s in sets]


def format_tables(results: dict) -> str:
    lines = []
    classification = {k: v for k, v in results.items() if "top1" in v}
    if classification:
        width = max(24, *(len(k) for k in classification))
        lines.append(f"{'dataset':<{width}} {'images':>8} {'classes':>8} {'top1':>8} {'top5':>8} {'images/s':>9}")
        for name, m in classification.items():
            top5 = f"{100 * m['top5']:7.2f}%" if "top5" in m else f"{'-':>8}"
            lines.append(f"{name:<{width}} {m['num_images']:>8} {m['num_classes']:>8} {100 * m['top1']:7.2f}% "
                         f"{top5} {m['images_per_s']:>9.1f}")
    for name, m in results.items():
        if "top1" in m:
            continue
        ks = sorted(int(k.split("@")[1]) for k in m if k.startswith("image_to_text_recall@"))
        lines.append(f"{name}: {m['num_images']} images, {m['num_captions']} captions")
        for direction in ("image_to_text", "text_to_image"):
            cells = "  ".join(f"R@{k} {100 * m[f'{direction}_recall@{k}']:6.2f}%" for k in ks)
            lines.append(f"  {direction.replace('_to_', '->'):<12} {cells}")
    return "\n".join(lines)


def run(args) -> dict:
    model = create_model(args.model, dtype=args.compute_dtype)
    check_vocabulary(model)
    mesh = create_mesh()
    datasets = classification_sets(args)
    retrieval_set = load_retrieval_set(args.retrieval) if args.retrieval else None
    if retrieval_set is not None and args.limit:
        retrieval_set = first_images(retrieval_set, args.limit)
    if args.checkpoint:
        params = read_checkpoint(args.checkpoint, args.model)
    else:
        params = init_params(model, jax.random.key(args.seed))
        if jax.process_index() == 0:
            print(f"{args.model}: no --checkpoint, freshly initialised (seed {args.seed}); expect chance level")
    params = replicate(params, mesh)  # placed once, used by every dataset

    step = math.lcm(mesh.size, jax.process_count())
    batch_size = -(-args.batch_size // step) * step
    progress = not args.no_progress
    results = {}
    for dataset in datasets:
        evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=batch_size, mean=args.mean, std=args.std,
                                      num_threads=args.workers)
        start = time.perf_counter()
        classifier = evaluator.classifier(params, progress=progress)
        classifier_s = time.perf_counter() - start
        start = time.perf_counter()
        metrics = evaluator(params, classifier=classifier, progress=progress)
        seconds = time.perf_counter() - start
        results[dataset.name] = {**metrics, "num_classes": len(dataset.class_names),
                                 "num_templates": len(dataset.prompts[0]), "classifier_seconds": classifier_s,
                                 "seconds": seconds, "images_per_s": metrics["num_images"] / seconds}
    if retrieval_set is not None:
        start = time.perf_counter()
        metrics = evaluate_retrieval(model, params, retrieval_set, mesh, batch_size=batch_size, mean=tuple(args.mean),
                                     std=tuple(args.std), progress=progress)
        results[f"retrieval:{args.retrieval}"] = {**metrics, "seconds": time.perf_counter() - start}
    return {"model": args.model, "checkpoint": args.checkpoint, "num_devices": mesh.size,
            "compute_dtype": args.compute_dtype, "batch_size": batch_size, "results": results}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.zeroshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model name (e.g. ViT-L-14) or OpenCLIP model-config .json")
    parser.add_argument("--checkpoint", help="clip_jax params .npz, or an OpenCLIP .pt/.pth/.bin/.safetensors "
                        "(converted on the fly); without it a freshly initialised model")
    data = parser.add_argument_group("datasets")
    data.add_argument("--imagenet-val", metavar="DIR", help="image folder DIR/class_name/*.jpg")
    data.add_argument("--tfds", metavar="NAME", help="a TFDS dataset prepared in ArrayRecord format")
    data.add_argument("--tfds-data-dir", metavar="DIR", help="TFDS data_dir holding --tfds")
    data.add_argument("--tfds-split", default="test", help="split of --tfds (ImageNet: validation)")
    data.add_argument("--demo", action="store_true", help="Fashion-MNIST test split with its demo prompts")
    data.add_argument("--demo-dir", default=fashion_mnist.DEFAULT_DIR, help="folder of the Fashion-MNIST .gz files")
    data.add_argument("--retrieval", metavar="PATTERN",
                      help="webdataset shards of images with captions (json 'captions' or txt lines), e.g. "
                      "'/data/coco/{0..4}.tar'")
    data.add_argument("--class-names", metavar="FILE", help="class names for --imagenet-val / --tfds, in label "
                      "order (JSON list or one per line)")
    data.add_argument("--templates", help=f"prompt templates for --imagenet-val / --tfds: "
                      f"{' or '.join(prompts_lib.TEMPLATE_SETS)} (default openai_imagenet), or a file (JSON list or "
                      "one per line, each with one '{}')")
    data.add_argument("--limit", type=int, help="evaluate only the first N images of each dataset")
    parser.add_argument("--mean", type=float, nargs=3, default=OPENAI_MEAN, help="image mean (LAION L/14: 0.5 0.5 0.5)")
    parser.add_argument("--std", type=float, nargs=3, default=OPENAI_STD, help="image std (LAION L/14: 0.5 0.5 0.5)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch (rounded up to a multiple of the "
                        "number of devices)")
    parser.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--workers", type=int, help="image decoding threads per process (default: CPU count)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed when no checkpoint is given")
    parser.add_argument("--output", metavar="FILE", help="write the metrics as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first (one "
                        "process per host or per GPU, e.g. under srun)")
    args = parser.parse_args(argv)
    if not (args.imagenet_val or args.tfds or args.demo or args.retrieval):
        parser.error("no dataset: give --imagenet-val DIR, --tfds NAME, --demo and/or --retrieval PATTERN")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    try:
        report = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(format_tables(report["results"]))
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(report, f, indent=2, default=lambda x: x.item() if isinstance(x, np.generic) else str(x))
                f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
