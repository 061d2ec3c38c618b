"""Zero-shot eval throughput: clip_jax's eval loop against OpenCLIP's, same model and image folder, fp32, CPU.

    python benchmarks/zeroshot_eval.py [--model ViT-B-32] [--images 192] [--batch-size 32] [--workers 2]
    python benchmarks/zeroshot_eval.py --model tiny-224   # a tiny 224 px model: decoding and resizing dominate

Generates an ImageNet-like folder (JPEGs of 400-500 x 300-375 px, quality 90) and random weights (OpenCLIP's
init, converted). OpenCLIP's side is its ImageNet eval: `torchvision.datasets.ImageFolder` with OpenCLIP's eval
transform, a `DataLoader` with `--workers` worker processes, and the loop of `open_clip_train.zero_shot.run`
(image features, `100 * features @ classifier`, top-k). clip_jax's side is a `ZeroShotEvaluator` with `--workers`
decoding threads over all JAX devices. Both classifiers are built from the same prompts, and both loops must agree on
top-1/top-5. OpenCLIP runs first, before JAX starts its threads (its DataLoader forks). Each side runs once on
one batch to warm up (worker start, JIT compilation), then is timed over the whole folder. Prints a table and
writes benchmarks/out/zeroshot_eval-MODEL.json.
"""

import argparse
import json
import os
import pathlib
import platform
import tempfile
import time

import jax
import numpy as np
import open_clip
import torch
import torchvision
from PIL import Image

from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD
from clip_jax.evaluation import ZeroShotEvaluator, image_folder_set, templates
from clip_jax.interop.convert import from_open_clip
from clip_jax.models import create_model
from clip_jax.runtime.mesh import create_mesh

# Input-bound: the model costs far less than decoding and resizing a ~450x340 JPEG.
TINY_224 = {"embed_dim": 64, "vision_cfg": {"image_size": 224, "layers": 1, "width": 64, "patch_size": 32},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1}}

CLASSES = ("tench", "goldfish", "great white shark", "tiger shark", "hammerhead shark", "electric ray", "stingray",
           "rooster")


def make_folder(root: pathlib.Path, num_images: int, seed: int = 0) -> None:
    """Photo-like JPEGs (a coarse random grid, upsampled, with noise) in one folder per class."""
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        folder = root / CLASSES[i % len(CLASSES)].replace(" ", "_")
        folder.mkdir(parents=True, exist_ok=True)
        width, height = int(rng.integers(400, 501)), int(rng.integers(300, 376))
        coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
        image = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.int16)
        image = np.clip(image + rng.integers(-12, 13, image.shape), 0, 255).astype(np.uint8)
        Image.fromarray(image).save(folder / f"{i:05d}.JPEG", quality=90)


def open_clip_eval(model, classifier, root, batch_size, workers, image_size, limit=None):
    """OpenCLIP's ImageNet eval loop; returns (top1, top5, images, seconds)."""
    preprocess = open_clip.image_transform(image_size, is_train=False, mean=OPENAI_MEAN, std=OPENAI_STD)
    dataset = torchvision.datasets.ImageFolder(str(root), transform=preprocess)
    if limit:
        dataset = torch.utils.data.Subset(dataset, range(limit))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, shuffle=False)
    start = time.perf_counter()
    top1 = top5 = n = 0
    with torch.inference_mode():
        for images, target in loader:
            logits = 100.0 * model(image=images)[0] @ classifier
            hits = logits.topk(5, 1, True, True)[1].t() == target.view(1, -1)
            top1 += int(hits[:1].sum())
            top5 += int(hits[:5].sum())
            n += len(images)
    return top1 / n, top5 / n, n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-B-32", help="model name, OpenCLIP model-config .json, or tiny-224")
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/out/zeroshot_eval-MODEL.json)")
    args = parser.parse_args()

    torch.manual_seed(0)
    spec = TINY_224 if args.model == "tiny-224" else args.model
    if args.model.endswith(".json"):
        with open(args.model) as f:
            spec = json.load(f)
    torch_model = (open_clip.create_model(spec) if isinstance(spec, str) else open_clip.CLIP(**spec)).eval()
    state_dict = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    image_size = torch_model.visual.image_size[0]
    batch_size = args.batch_size

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "val"
        make_folder(root, args.images)
        class_names = sorted(d.name for d in root.iterdir())

        # OpenCLIP first, while JAX has not started its thread pools: its DataLoader forks worker processes.
        start = time.perf_counter()
        with torch.inference_mode():
            torch_classifier = open_clip.build_zero_shot_classifier(
                torch_model, tokenizer=open_clip.tokenize, classnames=class_names,
                templates=list(templates("simple_imagenet")))
        torch_classifier_s = time.perf_counter() - start
        open_clip_eval(torch_model, torch_classifier, root, batch_size, args.workers, image_size, limit=batch_size)
        top1, top5, n, torch_s = open_clip_eval(torch_model, torch_classifier, root, batch_size, args.workers,
                                                image_size)

        model = create_model(spec)
        params = from_open_clip(state_dict, spec)
        mesh = create_mesh()
        num_devices = mesh.size
        if batch_size % mesh.size:
            raise SystemExit(f"--batch-size {batch_size} must be a multiple of the {mesh.size} devices")
        dataset = image_folder_set(str(root), templates=templates("simple_imagenet"))
        evaluator = ZeroShotEvaluator(model, dataset, mesh, batch_size=batch_size, num_threads=args.workers)
        start = time.perf_counter()
        classifier = evaluator.classifier(params)
        classifier_s = time.perf_counter() - start
        classifier_diff = float(np.max(np.abs(classifier - torch_classifier.numpy())))
        start = time.perf_counter()  # warm-up on one batch: JIT compilation
        ZeroShotEvaluator(model, dataset.head(batch_size), mesh, batch_size=batch_size,
                          num_threads=args.workers)(params, classifier=classifier)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        ours = evaluator(params, classifier=classifier)
        ours_s = time.perf_counter() - start

    agree = (ours["top1"], ours["top5"]) == (top1, top5)
    rows = [("OpenCLIP (DataLoader + torch)", n / torch_s, torch_s, torch_classifier_s),
            ("clip_jax (grain threads + jit)", n / ours_s, ours_s, classifier_s)]
    print(f"{args.model}, {n} JPEGs ~450x340, batch {batch_size}, {args.workers} workers, fp32, "
          f"{num_devices} {jax.devices()[0].platform} device(s), {os.cpu_count()} CPUs")
    print(f"{'loop':<32} {'images/s':>9} {'seconds':>8} {'classifier s':>13}")
    for name, rate, seconds, cls_s in rows:
        print(f"{name:<32} {rate:>9.1f} {seconds:>8.2f} {cls_s:>13.2f}")
    print(f"clip_jax / OpenCLIP images/s: {rows[1][1] / rows[0][1]:.2f}x; JIT warm-up on one batch {warmup_s:.1f} s; "
          f"classifier max |diff| {classifier_diff:.1e}; top-1/top-5 agree: {agree} "
          f"({100 * top1:.1f}% / {100 * top5:.1f}%)")

    name = pathlib.Path(args.model).stem
    out = pathlib.Path(args.out or pathlib.Path(__file__).parent / "out" / f"zeroshot_eval-{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": args.model, "images": n, "batch_size": batch_size, "workers": args.workers,
        "devices": num_devices, "platform": jax.devices()[0].platform, "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "open_clip": {"images_per_s": n / torch_s, "seconds": torch_s, "classifier_seconds": torch_classifier_s,
                      "top1": top1, "top5": top5},
        "clip_jax": {"images_per_s": n / ours_s, "seconds": ours_s, "classifier_seconds": classifier_s,
                     "warmup_seconds": warmup_s, "top1": ours["top1"], "top5": ours["top5"]},
        "speedup": (n / ours_s) / (n / torch_s), "classifier_max_abs_diff": classifier_diff, "metrics_agree": agree,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
