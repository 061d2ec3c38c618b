"""Encode images and captions and print how they match: `python -m clip_jax.similarity`.

By default: one Fashion-MNIST test image per class (the bundled demo data) against the prompt "a photo of a {class}."
for each class, with a freshly initialised model, which shows the whole path (data -> eval transform -> tokenizer ->
both towers) but matches at chance. Give `--checkpoint` (any model path: clip_jax params or variables, an OpenCLIP
checkpoint converted on the fly, an exported folder, a run) to see a trained model's zero-shot guesses.
"""

import argparse
import sys

import jax
import numpy as np
from PIL import Image

from clip_jax.data import fashion_mnist
from clip_jax.data.transforms import OPENAI_MEAN, OPENAI_STD, eval_crop, normalize
from clip_jax.errors import UserError
from clip_jax.interop.opener import open_model
from clip_jax.models import create_model, init_variables
from clip_jax.runtime import xla_gpu
from clip_jax.tokenizer import tokenize


def one_image_per_class(images: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The first image of each class, in class order: uint8 [C, 28, 28], labels [C]."""
    first = [int(np.flatnonzero(labels == c)[0]) for c in range(num_classes)]
    return images[first], labels[first]


def preprocess(grey: np.ndarray, size: int, mean, std) -> np.ndarray:
    """uint8 [N, h, w] greyscale -> float32 [N, size, size, 3], the eval transform and the model's normalisation."""
    crops = np.stack([eval_crop(Image.fromarray(x).convert("RGB"), size) for x in grey])
    return normalize(crops, mean, std)


def format_table(probs: np.ndarray, row_names, column_names) -> str:
    """Probabilities [rows, columns] as a fixed-width table; the best column of each row is starred."""
    width = max(len(c) for c in column_names)
    lines = [" " * 12 + " ".join(f"{c[:width]:>{width}}" for c in column_names)]
    for name, row in zip(row_names, probs):
        best = int(np.argmax(row))
        cells = [f"{p:{width - 1}.2f}" + ("*" if j == best else " ") for j, p in enumerate(row)]
        lines.append(f"{name[:11]:<12}" + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clip_jax.similarity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-B-32", help="model name or OpenCLIP model-config .json")
    parser.add_argument("--checkpoint", help="clip_jax params .npz, an OpenCLIP .pt/.bin/.safetensors/.npz, an "
                        "exported folder or a run (read as --model)")
    parser.add_argument("--data-dir", default=fashion_mnist.DEFAULT_DIR, help="folder of the Fashion-MNIST .gz files")
    parser.add_argument("--mean", type=float, nargs=3, default=OPENAI_MEAN, help="image mean (LAION L/14: 0.5 0.5 0.5)")
    parser.add_argument("--std", type=float, nargs=3, default=OPENAI_STD, help="image std (LAION L/14: 0.5 0.5 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed when no checkpoint is given")
    args = parser.parse_args(argv)
    xla_gpu.quiet_cuda_plugin()  # no CUDA start-up traceback on a machine without a GPU
    try:
        model = create_model(args.model)
        grey, labels = fashion_mnist.load("test", args.data_dir)
        # params, and a ResNet image tower's BatchNorm statistics (applied in eval mode)
        variables = None
        if args.checkpoint:
            variables = open_model(args.checkpoint, args.model, what="--checkpoint").variables()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if variables is None:
        variables = init_variables(model, jax.random.key(args.seed))
        print(f"{args.model}: freshly initialised (seed {args.seed}); expect chance-level matches")

    classes = fashion_mnist.CLASS_NAMES
    grey, labels = one_image_per_class(grey, labels, len(classes))
    images = preprocess(grey, model.config.vision.image_size, args.mean, args.std)
    prompts = [f"a photo of {fashion_mnist.with_article(c)}." for c in classes]
    tokens = tokenize(prompts, context_length=model.config.text.context_length)

    image_f, text_f, scale = jax.jit(model.apply)(variables, images, tokens)
    probs = np.asarray(jax.nn.softmax(scale * image_f @ text_f.T, axis=-1))  # [images, prompts]
    print(format_table(probs, [classes[int(y)] for y in labels], classes))
    correct = int(np.sum(np.argmax(probs, -1) == labels))
    print(f"{correct}/{len(labels)} images matched their own class's prompt (chance: 1/{len(classes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
