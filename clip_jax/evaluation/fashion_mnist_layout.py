"""The bundled Fashion-MNIST as a classification dataset in CLIP_benchmark's webdataset layout (`clip_benchmark`):
the fine-tuning demo's data, written once on first use.

    FOLDER/classnames.txt                           the ten class names, in label order
    FOLDER/zeroshot_classification_templates.txt    the demo's zero-shot templates, `{c}` for the class name
    FOLDER/train/, FOLDER/test/                     PNG images (28 x 28 greyscale) with their .cls, 5,000 a shard

Several processes asking at once get one set (`data.write_once`); a folder holding files clip_jax did not write is
refused, never replaced.
"""

import io
import os
import tarfile

import numpy as np
from PIL import Image

from clip_jax.data import fashion_mnist, write_once
from clip_jax.evaluation.clip_benchmark import CLASS_NAMES_FILE, NSHARDS_FILE, TEMPLATES_FILE

PER_SHARD = 5000
TEMPLATES = ("a photo of a {c}.", "a black and white photo of a {c}.", "a low resolution photo of a {c}.",
             "a product photo of a {c}.")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def _png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="png")
    return out.getvalue()


def _write_split(folder: str, split: str, root: str) -> None:
    images, labels = fashion_mnist.load(split, root)
    os.makedirs(os.path.join(folder, split))
    starts = range(0, len(labels), PER_SHARD)
    for shard, start in enumerate(starts):
        with tarfile.open(os.path.join(folder, split, f"{shard}.tar"), "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(start + PER_SHARD, len(labels))):
                _add(tar, f"s{i:06d}.png", _png(images[i]))
                _add(tar, f"s{i:06d}.cls", str(int(labels[i])).encode())
    with open(os.path.join(folder, split, NSHARDS_FILE), "w") as f:
        f.write(f"{len(starts)}\n")


def write_fashion_mnist(folder: str, *, root: str = fashion_mnist.DEFAULT_DIR,
                        change: str = "choose a new or empty folder") -> str:
    """Writes Fashion-MNIST's train and test splits into `folder` in CLIP_benchmark's layout unless it holds them
    already; returns `folder`."""

    def write(staging: str) -> None:
        print(f"writing Fashion-MNIST in CLIP_benchmark's layout into {folder} (once)", flush=True)
        for split in ("train", "test"):
            _write_split(staging, split, root)
        with open(os.path.join(staging, CLASS_NAMES_FILE), "w") as f:
            f.write("\n".join(fashion_mnist.CLASS_NAMES) + "\n")
        with open(os.path.join(staging, TEMPLATES_FILE), "w") as f:  # last: it marks the set complete
            f.write("\n".join(TEMPLATES) + "\n")

    write_once.write_once(folder, is_complete=lambda: os.path.exists(os.path.join(folder, TEMPLATES_FILE)),
                          write=write, marker_suffix=TEMPLATES_FILE, what="Fashion-MNIST in CLIP_benchmark's layout",
                          change=change)
    return folder
