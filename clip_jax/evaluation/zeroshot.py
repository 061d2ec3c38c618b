"""Zero-shot classification and image-text retrieval of a checkpoint: `python -m clip_jax.zeroshot`.

    python -m clip_jax.zeroshot --model ViT-L-14 --checkpoint open_clip_model.safetensors \\
        --mean 0.5 0.5 0.5 --std 0.5 0.5 0.5 --imagenet-val /data/imagenet/val --output metrics.json

Datasets (any number of them): `--imagenet-val DIR` (class folders, OpenCLIP's layout; the 80 OpenAI templates),
`--imagenet-v2 DIR` (ImageNet-V2's numbered class folders), `--tfds NAME` (a prepared ArrayRecord TFDS dataset),
`--demo` (Fashion-MNIST test, 10,000 images, its own prompts), `--retrieval PATTERN` (webdataset shards of images
with captions), `--benchmark DIR` (a dataset in CLIP_benchmark's webdataset layout, or a collection folder of them).
The batch is split over all devices; the table is printed and the metrics written as JSON.

    python -m clip_jax.zeroshot --model ViT-L-14 --checkpoint run/ --benchmark /data/clip_benchmark \
        --output-dir results/

evaluates every CLIP_benchmark dataset under /data/clip_benchmark (classification, multilabel, retrieval) and
writes CLIP_benchmark's result JSON for each, plus `results/benchmark.csv` with one row per dataset.
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
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import benchmark as benchmark_lib
from clip_jax.evaluation import clip_benchmark
from clip_jax.evaluation import prompts as prompts_lib
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.classifier import check_vocabulary
from clip_jax.evaluation.datasets import ClassificationSet, open_classification_set
from clip_jax.evaluation.encoder import replicate
from clip_jax.evaluation.evaluator import EvalSetting, TaskData, task_named
from clip_jax.evaluation.retrieval import evaluate_retrieval, first_images
from clip_jax.evaluation.sources import load_retrieval_set
from clip_jax.interop.opener import add_budget_argument, open_model
from clip_jax.models import create_model, init_variables
from clip_jax.models.variables import eval_variables
from clip_jax.runtime import entry, ownership, stop_signals, storage
from clip_jax.runtime.mesh import create_mesh


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
    if args.imagenet_v2:
        sets.append(open_classification_set("imagenet-v2", args.imagenet_v2, **options))
    if args.tfds:
        sets.append(open_classification_set("tfds", args.tfds, split=args.tfds_split, data_dir=args.tfds_data_dir,
                                            **options))
    if args.demo:
        sets.append(open_classification_set("demo", args.demo_dir))
    return [s.head(args.limit) if args.limit else s for s in sets]


def benchmark_layouts(args) -> list[clip_benchmark.Layout]:
    """The CLIP_benchmark datasets named by `--benchmark` (folders or collections), all checked before any runs."""
    if args.datasets:
        layouts = clip_benchmark.find_named(args.benchmark, clip_benchmark.read_names(args.datasets), args.split)
    else:
        layouts = [layout for root in args.benchmark or ()
                   for layout in clip_benchmark.find_datasets(root, args.split)]
    names = [layout.name for layout in layouts]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InvalidInput(f"two --benchmark datasets are both named {duplicate!r}; their result files would clash")
    return layouts


def pretrained_label(args) -> str:
    """The `pretrained` of a result record: `--pretrained-name`, else the checkpoint's file or folder name."""
    if args.pretrained_name:
        return args.pretrained_name
    if not args.checkpoint:
        return f"random-init-seed{args.seed}"
    return os.path.basename(os.path.normpath(args.checkpoint))


def run_benchmark(args, model, params, mesh, layouts, batch_size: int) -> list[dict]:
    """Evaluates each CLIP_benchmark dataset in turn; writes its record (and, at the end, the CSV) on process 0.
    Every dataset's shards are scanned first, so a bad sample stops the command before any evaluation."""
    records = []
    write = jax.process_index() == 0
    datasets = [clip_benchmark.open_dataset(layout) for layout in layouts]
    setting = EvalSetting(model, mesh, mean=tuple(args.mean), std=tuple(args.std), batch_size=batch_size,
                          num_threads=args.workers, progress=not args.no_progress, resize_mode=args.resize_mode)
    for dataset in datasets:
        if args.limit:
            dataset = dataset.head(args.limit)
        start = time.perf_counter()
        # the dataset's own zero-shot task, made as `benchmark eval` makes it
        evaluator = task_named(dataset.layout.task).make(setting, TaskData(dataset),
                                                         {"recall_ks": tuple(args.recall_k)})
        metrics = evaluator.run(params)
        record = benchmark_lib.result_record(dataset, metrics, model=benchmark_lib.model_label(args.model),
                                             pretrained=pretrained_label(args), language=args.language)
        if write:
            path = benchmark_lib.write_record(record, args.output_dir)
            print(f"{dataset.name}: {time.perf_counter() - start:.1f} s, {path}")
        records.append(record)
    if write and records:
        benchmark_lib.write_summary(records, os.path.join(args.output_dir, "benchmark.csv"))
    return records


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
        if "task" in m:  # a CLIP_benchmark record
            cells = "  ".join(f"{k} {100 * v:6.2f}%" for k, v in m["metrics"].items())
            lines.append(f"{name} ({m['task']}): {cells}")
            continue
        if "top1" in m:
            continue
        ks = sorted(int(k.split("@")[1]) for k in m if k.startswith("image_to_text_recall@"))
        lines.append(f"{name}: {m['num_images']} images, {m['num_captions']} captions")
        for direction in ("image_to_text", "text_to_image"):
            cells = "  ".join(f"R@{k} {100 * m[f'{direction}_recall@{k}']:6.2f}%" for k in ks)
            lines.append(f"  {direction.replace('_to_', '->'):<12} {cells}")
    return "\n".join(lines)


def run(args) -> dict:
    # the model an exported folder or a run holds (at the image size it trained at), unless --model names one
    opened = (open_model(args.checkpoint, args.model, what="--checkpoint", max_num_patches=args.max_num_patches)
              if args.checkpoint else None)
    if opened is None and args.max_num_patches is not None:
        raise InvalidInput(f"--max_num_patches {args.max_num_patches} is a NaFlex model's patch budget: give the "
                           "model as --checkpoint (a freshly initialised model reads fixed-size images)")
    if opened is None:
        args.mean, args.std = tuple(args.mean or OPENAI_MEAN), tuple(args.std or OPENAI_STD)
    else:
        args.mean, args.std = opened.normalization(args.mean, args.std)
        args.model = args.model or opened.config.name
    args.resize_mode = "shortest" if opened is None else opened.resize_mode  # a SigLIP folder's processor squashes
    model = create_model(args.model if opened is None else opened.config, dtype=args.compute_dtype)
    check_vocabulary(model)
    mesh = create_mesh()
    datasets = classification_sets(args)
    layouts = benchmark_layouts(args)
    retrieval_set = load_retrieval_set(args.retrieval) if args.retrieval else None
    if retrieval_set is not None and args.limit:
        retrieval_set = first_images(retrieval_set, args.limit)
    if opened is not None:
        params = eval_variables(**opened.variables())
    else:
        params = eval_variables(**init_variables(model, jax.random.key(args.seed)))
        if jax.process_index() == 0:
            print(f"{args.model}: no --checkpoint, freshly initialised (seed {args.seed}); expect chance level")
    params = replicate(params, mesh)  # placed once, used by every dataset

    step = math.lcm(mesh.size, jax.process_count())
    batch_size = -(-args.batch_size // step) * step
    progress = not args.no_progress
    results = {}
    for dataset in datasets:
        evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=batch_size, mean=args.mean, std=args.std,
                                      num_threads=args.workers, resize_mode=args.resize_mode)
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
                                     std=tuple(args.std), progress=progress, resize_mode=args.resize_mode)
        results[f"retrieval:{args.retrieval}"] = {**metrics, "seconds": time.perf_counter() - start}
    for record in run_benchmark(args, model, params, mesh, layouts, batch_size):
        results[record["dataset"]] = record
    return {"model": args.model, "checkpoint": args.checkpoint, "num_devices": mesh.size,
            "compute_dtype": args.compute_dtype, "batch_size": batch_size, "mean": list(args.mean),
            "std": list(args.std), "resize_mode": str(args.resize_mode),
            "max_num_patches": getattr(args.resize_mode, "max_num_patches", None), "results": results}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.zeroshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model name (e.g. ViT-L-14) or OpenCLIP model-config .json (default: the "
                        "model of an exported folder or run given as --checkpoint)")
    parser.add_argument("--checkpoint", metavar="PATH",
                        help="a run directory (LOGS/NAME: its newest checkpoint) or one of its checkpoints/STEP "
                        "folders, an exported folder (python -m clip_jax.export), clip_jax params .npz, or an "
                        "OpenCLIP .pt/.pth/.bin/.safetensors (converted on the fly); --mean/--std default to a "
                        "run's or an export's own; without it a freshly initialised model")
    data = parser.add_argument_group("datasets")
    data.add_argument("--imagenet-val", metavar="DIR", help="image folder DIR/class_name/*.jpg")
    data.add_argument("--imagenet-v2", metavar="DIR", help="ImageNet-V2's folder DIR/0/*.jpeg ... DIR/999/ "
                      "(classes in numeric order)")
    data.add_argument("--tfds", metavar="NAME", help="a TFDS dataset prepared in ArrayRecord format")
    data.add_argument("--tfds-data-dir", metavar="DIR", help="TFDS data_dir holding --tfds")
    data.add_argument("--tfds-split", default="test", help="split of --tfds (ImageNet: validation)")
    data.add_argument("--demo", action="store_true", help="Fashion-MNIST test split with its demo prompts")
    data.add_argument("--demo-dir", default=fashion_mnist.DEFAULT_DIR, help="folder of the Fashion-MNIST .gz files")
    data.add_argument("--retrieval", metavar="PATTERN",
                      help="webdataset shards of images with captions (json 'captions' or txt lines), e.g. "
                      "'/data/coco/{0..4}.tar'")
    data.add_argument("--benchmark", metavar="DIR", action="append",
                      help="a dataset in CLIP_benchmark's webdataset layout (classnames.txt, "
                      "zeroshot_classification_templates.txt, dataset_type.txt, SPLIT/nshards.txt, SPLIT/0.tar...), "
                      "or a folder of such datasets (a collection); repeatable")
    data.add_argument("--datasets", nargs="+", metavar="NAME_OR_FILE",
                      help="evaluate only these datasets of the --benchmark folder(s), by CLIP_benchmark's names "
                      "(e.g. wds/vtab/cifar10, found as ROOT/vtab/cifar10 or ROOT/wds_vtab-cifar10), or files of "
                      "one name per line (e.g. its VTAB+ list); the records keep these names")
    data.add_argument("--split", default="test", help="split of the --benchmark datasets")
    data.add_argument("--recall-k", type=int, nargs="+", default=[1, 5, 10], metavar="K",
                      help="k of the --benchmark retrieval recalls")
    data.add_argument("--output-dir", default="benchmark_results", metavar="DIR",
                      help="where the --benchmark result JSONs and benchmark.csv go")
    data.add_argument("--pretrained-name", help="the 'pretrained' of the --benchmark records (default: the "
                      "checkpoint's file or folder name)")
    data.add_argument("--language", default="en", help="the 'language' of the --benchmark records")
    data.add_argument("--class-names", metavar="FILE", help="class names for --imagenet-val/-v2 / --tfds, in label "
                      "order (JSON list or one per line)")
    data.add_argument("--templates", help=f"prompt templates for --imagenet-val/-v2 / --tfds: "
                      f"{' or '.join(prompts_lib.TEMPLATE_SETS)} (default openai_imagenet), or a file (JSON list or "
                      "one per line, each with one '{}')")
    data.add_argument("--limit", type=int, help="evaluate only the first N images of each dataset")
    own = "(default: the checkpoint's own, from an exported folder's preprocess_cfg or a run's config, else OpenAI's)"
    parser.add_argument("--mean", type=float, nargs=3, help=f"image mean {own}")
    parser.add_argument("--std", type=float, nargs=3, help=f"image std {own}")
    add_budget_argument(parser)
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
    if args.datasets and not args.benchmark:
        parser.error("--datasets names CLIP_benchmark datasets to look up under the --benchmark folder(s); give "
                     "--benchmark ROOT")
    if not (args.imagenet_val or args.imagenet_v2 or args.tfds or args.demo or args.retrieval or args.benchmark):
        parser.error("no dataset: give --imagenet-val DIR, --imagenet-v2 DIR, --tfds NAME, --demo, --retrieval "
                     "PATTERN and/or --benchmark DIR")
    if min(args.recall_k) < 1:
        parser.error("--recall-k values must be at least 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if args.model is None and not args.checkpoint:
        parser.error("--model is needed without a --checkpoint (an exported folder or a run names its own)")
    return args


def check_outputs(args) -> None:
    """What process 0 writes, checked before any evaluation: `--output` writable (and claimed), and with
    `--benchmark` the `--output-dir` of its records."""
    if args.output:
        storage.check_output_file(args.output, what="the metrics", change="give --output a path you can write to",
                                  remote=False)
        ownership.claim_file(args.output, writing="the report", change="give another --output")
    if args.benchmark:
        storage.check_output_folder(args.output_dir, what="the result records", remote=False,
                                    change="give --output-dir a folder you can write to")


@entry.command(stopped="before the results were written")
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    if jax.process_index() == 0:  # before the evaluation, not after it
        check_outputs(args)
    report = run(args)
    if jax.process_index() == 0:
        print(format_tables(report["results"]))
        if report["max_num_patches"]:
            print(f"images at {report['max_num_patches']} patches (NaFlex)")
        if args.output:
            with stop_signals.unfinished(args.output), open(args.output, "w") as f:
                json.dump(report, f, indent=2, default=lambda x: x.item() if isinstance(x, np.generic) else str(x))
                f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
