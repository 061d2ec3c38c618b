"""Zero-shot classification sets: a random-access source of labelled images, class names and prompts.

Kinds (`open_classification_set`):
- `imagenet-val`: an image folder `root/class_name/image.jpg`, classes in sorted folder order (OpenCLIP's
  `--imagenet-val`). Folders named by the 1000 ImageNet wnids get the curated ImageNet class names; other folders
  are named by their folder names unless class names are given.
- `imagenet-v2`: ImageNet-V2's folder `root/0/` ... `root/999/` (classes in numeric order, ImageNet's names); an
  `imagenet-val` folder named by numbers is read the same way.
- `tfds`: a prepared TFDS dataset in ArrayRecord format, read without TensorFlow; class names from its label feature
  (ImageNet wnids again become the curated names).
- `demo`: the Fashion-MNIST test split (10,000 images) with its own class names and prompts.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from clip_jax.data import fashion_mnist
from clip_jax.errors import InvalidInput
from clip_jax.evaluation import prompts as prompts_lib
from clip_jax.evaluation.sources import ArraySource, ImageFolderSource, TfdsSource

KINDS = ("imagenet-val", "imagenet-v2", "tfds", "demo")


@dataclasses.dataclass(frozen=True)
class ClassificationSet:
    """`source[i]` is `{"image": encoded bytes or uint8 [H, W] / [H, W, 3], "label": int}`; label i is
    `class_names[i]`, whose prompts are `prompts[i]`."""

    name: str
    source: Any
    class_names: tuple[str, ...]
    prompts: tuple[tuple[str, ...], ...]  # [C][T]

    def __post_init__(self):
        if len(self.prompts) != len(self.class_names):
            raise InvalidInput(f"{self.name}: {len(self.prompts)} prompt lists for {len(self.class_names)} classes")

    def __len__(self) -> int:
        return len(self.source)

    def head(self, n: int) -> "ClassificationSet":
        """The first `n` images only."""
        return dataclasses.replace(self, source=_Head(self.source, n)) if n < len(self) else self


class _Head:
    def __init__(self, source, n: int):
        self.source, self.n = source, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.source[index]


def _class_names(found: Sequence[str], given: Sequence[str] | None, where: str) -> tuple[str, ...]:
    if given is None:
        return prompts_lib.readable_class_names(found)
    if len(given) != len(found):
        raise InvalidInput(f"{len(given)} class names were given for the {len(found)} classes of {where}; give one "
                           "name per class, in label order")
    return tuple(given)


def image_folder_set(root: str, *, class_names: Sequence[str] | None = None,
                     templates: Sequence[str] | None = None, name: str = "imagenet-val",
                     numbered: bool = False) -> ClassificationSet:
    """`numbered`: the folder must have ImageNet-V2's numbered class folders."""
    source = ImageFolderSource(root)  # raises FileNotFoundError for a missing or empty folder
    if numbered and not source.numbered:
        raise InvalidInput(f"{root!r} is not in ImageNet-V2's layout: its class folders must be named 0 ... N-1 "
                           f"(found e.g. {source.class_names[0]!r}); use --imagenet-val for named class folders")
    names = _class_names(source.class_names, class_names, f"image folder {root} (one per class folder)")
    templates = prompts_lib.templates("openai_imagenet") if templates is None else templates
    return ClassificationSet(name, source, names, prompts_lib.class_prompts(names, templates))


def tfds_set(dataset: str, *, split: str = "test", data_dir: str | None = None,
             class_names: Sequence[str] | None = None, templates: Sequence[str] | None = None,
             image_key: str = "image", label_key: str = "label") -> ClassificationSet:
    try:
        source = TfdsSource(dataset, split, data_dir, image_key=image_key, label_key=label_key)
    except (KeyError, AttributeError) as e:
        if class_names is not None:
            raise
        raise InvalidInput(f"TFDS dataset {dataset!r} has no class names in its label feature {label_key!r} "
                           f"({type(e).__name__}: {e}); give them with --class-names") from e
    names = _class_names(source.class_names, class_names, f"TFDS dataset {dataset!r}")
    templates = prompts_lib.templates("openai_imagenet") if templates is None else templates
    return ClassificationSet(f"{dataset}:{split}", source, names, prompts_lib.class_prompts(names, templates))


def demo_set(split: str = "test", root: str = fashion_mnist.DEFAULT_DIR) -> ClassificationSet:
    """Fashion-MNIST with its zero-shot prompts (the test split: 10,000 images)."""
    images, labels = fashion_mnist.load(split, root)
    names = tuple(fashion_mnist.CLASS_NAMES)
    prompts = tuple(tuple(fashion_mnist.zeroshot_prompts(c)) for c in names)
    return ClassificationSet(f"fashion-mnist:{split}", ArraySource(images, labels), names, prompts)


def open_classification_set(kind: str, location: str | None = None, **options) -> ClassificationSet:
    """`kind` is one of `KINDS`; `location` is the folder (imagenet-val), the dataset name (tfds), or the
    Fashion-MNIST folder (demo, optional). `options` go to `image_folder_set`, `tfds_set` or `demo_set`."""
    if kind not in KINDS:
        raise InvalidInput(f"unknown zero-shot dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "demo":
        return demo_set(**options) if location is None else demo_set(root=location, **options)
    if not location:
        what = "a TFDS dataset name" if kind == "tfds" else "an image folder"
        raise InvalidInput(f"zero-shot dataset {kind!r} needs {what}")
    if kind == "imagenet-v2":
        return image_folder_set(location, name="imagenet-v2", numbered=True, **options)
    return image_folder_set(location, **options) if kind == "imagenet-val" else tfds_set(location, **options)
