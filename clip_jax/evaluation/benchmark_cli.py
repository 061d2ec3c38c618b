"""CLIP_benchmark's command line: `python -m clip_jax.benchmark eval ...` and `... build ...`, its flag names.

    python -m clip_jax.benchmark eval --dataset wds/vtab/cifar10 wds/fer2013 \\
        --dataset_root "/data/clip_benchmark/wds_{dataset_cleaned}" --pretrained export/ \\
        --task linear_probe --output "results/{dataset}_{pretrained}_{model}_{language}_{task}.json"

`--dataset` takes CLIP_benchmark's webdataset names (`wds/NAME`) or files of one name per line; `--dataset_root` is
formatted with `{dataset}` (the name without `wds/`) and `{dataset_cleaned}` (that with `/` made `-`) and is either
the dataset's folder or a folder holding it (`ROOT/vtab/cifar10`, `ROOT/wds_vtab-cifar10`). `--task auto` (the
default) is the dataset's own zero-shot task. `--pretrained` is an exported folder, a run directory or a checkpoint
file (clip_jax .npz, OpenCLIP .pt/.bin/.safetensors; `--model` names its model). Each dataset's result is
CLIP_benchmark's JSON record, written to `--output` formatted with `{dataset}` (the name without `wds/`, `/` made
`_`), `{model}`, `{pretrained}` (its file or folder name), `{task}` and `{language}`. `build` gathers records into
one CSV row per dataset. The zero-shot tasks run the code of `python -m clip_jax.zeroshot --benchmark`.

Without a download, one dataset is at hand: the bundled Fashion-MNIST, which `fashion-mnist FOLDER` writes in
CLIP_benchmark's layout (as the fine-tuning demo does):

    python -m clip_jax.benchmark fashion-mnist data/clip_benchmark/fashion-mnist
    python -m clip_jax.benchmark eval --dataset wds/fashion-mnist --dataset_root data/clip_benchmark \\
        --pretrained logs/demo
"""

import argparse
import json
import os
import sys
import time

import jax

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation import benchmark as benchmark_lib
from clip_jax.evaluation import clip_benchmark
from clip_jax.evaluation.classifier import check_vocabulary
from clip_jax.evaluation.benchmark import model_label
from clip_jax.evaluation.encoder import replicate
from clip_jax.evaluation.evaluator import TASKS, EvalSetting, TaskData, task_named
from clip_jax.evaluation.linear_probe import ProbeOptions
from clip_jax.interop.opener import add_budget_argument, open_model
from clip_jax.models import create_model
from clip_jax.models.variables import eval_variables
from clip_jax.runtime import entry, storage
from clip_jax.runtime.mesh import create_mesh

DEFAULT_OUTPUT = "{dataset}_{pretrained}_{model}_{language}_{task}.json"
DEFAULT_VAL_PROPORTION = 0.2


def bare_name(name: str) -> str:
    if not name.startswith("wds/"):
        raise InvalidInput(f"--dataset {name!r}: only CLIP_benchmark's webdataset sets are read, named wds/NAME "
                           "(download clip-benchmark/wds_NAME from Hugging Face and name it wds/NAME)")
    return name.removeprefix("wds/").strip("/")


def locate(name: str, dataset_root: str, split: str) -> clip_benchmark.Layout:
    """The layout of dataset `name`'s `split` under `--dataset_root` (formatted as CLIP_benchmark formats it)."""
    bare = bare_name(name)
    try:
        root = dataset_root.format(dataset=bare, dataset_cleaned=bare.replace("/", "-"))
    except (KeyError, IndexError, ValueError) as e:
        raise InvalidInput(f"--dataset_root {dataset_root!r} cannot be formatted ({type(e).__name__}: {e}): use "
                           "{dataset} and {dataset_cleaned}") from None
    if os.path.isdir(os.path.join(root, split)) or clip_benchmark.is_dataset_folder(root, split):
        return clip_benchmark.read_layout(root, split, name=f"wds/{bare}")
    return clip_benchmark.find_named([root], [name], split)[0]


def task_of(args, layout: clip_benchmark.Layout) -> str:
    task = layout.task if args.task == "auto" else args.task
    wanted = task_named(task).dataset_types
    if layout.dataset_type not in wanted:
        raise InvalidInput(f"--task {task} needs a {' or '.join(wanted)} dataset; {layout.name} is "
                           f"{layout.dataset_type} ({os.path.join(layout.root, clip_benchmark.TYPE_FILE)})")
    return task


def pretrained_slug(pretrained: str) -> str:
    return os.path.basename(os.path.normpath(pretrained))


def output_path(args, layout: clip_benchmark.Layout, task: str, model: str) -> str:
    try:
        return args.output.format(dataset=bare_name(layout.name).replace("/", "_"), model=model.replace("/", "_"),
                                  pretrained=pretrained_slug(args.pretrained), task=task, language=args.language)
    except (KeyError, IndexError, ValueError) as e:
        raise InvalidInput(f"--output {args.output!r} cannot be formatted ({type(e).__name__}: {e}): use {{dataset}}, "
                           "{model}, {pretrained}, {task} and {language}") from None


def load_model(args):
    """(model, params replicated on the mesh, mesh, mean, std, model name, the eval transform's resize) of
    `--pretrained` / `--model`."""
    opened = open_model(args.pretrained, args.model, what="--pretrained",
                        max_num_patches=getattr(args, "max_num_patches", None))
    mean, std = opened.normalization()
    model = create_model(opened.config, dtype="float32")
    check_vocabulary(model)
    mesh = create_mesh()
    params = replicate(eval_variables(**opened.variables()), mesh)
    return model, params, mesh, mean, std, model_label(args.model or model.config.name), opened.resize_mode


def plan(args, model_name: str) -> list[tuple]:
    """(test layout, task, output path, train layout, val layout) of every dataset, all checked before any runs."""
    jobs = []
    for name in clip_benchmark.read_names(args.dataset):
        layout = locate(name, args.dataset_root, args.split)
        task = task_of(args, layout)
        train = val = None
        if task_named(task).trains:
            train = probe_split(name, args.train_split, layout, "--train_split")
            val = probe_split(name, args.val_split, layout, "--val_split") if args.val_split else None
        jobs.append((layout, task, output_path(args, layout, task, model_name), train, val))
    return jobs


def probe_split(name: str, split: str, test: clip_benchmark.Layout, flag: str) -> clip_benchmark.Layout:
    try:
        return clip_benchmark.read_layout(test.root, split, name=test.name)
    except MissingInput:
        raise MissingInput(f"{name} has no {split!r} split ({os.path.join(test.root, split, 'nshards.txt')} is "
                           f"missing); linear_probe trains on it: give {flag} a split the dataset has") from None


def evaluate(args, job, loaded) -> dict:
    """The CLIP_benchmark record of one dataset: its task's evaluator (`evaluator.TASKS`) run on the loaded model."""
    layout, task, _, train, val = job
    model, params, mesh, mean, std, model_name, resize_mode = loaded
    test = clip_benchmark.open_dataset(layout)
    setting = EvalSetting(model, mesh, mean=mean, std=std, batch_size=args.batch_size, num_threads=args.num_workers,
                          progress=args.verbose, resize_mode=resize_mode)
    options = {"recall_ks": tuple(args.recall_k), "fewshot_k": args.fewshot_k, "feature_root": args.feature_root,
               "options": ProbeOptions(lr=args.fewshot_lr, epochs=args.fewshot_epochs, batch_size=args.batch_size,
                                       seed=args.seed)}
    if task_named(task).trains:
        proportion = args.val_proportion
        if val is None and proportion is None:
            proportion = DEFAULT_VAL_PROPORTION
            print(f"{layout.name}: no --val_split or --val_proportion: the weight decay is searched on a validation "
                  f"fifth of {args.train_split} (--val_proportion 0 trains with weight decay 0, as CLIP_benchmark "
                  "does)")
        options["val_proportion"] = proportion or 0.0
    data = TaskData(test, train=clip_benchmark.open_dataset(train) if train else None,
                    val=clip_benchmark.open_dataset(val) if val else None)
    evaluator = task_named(task).make(setting, data, options)
    metrics = evaluator.run(params)
    probe = getattr(evaluator, "last", None)
    if probe is not None:
        print(f"{layout.name}: weight decay {probe.weight_decay:.3g}, trained on {probe.num_train} images")
    return benchmark_lib.result_record(test, metrics, model=model_name, pretrained=pretrained_slug(args.pretrained),
                                       language=args.language, task=task)


def run_eval(args) -> list[dict]:
    opened = open_model(args.pretrained, args.model, what="--pretrained",  # what it holds, before any dataset
                        max_num_patches=args.max_num_patches)
    model_name = model_label(args.model or opened.config.name)
    jobs = plan(args, model_name)
    todo = [job for job in jobs if not (args.skip_existing and os.path.exists(job[2]))]
    for job in jobs:
        if job not in todo:
            print(f"{job[0].name}: skipped, {job[2]} exists (--skip_existing)")
    if not todo:
        return []
    if jax.process_index() == 0:  # the process that writes the records: before any dataset is evaluated
        for job in todo:
            benchmark_lib.check_result_file(job[2], identity(args, job, model_name))
    loaded = load_model(args)
    records = []
    for job in todo:
        start = time.perf_counter()
        record = evaluate(args, job, loaded)
        if jax.process_index() == 0:
            benchmark_lib.write_result_file(record, job[2])
            cells = "  ".join(f"{k} {100 * v:.2f}%" for k, v in record["metrics"].items())
            print(f"{record['dataset']} ({record['task']}{opened.budget_clause()}, {time.perf_counter() - start:.1f} s): {cells} -> {job[2]}")
        records.append(record)
    return records


def identity(args, job, model_name: str) -> dict[str, str]:
    """The fields of CLIP_benchmark's record that name the result `job` writes (`benchmark.RECORD_FIELDS`)."""
    layout, task = job[0], job[1]
    return {"dataset": layout.name, "model": model_name, "pretrained": pretrained_slug(args.pretrained),
            "task": task, "language": args.language}


def check_output(path: str) -> None:
    storage.check_output_file(path, what="the result", change="give --output a path you can write to", remote=False)


def run_build(args) -> None:
    check_output(args.output)
    records = []
    for path in args.files:
        try:
            with open(path) as f:
                record = json.load(f)
        except FileNotFoundError:
            raise MissingInput(f"{path} does not exist") from None
        except (OSError, ValueError) as e:
            raise InvalidInput(f"{path} is not a JSON result record ({e})") from None
        missing = [k for k in (*benchmark_lib.RECORD_FIELDS, "metrics") if k not in record]
        if missing:
            raise InvalidInput(f"{path} is not a CLIP_benchmark result record: it has no {', '.join(missing)}")
        records.append(record)
    benchmark_lib.write_summary(records, args.output)
    print(f"{len(records)} records -> {args.output}")


def run_fashion_mnist(args) -> None:
    """Writes the bundled Fashion-MNIST into `args.folder` in CLIP_benchmark's layout, unless it is there already."""
    from clip_jax.evaluation.fashion_mnist_layout import write_fashion_mnist

    change = "give another FOLDER"
    storage.check_output_folder(args.folder, what="Fashion-MNIST", change=change, remote=False)
    write_fashion_mnist(args.folder, change=change)
    root, name = os.path.split(os.path.normpath(args.folder))
    print(f"{args.folder}: Fashion-MNIST's train and test splits in CLIP_benchmark's layout; evaluate a model on it "
          f"with: python -m clip_jax.benchmark eval --dataset wds/{name} --dataset_root {root or '.'} --pretrained "
          "MODEL")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.benchmark", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ev = commands.add_parser("eval", help="evaluate a model on CLIP_benchmark datasets")
    ev.add_argument("--dataset", nargs="+", required=True, metavar="NAME_OR_FILE",
                    help="wds/NAME datasets, or files of one name per line")
    ev.add_argument("--dataset_root", default="root", help="the datasets' folder, formatted with {dataset} and "
                    "{dataset_cleaned}, or a folder holding them")
    ev.add_argument("--task", default="auto", choices=("auto", *TASKS),
                    help="the dataset's own zero-shot task (auto), or one of the registered tasks")
    ev.add_argument("--pretrained", "--checkpoint", dest="pretrained", required=True,
                    help="exported folder, run directory or checkpoint file (--checkpoint: zeroshot's spelling)")
    ev.add_argument("--model", help="model name or OpenCLIP model-config .json (default: the folder's own)")
    add_budget_argument(ev)
    ev.add_argument("--output", default=DEFAULT_OUTPUT, help="result JSON path, formatted with {dataset}, {model}, "
                    "{pretrained}, {task}, {language}")
    ev.add_argument("--language", default="en")
    ev.add_argument("--split", default="test", help="the split evaluated")
    ev.add_argument("--train_split", default="train", help="linear_probe: the split it trains on")
    ev.add_argument("--val_split", help="linear_probe: a split to search the weight decay on (then trained on too)")
    ev.add_argument("--val_proportion", type=float, help="linear_probe: the fraction of --train_split held out to "
                    f"search the weight decay on (default {DEFAULT_VAL_PROPORTION}; 0: weight decay 0, no search)")
    ev.add_argument("--batch_size", type=int, default=64)
    ev.add_argument("--num_workers", "--workers", dest="num_workers", type=int,
                    help="image decoding threads (default: CPU count; --workers: zeroshot's spelling)")
    ev.add_argument("--fewshot_k", type=int, default=-1, help="linear_probe: images per class (-1: all)")
    ev.add_argument("--fewshot_epochs", type=int, default=10)
    ev.add_argument("--fewshot_lr", type=float, default=0.1)
    ev.add_argument("--feature_root", default="features", help="linear_probe: where image features are cached")
    ev.add_argument("--recall_k", type=int, nargs="+", default=[5])
    ev.add_argument("--skip_existing", action="store_true", help="skip a dataset whose --output exists")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--verbose", action="store_true", help="progress bars")
    ev.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first (one "
                    "process per host or per GPU, e.g. under srun)")
    build = commands.add_parser("build", help="one CSV row per result JSON")
    build.add_argument("files", nargs="+", metavar="RESULT_JSON")
    build.add_argument("--output", default="benchmark.csv")
    fashion = commands.add_parser("fashion-mnist", help="write the bundled Fashion-MNIST (70,000 images) as a "
                                  "CLIP_benchmark dataset: the one evaluated without a download")
    fashion.add_argument("folder", help="the dataset's folder, e.g. data/clip_benchmark/fashion-mnist (then "
                         "--dataset wds/fashion-mnist --dataset_root data/clip_benchmark)")
    args = parser.parse_args(argv)
    if args.command == "eval":
        if args.batch_size < 1 or args.fewshot_epochs < 1 or min(args.recall_k) < 1:
            parser.error("--batch_size, --fewshot_epochs and --recall_k must be at least 1")
        if args.fewshot_k == 0 or args.fewshot_k < -1:
            parser.error("--fewshot_k must be a number of images per class, or -1 for all")
        if args.val_split and args.val_proportion is not None:
            parser.error("give --val_split or --val_proportion, not both")
        if args.val_proportion is not None and not 0 <= args.val_proportion < 1:
            parser.error("--val_proportion must be in [0, 1)")
    return args


@entry.command(stopped="before the results left were written (those of the datasets done are kept)")
def main(argv=None) -> int:
    args = parse_args(argv)
    if getattr(args, "distributed", False):
        jax.distributed.initialize()
    {"eval": run_eval, "build": run_build, "fashion-mnist": run_fashion_mnist}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
