"""Encode images and captions and print how they match: `python -m clip_jax.similarity`.

    python -m clip_jax.similarity --checkpoint exported/ --images photo.jpg photos/ --labels "a dog,a cat,a bird"

`--checkpoint` takes any model the other commands take (a run, one of its checkpoints, an exported or transformers
folder, a weights file with `--model`: `clip_jax.interop.opener`), as the model it holds, with the mean and std it
was trained with and OpenCLIP's eval transform at its image size. `--images` names image files and folders,
`--labels` the texts to match them with ("a,b,c"; or `--captions FILE`, one a line or a .csv's first column). For
each image the table gives the `--top` texts and their probabilities: a softmax over the texts (a CLIP model, as
OpenCLIP's example computes them), or each text's sigmoid (a SigLIP model, which has a logit_bias). `--json FILE`
also writes every probability. An image that does not decode is named and skipped.

Without `--images`: one Fashion-MNIST test image per class (the bundled demo data) against the prompt "a photo of a
{class}." for each class, as a table of every class. Without `--checkpoint`: a freshly initialised `--model`
(ViT-B-32 by default), which shows the whole path (data -> eval transform -> tokenizer -> both towers) but matches
at chance.
"""

import argparse
import functools
import json
import sys

import jax
import numpy as np

from clip_jax.data import fashion_mnist
from clip_jax.data.classification import eval_image
from clip_jax.data.transforms import normalize
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import similarity_inputs as inputs
from clip_jax.interop.inference import eval_transform
from clip_jax.interop.opener import add_budget_argument, open_model
from clip_jax.models import create_model, init_variables
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD
from clip_jax.runtime import entry, ownership
from clip_jax.text.model_tokenizer import tokenizer_for

DEFAULT_MODEL = "ViT-B-32"  # without --checkpoint or --model


def one_image_per_class(images: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The first image of each class, in class order: uint8 [C, 28, 28], labels [C]."""
    first = [int(np.flatnonzero(labels == c)[0]) for c in range(num_classes)]
    return images[first], labels[first]


def preprocess(grey: np.ndarray, size: int, mean, std, resize_mode="shortest") -> np.ndarray:
    """uint8 [N, h, w] greyscale -> float32 [N, size, size, 3] (NaFlex rows under a `NaFlexResize`), the eval
    transform and the model's normalisation."""
    crops = np.stack([eval_image(x, size, resize_mode) for x in grey])
    return normalize(crops, mean, std)


def _resized(image, *, size: int, mean, std, resize_mode) -> np.ndarray:
    """The eval transform of a model whose images are not center-cropped (a SigLIP folder's squash, a NaFlex model's
    rows), normalised."""
    return normalize(eval_image(image, size, resize_mode), mean, std)


def format_table(probs: np.ndarray, row_names, column_names) -> str:
    """Probabilities [rows, columns] as a fixed-width table; the best column of each row is starred."""
    width = max(len(c) for c in column_names)
    lines = [" " * 12 + " ".join(f"{c[:width]:>{width}}" for c in column_names)]
    for name, row in zip(row_names, probs):
        best = int(np.argmax(row))
        cells = [f"{p:{width - 1}.2f}" + ("*" if j == best else " ") for j, p in enumerate(row)]
        lines.append(f"{name[:11]:<12}" + " ".join(cells))
    return "\n".join(lines)


def format_top(probs: np.ndarray, image_names, texts, top: int) -> str:
    """For each image (a row), its `top` texts with their probabilities, best first."""
    ranks = np.argsort(-probs, axis=-1, kind="stable")[:, :top]  # [images, top]
    rows = [["image"] + [f"{ordinal(k + 1)} text" for k in range(ranks.shape[1])]]
    rows += [[name] + [f"{texts[j]}  {p[j]:.3f}" for j in r] for name, p, r in zip(image_names, probs, ranks)]
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def match(model, variables, image_batches, tokens) -> tuple[list[str], np.ndarray, str]:
    """(image names, probabilities [images, texts], how they were made) of `image_batches` ((names, float32
    [n, S, S, 3]) each) against `tokens` [texts, L]. Batches smaller than the first are padded to its size: one
    compile of the image tower."""
    text_features = jax.jit(functools.partial(model.apply, method="encode_text"))(variables, tokens)  # [T, E]
    encode_image = jax.jit(functools.partial(model.apply, method="encode_image"))
    params = variables["params"]
    scale, bias = np.exp(np.float32(params["logit_scale"])), params.get("logit_bias")
    names, rows, size = [], [], None
    for batch_names, images in image_batches:
        n, size = len(images), size or len(images)
        if n < size:
            images = np.concatenate([images, np.zeros((size - n, *images.shape[1:]), images.dtype)])
        logits = scale * np.asarray(encode_image(variables, images))[:n] @ np.asarray(text_features).T
        names += batch_names
        if bias is None:
            rows.append(np.asarray(jax.nn.softmax(logits, axis=-1)))
        else:
            rows.append(np.asarray(jax.nn.sigmoid(logits + np.float32(bias))))
    kind = "softmax over the texts" if bias is None else "sigmoid of each text (a SigLIP model)"
    return names, np.concatenate(rows) if rows else np.zeros((0, len(tokens)), np.float32), kind


def texts_of(args) -> list[str] | None:
    """The texts `--labels` or `--captions` give; None for the demo's prompts."""
    if args.labels is not None and args.captions is not None:
        raise InvalidInput("give --labels or --captions, not both")
    texts = (inputs.parse_labels(args.labels) if args.labels is not None
             else inputs.read_captions(args.captions) if args.captions is not None else None)
    if (texts is None) != (args.images is None):
        raise InvalidInput("--images needs the texts to match them with (--labels 'a,b,c' or --captions FILE)"
                           if texts is None else "--labels and --captions are matched with --images FILE_OR_FOLDER")
    if args.top < 1:
        raise InvalidInput(f"--top {args.top}: give 1 or more")
    return texts


def open_checkpoint(args):
    """(model, OpenedModel or None, mean, std): `--checkpoint` as the model it holds (or `--model`), else a fresh
    `--model`."""
    if not args.checkpoint:
        if args.max_num_patches is not None:
            raise InvalidInput(f"--max_num_patches {args.max_num_patches} is a NaFlex model's patch budget: give the "
                               "model as --checkpoint (a freshly initialised model reads fixed-size images)")
        model = create_model(args.model or DEFAULT_MODEL)
        return model, None, tuple(args.mean or OPENAI_MEAN), tuple(args.std or OPENAI_STD)
    opened = open_model(args.checkpoint, args.model, what="--checkpoint", max_num_patches=args.max_num_patches)
    return create_model(opened.config), opened, *opened.normalization(args.mean, args.std)


def demo_images(args, size: int, mean, std, resize_mode="shortest"):
    """(class names, one image batch of the first test image of each class, the class of each, the prompts)."""
    classes = fashion_mnist.CLASS_NAMES
    grey, labels = one_image_per_class(*fashion_mnist.load("test", args.data_dir), len(classes))
    names = [classes[int(y)] for y in labels]
    prompts = [f"a photo of {fashion_mnist.with_article(c)}." for c in classes]
    return [(names, preprocess(grey, size, mean, std, resize_mode))], labels, prompts


def run(args) -> dict:
    model, opened, mean, std = open_checkpoint(args)
    tokenize = tokenizer_for(model.config)  # checked before any image is read
    texts, size = texts_of(args), model.config.vision.image_size
    resize_mode = "shortest" if opened is None else opened.resize_mode  # a SigLIP folder's squash, NaFlex's rows
    if texts is None:
        image_batches, labels, texts = demo_images(args, size, mean, std, resize_mode)
    else:
        paths, skipped = inputs.image_paths(args.images), []
        transform = (functools.partial(eval_transform, size=size, mean=mean, std=std) if resize_mode == "shortest"
                     else functools.partial(_resized, size=size, mean=mean, std=std, resize_mode=resize_mode))
        image_batches = inputs.batches(inputs.read_images(paths, transform, skipped), args.batch_size)
    if opened is not None:
        variables = opened.variables()  # params, and a ResNet image tower's BatchNorm statistics (eval mode)
    else:
        variables = init_variables(model, jax.random.key(args.seed))
        print(f"{model.config.name}: freshly initialised (seed {args.seed}); expect chance-level matches")
    names, probs, kind = match(model, variables, image_batches, tokenize(texts))
    report = {"model": model.config.name, "checkpoint": args.checkpoint, "probabilities": kind, "texts": texts,
              "images": [{"image": n, "probabilities": p.tolist()} for n, p in zip(names, probs)]}
    if args.images is None:
        print(format_table(probs, names, fashion_mnist.CLASS_NAMES))
        correct = int(np.sum(np.argmax(probs, -1) == labels))
        print(f"{correct}/{len(labels)} images matched their own class's prompt (chance: 1/{len(labels)})")
        return report
    for s in skipped:
        print(f"skipped {s.path}: {s.reason}", file=sys.stderr)
    if not names:
        raise MissingInput(f"no image of --images decodes ({plural(len(paths), 'image')} tried): see the lines above")
    budget = f" (at {opened.max_num_patches} patches)" if opened is not None and opened.naflex else ""
    print(f"{plural(len(names), 'image')}{budget} x {plural(len(texts), 'text')}, {kind}:")
    print(format_top(probs, names, texts, args.top))
    report["skipped"] = [{"image": s.path, "reason": s.reason} for s in skipped]
    return report


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.similarity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", metavar="PATH", help="the model: a run directory, one of its checkpoints, an "
                        "exported or transformers folder, or a weights file (with --model)")
    parser.add_argument("--model", help="model name or OpenCLIP model-config .json: the model to read --checkpoint "
                        f"as (default: the one it holds), or to initialise without it (default {DEFAULT_MODEL})")
    add_budget_argument(parser)
    parser.add_argument("--images", nargs="+", metavar="PATH", help="image files and/or folders of them (default: "
                        "the Fashion-MNIST demo)")
    parser.add_argument("--labels", help="the texts to match the images with, comma-separated: \"a dog,a cat\"")
    parser.add_argument("--captions", metavar="FILE", help="the texts to match, one a line (a .csv or .tsv: its first "
                        "column, or the one its header names caption, title or text)")
    parser.add_argument("--top", type=int, default=3, help="the best texts shown for each image (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write every probability to this JSON file")
    parser.add_argument("--batch-size", type=int, default=32, help="images encoded at a time")
    parser.add_argument("--data-dir", default=fashion_mnist.DEFAULT_DIR, help="folder of the Fashion-MNIST .gz files")
    parser.add_argument("--mean", type=float, nargs=3, help="image mean (default: the model's own, else OpenAI's)")
    parser.add_argument("--std", type=float, nargs=3, help="image std (default: the model's own, else OpenAI's)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed when no checkpoint is given")
    return parser.parse_args(argv)


@entry.command(stopped="before the probabilities were written")
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.json:  # before the work, not after it
        ownership.claim_file(args.json, writing="the probabilities", change="give another --json")
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
