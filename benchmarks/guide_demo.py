"""CLIP guidance on the demo model: one image per Fashion-MNIST class, moved from noise towards "a photo of a
{class}." by `python -m clip_jax.guide`'s loop, and what the demo model's zero-shot classifier then says of it.

    python benchmarks/guide_demo.py --checkpoint logs/demo [--steps 100] [--out DIR]

Writes DIR/guide-demo/CLASS.strip.png (the progress strip of each class), DIR/guide-demo/curves.png (similarity per
step, when matplotlib is installed) and DIR/guide-demo.json; prints a table: each class's similarity at the first
and last step, the final image's under the plain eval transform, and the zero-shot class of the final image (the
argmax over the ten prompts, the image through the eval transform).
"""

import argparse
import json
import os
import pathlib
import time

import jax
import numpy as np
from PIL import Image

from clip_jax.data import fashion_mnist
from clip_jax.data.transforms import eval_crop, normalize
from clip_jax.interop import guide
from clip_jax.interop.opener import open_model
from clip_jax.models import create_model
from clip_jax.text.clip_tokenizer import tokenize


def prompts() -> list[str]:
    return [f"a photo of {fashion_mnist.with_article(c)}." for c in fashion_mnist.CLASS_NAMES]


def zero_shot_class(model, variables, image: np.ndarray, text_features, mean, std) -> int:
    pixels = normalize(eval_crop(Image.fromarray(image), model.config.vision.image_size), mean, std)
    features = model.apply(variables, pixels[None], method="encode_image")
    return int(np.argmax(np.asarray(features @ text_features.T)[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="logs/demo")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cutouts", type=int, default=16)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"))
    args = parser.parse_args()
    folder = pathlib.Path(args.out) / "guide-demo"
    folder.mkdir(parents=True, exist_ok=True)
    opened = open_model(args.checkpoint, what="--checkpoint")
    model, variables = create_model(opened.config), opened.variables()
    mean, std = opened.normalization()
    texts = prompts()
    text_features = model.apply(variables, tokenize(texts, context_length=model.config.text.context_length),
                                method="encode_text")
    rows = []
    for index, (name, prompt) in enumerate(zip(fashion_mnist.CLASS_NAMES, texts)):
        run_args = argparse.Namespace(checkpoint=args.checkpoint, model=None, prompt=prompt, init=None,
                                      steps=args.steps, lr=0.05, size=0, cutouts=args.cutouts, min_fraction=0.5,
                                      frames=8, seed=index)
        start = time.perf_counter()
        result = guide.run(run_args)
        seconds = time.perf_counter() - start
        Image.fromarray(np.concatenate(result["frames"], axis=1)).save(folder / f"{name.replace(' ', '_')}.strip.png")
        predicted = zero_shot_class(model, variables, result["image"], text_features, mean, std)
        rows.append({"class": name, "prompt": prompt, "similarity": result["similarity"],
                     "final_similarity": result["final_similarity"],
                     "zero_shot": fashion_mnist.CLASS_NAMES[predicted], "seconds": seconds})
    lines = [f"{'class':<13}{'step 1':>8}{'step ' + str(args.steps):>10}{'eval transform':>16}  zero-shot class",
             *(f"{r['class']:<13}{r['similarity'][0]:>8.3f}{r['similarity'][-1]:>10.3f}{r['final_similarity']:>16.3f}"
               f"  {r['zero_shot']}" for r in rows)]
    hits = sum(r["zero_shot"] == r["class"] for r in rows)
    lines.append(f"{hits}/{len(rows)} final images are classified as their prompt's class")
    print("\n".join(lines))
    (pathlib.Path(args.out) / "guide-demo.json").write_text(json.dumps(
        {"checkpoint": os.path.abspath(args.checkpoint), "steps": args.steps, "cutouts": args.cutouts,
         "jax": jax.__version__, "rows": rows}, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axes = plt.subplots(figsize=(7, 4))
    for r in rows:
        axes.plot(range(1, len(r["similarity"]) + 1), r["similarity"], label=r["class"])
    axes.set_xlabel("step")
    axes.set_ylabel("similarity (mean over cutouts)")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(folder / "curves.png", dpi=100)


if __name__ == "__main__":
    main()
