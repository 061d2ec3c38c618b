"""An image optimised towards a prompt by CLIP guidance alone: `python -m clip_jax.guide`.

    python -m clip_jax.guide --checkpoint logs/demo --prompt "a photo of a sneaker." --output sneaker.png

`--checkpoint` takes any model the other commands take. The image (`--size`, default twice the model's image size;
from noise, or from `--init IMAGE`) is held as logits whose sigmoid are the pixels and moved by Adam (`--lr`) along
the gradient of its similarity to the prompt: the cosine of the image and text embeddings, averaged over
`--cutouts` random crops (`clip_jax.interop.guidance`). Each step's similarity is printed; the final image is
written to `--output`, and a strip of `--frames` images from the first step to the last beside it
(`FILE.strip.png`), each labelled with its step in a band below it. The last line gives the final image's similarity under the plain eval transform (no cutouts).
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import guidance
from clip_jax.runtime import entry


LABEL_BAND = 16  # pixels below the frames that hold their step labels


def strip_path(output: str) -> str:
    root, ext = os.path.splitext(output)
    return f"{root}.strip{ext or '.png'}"


def step_labels(steps, width: int, font) -> list[str]:
    """"step N" under each frame, or "N" where that does not fit the frame's `width`."""
    return [f"step {s}" if font.getlength(f"step {s}") <= width - 2 else str(s) for s in steps]


def strip_image(frames: list[np.ndarray], steps: list[int]) -> Image.Image:
    """The frames side by side (uint8 [S, S, 3] each, left as they are), each step's label centred below it."""
    size = frames[0].shape[1]
    strip = Image.new("RGB", (size * len(frames), frames[0].shape[0] + LABEL_BAND), "white")
    strip.paste(Image.fromarray(np.concatenate(frames, axis=1)), (0, 0))
    draw, font = ImageDraw.Draw(strip), ImageFont.load_default()
    for number, label in enumerate(step_labels(steps, size, font)):
        draw.text((number * size + size / 2, frames[0].shape[0] + LABEL_BAND / 2), label, fill="black", font=font,
                  anchor="mm")
    return strip


def initial_logits(args, size: int, key) -> jnp.ndarray:
    """The image's logits: `--init`'s pixels resized to the canvas, else small noise around grey."""
    if args.init is None:
        return 0.5 * jax.random.normal(key, (size, size, 3))
    if not os.path.isfile(args.init):
        raise MissingInput(f"--init {args.init} does not exist: give an image file, or leave --init out for noise")
    try:
        image = Image.open(args.init).convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    except OSError as e:
        raise InvalidInput(f"--init {args.init} is not an image that decodes ({e})") from None
    pixels = np.clip(np.asarray(image, np.float32) / 255, 1e-3, 1 - 1e-3)
    return jnp.asarray(np.log(pixels / (1 - pixels)))


def to_uint8(pixels) -> np.ndarray:
    return np.asarray(jnp.clip(jnp.round(pixels * 255), 0, 255)).astype(np.uint8)


def run(args) -> dict:
    import optax

    from clip_jax.interop.opener import open_model
    from clip_jax.text.model_tokenizer import tokenizer_for
    from clip_jax.models import create_model

    for name, least in (("steps", 1), ("frames", 1), ("cutouts", 0), ("size", 0)):
        if getattr(args, name) < least:
            raise InvalidInput(f"--{name} {getattr(args, name)}: give {least} or more")
    if not args.prompt.strip():
        raise InvalidInput("--prompt is empty: give the text the image should match")
    opened = open_model(args.checkpoint, args.model, what="--checkpoint")
    if opened.naflex:
        raise InvalidInput(f"--checkpoint {args.checkpoint}: {opened.config.name} is a NaFlex model; guide optimises "
                           "a square image at one size, which a NaFlex tower does not read: give a fixed-resolution "
                           "model")
    model = create_model(opened.config)
    mean, std = opened.normalization()
    model_size = model.config.vision.image_size
    size = args.size or 2 * model_size
    if size < model_size:
        raise InvalidInput(f"--size {size} is below the model's image size {model_size}")
    variables = opened.variables()
    tokens = tokenizer_for(model.config)([args.prompt])
    text = model.apply(variables, tokens, method="encode_text")[0]
    step_fn = guidance.guidance(model, variables, text, size=model_size, mean=mean, std=std,
                                num_cutouts=args.cutouts, min_fraction=args.min_fraction)
    init_key, key = jax.random.split(jax.random.key(args.seed))
    logits = initial_logits(args, size, init_key)
    optimizer = optax.adam(args.lr)
    state = optimizer.init(logits)

    @jax.jit
    def step(logits, state, key):
        similarity, grad = step_fn(jax.nn.sigmoid(logits), key)
        grad_logits = jax.grad(lambda z: jnp.vdot(jax.nn.sigmoid(z), grad))(logits)  # chain rule through sigmoid
        updates, state = optimizer.update(-grad_logits, state, logits)  # ascent on the similarity
        return optax.apply_updates(logits, updates), state, similarity

    keep = sorted({int(round(k)) for k in np.linspace(0, args.steps, args.frames)})
    frames, curve = [], []
    for number in range(args.steps + 1):
        if number in keep:
            frames.append(to_uint8(jax.nn.sigmoid(logits)))
        if number == args.steps:
            break
        key, step_key = jax.random.split(key)
        logits, state, similarity = step(logits, state, step_key)
        curve.append(float(similarity))
        print(f"step {number + 1}/{args.steps} similarity {curve[-1]:.4f}", flush=True)
    final = to_uint8(jax.nn.sigmoid(logits))
    plain = jax.jit(guidance.similarity(model, variables, text, size=model_size, mean=mean, std=std))(
        final / 255.0, jax.random.key(0))
    return {"image": final, "frames": frames, "frame_steps": keep, "similarity": curve,
            "final_similarity": float(plain)}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m clip_jax.guide", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, metavar="PATH", help="the model: a run directory, one of its "
                        "checkpoints, an exported or transformers folder, or a weights file (with --model)")
    parser.add_argument("--model", help="model name or OpenCLIP model-config .json to read --checkpoint as")
    parser.add_argument("--prompt", required=True, help="the text the image is moved towards")
    parser.add_argument("--output", required=True, metavar="FILE.png", help="the final image (and FILE.strip.png)")
    parser.add_argument("--init", metavar="IMAGE", help="start from this image (default: noise)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05, help="Adam's step size on the pixels' logits")
    parser.add_argument("--size", type=int, default=0, help="the image's side (default: twice the model's)")
    parser.add_argument("--cutouts", type=int, default=16, help="random crops per step (0: the whole image)")
    parser.add_argument("--min-fraction", type=float, default=0.5, help="smallest cutout, of the image's side")
    parser.add_argument("--frames", type=int, default=8, help="images in the progress strip")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@entry.command(stopped="before the image was written")
def main(argv=None) -> int:
    from clip_jax.runtime import ownership

    args = parse_args(argv)
    for path in (args.output, strip_path(args.output)):  # before the work
        ownership.claim_file(path, writing="the guided image", change="give another --output")
    result = run(args)
    Image.fromarray(result["image"]).save(args.output)
    strip_image(result["frames"], result["frame_steps"]).save(strip_path(args.output))
    print(f"wrote {args.output} and {strip_path(args.output)}; similarity under the eval transform "
          f"{result['final_similarity']:.4f}")
    return 0
