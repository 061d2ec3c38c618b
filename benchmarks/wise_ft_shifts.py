"""Which shift of Fashion-MNIST the WiSE-FT demo scores robustness on: the demo's zero-shot accuracy under each
candidate.

    python -m clip_jax.train --config configs/demo.py                                  # logs/demo
    python -m clip_jax.benchmark fashion-mnist data/clip_benchmark/fashion-mnist        # the demo's data
    python benchmarks/wise_ft_shifts.py [--run logs/demo] [--images 2000]

Scores the demo run's zero-shot classifier (the dataset's 4 templates x 10 class names, as `configs/demo_finetune.py`
starts from) on the first `--images` test images, as they are and under each candidate shift of
`CANDIDATES` (each a function of one uint8 28 x 28 image, applied before the model's own preprocessing). A shift is
of use to the demo when the zero-shot model keeps a useful part of its accuracy there (at least 30% top-1; chance
is 10%): a model at chance has no robustness for fine-tuning to lose or WiSE-FT to keep. Writes
benchmarks/out/wise_ft_shifts.json.
"""

import argparse
import json
import os
import pathlib
import platform
import time

import numpy as np
from PIL import Image, ImageFilter

from clip_jax.evaluation import clip_benchmark, shifts
from clip_jax.evaluation.classification import ZeroShotEvaluator
from clip_jax.evaluation.encoder import replicate
from clip_jax.interop.opener import open_model
from clip_jax.models import create_model
from clip_jax.models.variables import eval_variables
from clip_jax.runtime import xla_gpu
from clip_jax.runtime.mesh import create_mesh

HERE = pathlib.Path(__file__).resolve().parent


def _pil(transform):
    """A PIL image operation as a function of a uint8 array."""
    return lambda image: np.asarray(transform(Image.fromarray(image)))


def _low_resolution(size: int):
    return _pil(lambda img: img.resize((size, size), Image.Resampling.BILINEAR).resize(img.size,
                                                                                        Image.Resampling.BILINEAR))


def _noise(sigma: float):
    def add(image):
        rng = np.random.default_rng(int(image.sum()))  # the same noise for the same image, run to run
        return np.clip(image + rng.normal(0, sigma, image.shape), 0, 255).astype(np.uint8)
    return add


def _contrast(factor: float):
    return lambda image: np.clip(image.mean() + factor * (image - image.mean()), 0, 255).astype(np.uint8)


def _zoom(crop: int):
    def zoom(image):
        start = (image.shape[0] - crop) // 2
        part = Image.fromarray(image[start:start + crop, start:start + crop])
        return np.asarray(part.resize(image.shape[::-1], Image.Resampling.BICUBIC))
    return zoom


CANDIDATES = {
    "none": lambda image: image,
    "inverted (255 - x)": lambda image: 255 - image,
    "mirrored left-right": lambda image: image[:, ::-1],
    "upside down": lambda image: image[::-1],
    "rotated 90 degrees": lambda image: np.ascontiguousarray(np.rot90(image)),
    "rotated 20 degrees": _pil(lambda img: img.rotate(20, Image.Resampling.BILINEAR)),
    "Gaussian blur, radius 1": _pil(lambda img: img.filter(ImageFilter.GaussianBlur(1))),
    "Gaussian blur, radius 2": _pil(lambda img: img.filter(ImageFilter.GaussianBlur(2))),
    "Gaussian noise, sigma 40": _noise(40),
    "Gaussian noise, sigma 80": _noise(80),
    "contrast x 0.3": _contrast(0.3),
    "low resolution (7 px, scaled back)": _low_resolution(7),
    "low resolution (10 px, scaled back)": _low_resolution(10),
    "zoomed in (centre 18 px)": _zoom(18),
    "shifted 6 px right": lambda image: np.pad(image, ((0, 0), (6, 0)))[:, :image.shape[1]],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=str(HERE.parent / "logs" / "demo"))
    parser.add_argument("--data", default=str(HERE.parent / "data" / "clip_benchmark" / "fashion-mnist"))
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--only", nargs="+", help="these candidates only")
    args = parser.parse_args()
    xla_gpu.quiet_cuda_plugin()  # no CUDA start-up traceback on a machine without a GPU

    opened = open_model(args.run)
    mean, std = opened.normalization()
    model = create_model(opened.config, dtype="float32")
    mesh = create_mesh()
    params = replicate(eval_variables(**opened.variables()), mesh)
    test = clip_benchmark.open_training_set(args.data, "test").head(args.images)
    classifier = None
    rows = []
    for name, transform in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        evaluator = ZeroShotEvaluator(model, shifts.shifted(test, name, transform), mesh, batch_size=250, mean=mean,
                                      std=std)
        classifier = evaluator.classifier(params) if classifier is None else classifier
        start = time.perf_counter()
        metrics = evaluator(params, classifier=classifier)
        rows.append({"shift": name, "top1": metrics["top1"], "top5": metrics["top5"],
                     "seconds": time.perf_counter() - start})
        print(f"{name:38s} top-1 {100 * metrics['top1']:6.2f}%  top-5 {100 * metrics['top5']:6.2f}%", flush=True)
    out = HERE / "out" / "wise_ft_shifts.json"
    os.makedirs(out.parent, exist_ok=True)
    record = {"run": os.path.relpath(args.run, HERE.parent), "images": len(test),
              "machine": platform.processor() or platform.machine(), "rows": rows}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
