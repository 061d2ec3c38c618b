"""CLIP_benchmark's webdataset layout: one folder per dataset, read as a classification or retrieval set.

    DATASET/
        classnames.txt                          one class name per line, in label order (classification, multilabel)
        zeroshot_classification_templates.txt   one prompt template per line, the class name written `{c}`
        dataset_type.txt                        classification (when absent), retrieval or multilabel
        test/nshards.txt                        the number of shards N of split `test`
        test/0.tar ... test/{N-1}.tar           samples: an image (.webp, .png, .jpg or .jpeg, preferred in that
                                                order) with a label: .cls (an integer, classification), .npy (a
                                                multi-hot vector over the classes, multilabel) or .txt (captions,
                                                one per line, retrieval)

A collection is a folder holding such dataset folders (at any depth up to three), e.g. the VTAB+ list laid out as
`ROOT/vtab/cifar10`, ...; a dataset is named `wds/` + its path under the root (`wds/vtab/cifar10`), as
CLIP_benchmark names its webdataset sets (a leading `wds_` of a folder name is dropped). `find_named` instead looks
up given names, also in flat folders named like LAION's Hugging Face repositories (`ROOT/wds_vtab-cifar10`), and
keeps the names exactly. Every file is checked when the dataset is opened: a missing or malformed
one raises `MissingInput` / `InvalidInput` naming it (a shard's sample is named `shard.tar:key`).

Opening a dataset scans its shards once and keeps, per sample, where its bytes lie and its label or captions; the
images are read again, by offset, when they are evaluated, so the set is random-access like the other sources.
"""

import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from clip_jax.data import tar_format
from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.evaluation.datasets import ClassificationSet

DATASET_TYPES = ("classification", "retrieval", "multilabel")
TASKS = {"classification": "zeroshot_classification", "multilabel": "zeroshot_classification",
         "retrieval": "zeroshot_retrieval"}
IMAGE_EXTENSIONS = ("webp", "png", "jpg", "jpeg")  # CLIP_benchmark's preference when a sample has several
CLASS_NAMES_FILE = "classnames.txt"
TEMPLATES_FILE = "zeroshot_classification_templates.txt"
TYPE_FILE = "dataset_type.txt"
NSHARDS_FILE = "nshards.txt"
MAX_DEPTH = 3


@dataclasses.dataclass(frozen=True)
class Layout:
    """A dataset folder's metadata, checked: its type, class names and templates, and the shards of one split."""

    root: str
    name: str  # "wds/<path under the collection root>"
    split: str
    dataset_type: str
    shards: tuple[str, ...]
    class_names: tuple[str, ...] | None  # classification and multilabel
    templates: tuple[str, ...] | None

    @property
    def task(self) -> str:
        return TASKS[self.dataset_type]


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise MissingInput(f"{path} does not exist") from None
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path} is not UTF-8 text ({e})") from None


def _read_lines(path: str, what: str) -> tuple[str, ...]:
    """The stripped lines of a text file (a final newline is optional); an empty line or file is refused."""
    lines = tuple(line.strip() for line in _read_text(path).splitlines())
    if not lines:
        raise InvalidInput(f"{path} is empty: it must hold one {what} per line")
    for number, line in enumerate(lines, 1):
        if not line:
            raise InvalidInput(f"{path} line {number} is empty: it must hold one {what} per line")
    return lines


def _check_templates(path: str, templates: Sequence[str]) -> None:
    for number, template in enumerate(templates, 1):
        try:
            filled = template.format(c="\0")
        except (KeyError, IndexError, ValueError) as e:
            raise InvalidInput(f"{path} line {number} {template!r} is not a template: write the class name as {{c}} "
                               f"and any other brace doubled ({type(e).__name__}: {e})") from None
        if "\0" not in filled:
            raise InvalidInput(f"{path} line {number} {template!r} has no {{c}} where the class name goes")


def read_layout(root: str, split: str = "test", name: str | None = None) -> Layout:
    """Reads and checks the metadata of the dataset folder `root` and the presence of the shards of `split`."""
    if not os.path.isdir(root):
        raise MissingInput(f"CLIP_benchmark dataset folder {root} does not exist")
    root = os.path.normpath(root)
    type_path = os.path.join(root, TYPE_FILE)
    dataset_type = _read_text(type_path).strip().lower() if os.path.exists(type_path) else "classification"
    if dataset_type not in DATASET_TYPES:
        raise InvalidInput(f"{type_path} says {dataset_type!r}; it must say one of {', '.join(DATASET_TYPES)}")
    nshards_path = os.path.join(root, split, NSHARDS_FILE)
    text = _read_text(nshards_path).strip()
    try:
        nshards = int(text)
    except ValueError:
        raise InvalidInput(f"{nshards_path} must hold the number of shards, an integer; it holds {text[:40]!r}")
    if nshards < 1:
        raise InvalidInput(f"{nshards_path} says {nshards} shards; a split needs at least one")
    shards = tuple(os.path.join(root, split, f"{i}.tar") for i in range(nshards))
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        raise MissingInput(f"{missing[0]} does not exist ({len(missing)} of the {nshards} shards that {nshards_path} "
                           "announces are missing)")
    class_names = templates = None
    if dataset_type != "retrieval":
        class_names = _read_lines(os.path.join(root, CLASS_NAMES_FILE), "class name")
        templates_path = os.path.join(root, TEMPLATES_FILE)
        templates = _read_lines(templates_path, "prompt template")
        _check_templates(templates_path, templates)
    return Layout(root, name or f"wds/{os.path.basename(root)}", split, dataset_type, shards, class_names, templates)


def is_dataset_folder(path: str, split: str = "test") -> bool:
    """Whether `path` looks like a CLIP_benchmark dataset (it holds one of the layout's files)."""
    return any(os.path.exists(os.path.join(path, f)) for f in (CLASS_NAMES_FILE, TEMPLATES_FILE, TYPE_FILE,
                                                                os.path.join(split, NSHARDS_FILE)))


def _check_local(root: str) -> None:
    if "://" in root:
        raise InvalidInput(f"{root}: CLIP_benchmark datasets are read from local folders; download it first (e.g. "
                           "`huggingface-cli download --repo-type dataset clip-benchmark/wds_NAME --local-dir DIR`)")


def find_datasets(root: str, split: str = "test") -> list[Layout]:
    """`root` itself when it is a dataset folder, else every dataset folder under it (a collection), sorted by
    path; each one's metadata is checked before anything is evaluated."""
    _check_local(root)
    if not os.path.isdir(root):
        raise MissingInput(f"CLIP_benchmark dataset or collection folder {root} does not exist")
    if is_dataset_folder(root, split):
        return [read_layout(root, split)]
    found = []

    def walk(folder: str, depth: int) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if not entry.is_dir() or entry.name.startswith("."):
                continue
            if is_dataset_folder(entry.path, split):
                relative = os.path.relpath(entry.path, root).replace(os.sep, "/")
                found.append(read_layout(entry.path, split, name=f"wds/{relative.removeprefix('wds_')}"))
            elif depth < MAX_DEPTH:
                walk(entry.path, depth + 1)

    walk(root, 1)
    if not found:
        raise MissingInput(f"{root} is no CLIP_benchmark dataset (no {os.path.join(root, split, NSHARDS_FILE)}) and "
                           f"holds none in its subfolders (up to {MAX_DEPTH} levels)")
    return found


def folder_candidates(root: str, name: str) -> list[str]:
    """Where dataset `name` (CLIP_benchmark's, e.g. `wds/vtab/cifar10`) may lie under `root`: `root/vtab/cifar10`,
    or flat as LAION's Hugging Face repositories are named, `root/wds_vtab-cifar10` or `root/vtab-cifar10`."""
    bare = name.removeprefix("wds/").strip("/")
    flat = bare.replace("/", "-")
    return [os.path.join(root, *bare.split("/")), os.path.join(root, f"wds_{flat}"), os.path.join(root, flat)]


def find_named(roots: Sequence[str], names: Sequence[str], split: str = "test") -> list[Layout]:
    """The datasets `names` (CLIP_benchmark's names, e.g. the lines of its VTAB+ list) looked up under `roots` in
    order (see `folder_candidates`); each is named `wds/<name>` exactly, whatever its folder is called."""
    for root in roots:
        _check_local(root)
        if not os.path.isdir(root):
            raise MissingInput(f"CLIP_benchmark collection folder {root} does not exist")
    layouts = []
    for name in names:
        bare = name.removeprefix("wds/").strip("/")
        candidates = [c for root in roots for c in folder_candidates(root, name)]
        folder = next((c for c in candidates if os.path.isdir(c)), None)
        if folder is None:
            raise MissingInput(f"CLIP_benchmark dataset {name!r} is not there: looked for {', '.join(candidates)}")
        layouts.append(read_layout(folder, split, name=f"wds/{bare}"))
    return layouts


def read_names(items: Sequence[str]) -> list[str]:
    """Dataset names given directly, or as files of one name per line (`#` comments and blank lines skipped), like
    CLIP_benchmark's collection files."""
    names = []
    for item in items:
        if os.path.isfile(item):
            names.extend(line.split("#", 1)[0].strip() for line in _read_text(item).splitlines()
                         if line.split("#", 1)[0].strip())
        else:
            names.append(item)
    if not names:
        raise InvalidInput(f"no dataset names in {', '.join(items)}")
    return names


# ---------------------------------------------------------------------------------------------------------------
# The samples


@dataclasses.dataclass(frozen=True)
class _Where:
    shard: int
    offset: int  # header offset of the sample's first member
    end: int  # header offset of the next sample (-1: the shard's end)
    image_ext: str


def _read_group(path: str, where: _Where) -> dict[str, bytes]:
    with open(path, "rb") as f:
        f.seek(where.offset)
        data = f.read() if where.end < 0 else f.read(where.end - where.offset)
    members = tar_format.iter_members(io.BytesIO(data + bytes(2 * tar_format.BLOCK)))
    return next(tar_format.iter_groups(members)).files


class TarSampleSource:
    """Random access to the images of scanned shards: `source[i]` is `{"image": bytes, "label": int}`."""

    def __init__(self, shards: Sequence[str], where: Sequence[_Where], labels: np.ndarray):
        self.shards, self.where, self.labels = tuple(shards), tuple(where), labels

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, index: int) -> dict[str, Any]:
        where = self.where[index]
        return {"image": _read_group(self.shards[where.shard], where)[where.image_ext],
                "label": int(self.labels[index])}


def _label(layout: Layout, files: dict[str, bytes], sample: str) -> Any:
    """A sample's class index (classification), multi-hot vector (multilabel) or captions (retrieval)."""
    ext = {"classification": "cls", "multilabel": "npy", "retrieval": "txt"}[layout.dataset_type]
    if ext not in files:
        raise InvalidInput(f"{sample} has no .{ext} file; every {layout.dataset_type} sample needs one")
    data = files[ext]
    if ext == "txt":
        try:
            captions = [line.strip() for line in data.decode("utf-8").splitlines() if line.strip()]
        except UnicodeDecodeError as e:
            raise InvalidInput(f"{sample}.txt is not UTF-8 text ({e})") from None
        if not captions:
            raise InvalidInput(f"{sample}.txt holds no caption; a retrieval image needs at least one (one per line)")
        return captions
    num_classes = len(layout.class_names)
    if ext == "cls":
        try:
            label = int(data.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise InvalidInput(f"{sample}.cls must hold a class index, an integer; it holds {data[:40]!r}") from None
        if not 0 <= label < num_classes:
            raise InvalidInput(f"{sample}.cls has label {label} but {layout.root}/{CLASS_NAMES_FILE} names "
                               f"{num_classes} classes (labels 0..{num_classes - 1})")
        return label
    try:
        vector = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - numpy raises several kinds for a bad .npy
        raise InvalidInput(f"{sample}.npy is not a NumPy array file ({type(e).__name__}: {e})") from None
    if vector.shape != (num_classes,) or not (np.issubdtype(vector.dtype, np.number) or vector.dtype == bool):
        raise InvalidInput(f"{sample}.npy holds {vector.dtype} {vector.shape}; a multilabel target is a numeric "
                           f"vector over the {num_classes} classes of {layout.root}/{CLASS_NAMES_FILE}")
    return vector


def _complete_groups(shard: str):
    """The samples of a shard; one that is cut off (a truncated or corrupt shard) raises, naming the shard, rather
    than being judged on its partial files."""
    try:
        with open(shard, "rb") as f:
            groups = tar_format.iter_groups(tar_format.iter_members(f))
            pending = next(groups, None)
            for group in groups:
                yield pending
                pending = group
            if pending is not None:
                yield pending
    except tar_format.TarError as e:
        raise InvalidInput(f"{shard} is not a readable tar file: {e}") from None


def scan_samples(layout: Layout) -> tuple[list[_Where], list[Any]]:
    """Where every sample of the split lies and its label (see `_label`), in shard order."""
    where, labels = [], []
    for index, shard in enumerate(layout.shards):
        for group in _complete_groups(shard):
            sample = f"{shard}:{group.key}"
            image_ext = next((e for e in IMAGE_EXTENSIONS if e in group.files), None)
            if image_ext is None:
                raise InvalidInput(f"{sample} has no image ({', '.join('.' + e for e in IMAGE_EXTENSIONS)})")
            labels.append(_label(layout, group.files, sample))
            where.append(_Where(index, group.offset, group.end, image_ext))
    if not where:
        raise InvalidInput(f"the {len(layout.shards)} shard(s) of {os.path.join(layout.root, layout.split)} hold no "
                           "sample")
    return where, labels


@dataclasses.dataclass(frozen=True)
class BenchmarkDataset:
    """An opened dataset: its layout and its samples, as a `ClassificationSet` (classification and multilabel) or a
    retrieval set. For multilabel sets the classification labels are row indices into `targets` [N, C]."""

    layout: Layout
    classification: ClassificationSet | None
    targets: np.ndarray | None  # multilabel only
    retrieval: "BenchmarkRetrievalSet | None"

    @property
    def name(self) -> str:
        return self.layout.name

    def head(self, n: int) -> "BenchmarkDataset":
        """The first `n` images only."""
        if self.retrieval is not None:
            return dataclasses.replace(self, retrieval=self.retrieval.head(n))
        return dataclasses.replace(self, classification=self.classification.head(n))


def open_dataset(layout_or_root: "Layout | str", split: str = "test") -> BenchmarkDataset:
    """Opens a dataset folder (or its checked `Layout`): scans its shards and checks every sample."""
    layout = layout_or_root if isinstance(layout_or_root, Layout) else read_layout(layout_or_root, split)
    where, labels = scan_samples(layout)
    if layout.dataset_type == "retrieval":
        captions = tuple(c for image_captions in labels for c in image_captions)
        caption_image = np.repeat(np.arange(len(labels), dtype=np.int32), [len(c) for c in labels])
        source = TarSampleSource(layout.shards, where, np.zeros(len(where), np.int32))
        return BenchmarkDataset(layout, None, None, BenchmarkRetrievalSet(source, captions, caption_image))
    prompts = tuple(tuple(t.format(c=name) for t in layout.templates) for name in layout.class_names)
    if layout.dataset_type == "multilabel":
        source = TarSampleSource(layout.shards, where, np.arange(len(where), dtype=np.int32))
        targets = np.stack(labels)
    else:
        source = TarSampleSource(layout.shards, where, np.asarray(labels, np.int32))
        targets = None
    return BenchmarkDataset(layout, ClassificationSet(layout.name, source, layout.class_names, prompts), targets, None)


@dataclasses.dataclass(frozen=True)
class BenchmarkRetrievalSet:
    """Images with their captions, shaped like `sources.RetrievalSet` for `retrieval.evaluate_retrieval`:
    `caption_image[t]` is the image caption `t` describes."""

    source: TarSampleSource
    captions: tuple[str, ...]
    caption_image: np.ndarray  # int32 [T]

    @property
    def num_images(self) -> int:
        return len(self.source)

    def head(self, n: int) -> "BenchmarkRetrievalSet":
        if n >= self.num_images:
            return self
        keep = int(np.searchsorted(self.caption_image, n))  # captions are grouped by image, in image order
        source = TarSampleSource(self.source.shards, self.source.where[:n], self.source.labels[:n])
        return BenchmarkRetrievalSet(source, self.captions[:keep], self.caption_image[:keep])

    def image_batches(self, *, batch_size: int, image_size: int, mean: Sequence[float], std: Sequence[float],
                      num_threads: int | None = None, resize_mode: str = "shortest"):
        """Eval-transformed, normalised images float32 [<=B, S, S, 3], in order (the last batch partial)."""
        from clip_jax.evaluation.batches import classification_batches

        for batch in classification_batches(self.source, batch_size=batch_size, image_size=image_size, mean=mean,
                                            std=std, num_threads=num_threads, resize_mode=resize_mode):
            yield batch["images"][batch["valid"]]


# ---------------------------------------------------------------------------------------------------------------
# In training (`zeroshot_data`): a single-label classification set, its test split


TRAINING_ZERO_SHOT = "training's zero-shot evaluation"


def check_training_layout(root: str, split: str = "test", *, needed_by: str = TRAINING_ZERO_SHOT) -> Layout:
    """The layout of a CLIP_benchmark dataset a trainer can evaluate, probe or fine-tune on (`needed_by` says
    which, in the message): those need one class per image."""
    layout = read_layout(root, split)
    if layout.dataset_type != "classification":
        others = (" (run `python -m clip_jax.zeroshot --benchmark` for the others)" if needed_by == TRAINING_ZERO_SHOT
                  else "")
        raise InvalidInput(f"{os.path.join(layout.root, TYPE_FILE)} says {layout.dataset_type}; {needed_by} needs a "
                           f"classification dataset{others}")
    return layout


def open_training_set(root: str, split: str = "test") -> ClassificationSet:
    """The `ClassificationSet` of a CLIP_benchmark classification dataset, for `ZeroShotEvaluator`."""
    return open_dataset(check_training_layout(root, split)).classification
