"""Eval sources: image folders, TFDS ArrayRecord sources, the demo set and retrieval shards, read into padded
batches and compared with OpenCLIP's eval transform."""

import dataclasses
import io
import json

import numpy as np
import open_clip
import pytest
import webdataset as wds
from PIL import Image

from clip_jax.evaluation import datasets, demo_set, prompts, sources
from clip_jax.evaluation.batches import classification_batches

SIZE = 32
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _reference(image):
    """OpenCLIP's eval transform of a PIL image, as HWC numpy."""
    return open_clip.image_transform(SIZE, is_train=False, mean=MEAN, std=STD)(image).permute(1, 2, 0).numpy()


def _photo(width, height, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_image_folder_classes_labels_and_padded_batches(tmp_path):
    files = {"zebra": ["1.jpg", "2.png"], "ant": ["x.jpeg"], "cat": ["a.JPG", "b.webp", "notes.txt"]}
    paths = []
    for seed, (name, images) in enumerate(sorted(files.items())):
        (tmp_path / name).mkdir()
        for i, filename in enumerate(images):
            if filename.endswith(".txt"):
                (tmp_path / name / filename).write_text("not an image")
                continue
            image = _photo(40 + 7 * i, 50, seed * 10 + i)
            image.save(tmp_path / name / filename, format=None if not filename.endswith("JPG") else "JPEG")
            paths.append((tmp_path / name / filename, name))
    source = sources.ImageFolderSource(str(tmp_path))
    assert source.class_names == ("ant", "cat", "zebra")
    assert len(source) == 5
    batches = list(classification_batches(source, batch_size=4, image_size=SIZE, mean=MEAN, std=STD, num_threads=2))
    assert len(batches) == 2
    images = np.concatenate([b["images"] for b in batches])
    labels = np.concatenate([b["labels"] for b in batches])
    valid = np.concatenate([b["valid"] for b in batches])
    assert valid.tolist() == [True] * 5 + [False] * 3 and labels[5:].tolist() == [-1] * 3
    assert images.shape == (8, SIZE, SIZE, 3) and images.dtype == np.float32
    for i, (path, name) in enumerate(sorted(paths, key=lambda p: (p[1], p[0].name))):
        assert source.class_names[labels[i]] == name
        np.testing.assert_allclose(images[i], _reference(Image.open(path).convert("RGB")), atol=1e-6)
    assert not images[5:].any()


def test_image_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sources.ImageFolderSource(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no class folders"):
        sources.ImageFolderSource(str(tmp_path))


def test_tfds_array_record_source_without_tensorflow(tmp_path):
    import tensorflow_datasets as tfds

    colors = {"red": (220, 20, 20), "blue": (20, 20, 220)}

    class TinyColors(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(None, None, 3)),
                "label": tfds.features.ClassLabel(names=list(colors))}))

        def _split_generators(self, dl_manager):
            return {"test": self._generate_examples()}

        def _generate_examples(self):
            for i in range(6):
                buffer = io.BytesIO()
                Image.new("RGB", (40 + i, 36), colors[["red", "blue"][i % 2]]).save(buffer, "PNG")
                yield i, {"image": buffer.getvalue(), "label": i % 2}

    TinyColors(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    source = sources.TfdsSource("tiny_colors", "test", data_dir=str(tmp_path))
    assert source.class_names == ("red", "blue") and len(source) == 6
    (batch,) = list(classification_batches(source, batch_size=8, image_size=SIZE, mean=MEAN, std=STD))
    for image, label in zip(batch["images"][:6], batch["labels"][:6]):
        width = 40  # every image is 36 px high: the eval transform makes it SIZE x SIZE of one colour
        expected = _reference(Image.new("RGB", (width, 36), colors[source.class_names[label]]))
        np.testing.assert_allclose(image, expected, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="tfds build"):
        sources.TfdsSource("tiny_colors_missing", "test", data_dir=str(tmp_path))


def test_retrieval_shards_with_several_captions_per_image(tmp_path):
    images = [_photo(30 + i, 24, i) for i in range(5)]
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        encoded.append(buffer.getvalue())
    with wds.TarWriter(str(tmp_path / "00000.tar"), encoder=False) as sink:
        sink.write({"__key__": "0", "png": encoded[0], "txt": b"first a\nfirst b\n\n",})
        sink.write({"__key__": "1", "png": encoded[1], "json": json.dumps({"captions": ["second a", "second b",
                                                                                         "second c"]}).encode()})
        sink.write({"__key__": "2", "txt": b"no image here"})
    with wds.TarWriter(str(tmp_path / "00001.tar"), encoder=False) as sink:
        for i in (2, 3, 4):
            sink.write({"__key__": str(i), "png": encoded[i], "txt": f"image {i}".encode()})
    retrieval = sources.load_retrieval_set(f"{tmp_path}/{{00000..00001}}.tar")
    assert retrieval.num_images == 5
    assert retrieval.captions == ("first a", "first b", "second a", "second b", "second c", "image 2", "image 3",
                                  "image 4")
    assert retrieval.caption_image.tolist() == [0, 0, 1, 1, 1, 2, 3, 4]
    batches = list(retrieval.image_batches(batch_size=2, image_size=SIZE, mean=MEAN, std=STD))
    assert [len(b) for b in batches] == [2, 2, 1]
    for got, image in zip(np.concatenate(batches), images):
        np.testing.assert_allclose(got, _reference(image), atol=1e-6)
    first_two = dataclasses.replace(retrieval, num_images=2)
    assert sum(len(b) for b in first_two.image_batches(batch_size=4, image_size=SIZE, mean=MEAN, std=STD)) == 2


def test_corrupt_image_in_a_retrieval_set_is_an_error_naming_it(tmp_path):
    with wds.TarWriter(str(tmp_path / "00000.tar"), encoder=False) as sink:
        sink.write({"__key__": "bad", "jpg": b"not a jpeg", "txt": b"caption"})
    retrieval = sources.load_retrieval_set(str(tmp_path / "00000.tar"))
    with pytest.raises(ValueError, match="corrupt image .*00000.tar:bad"):
        list(retrieval.image_batches(batch_size=2, image_size=SIZE, mean=MEAN, std=STD))


def test_the_demo_set_is_the_fashion_mnist_test_split_under_the_eval_transform():
    source = demo_set("test")
    assert len(source) == 10_000 and source.class_names[9] == "ankle boot"
    batches = classification_batches(source.source, batch_size=4, image_size=SIZE, mean=MEAN, std=STD)
    batch = next(iter(batches))
    item = source.source[0]
    expected = _reference(Image.fromarray(item["image"]).convert("RGB"))
    np.testing.assert_allclose(batch["images"][0], expected, atol=1e-6)
    assert batch["labels"][0] == item["label"] and batch["valid"].all()


def test_imagenet_v2s_numbered_folders_are_labels_in_numeric_order(tmp_path):
    for label in range(12):  # text order would read 0, 1, 10, 11, 2, ...
        (tmp_path / str(label)).mkdir()
        _photo(30, 30, label).save(tmp_path / str(label) / f"{label}.png")
    source = sources.ImageFolderSource(str(tmp_path))
    assert source.numbered and source.class_names == tuple(str(i) for i in range(12))
    for i in range(12):
        item = source[i]
        expected = (tmp_path / str(i) / f"{i}.png").read_bytes()
        assert item["label"] == i and item["image"] == expected
    named = datasets.open_classification_set("imagenet-v2", str(tmp_path), class_names=[f"c{i}" for i in range(12)])
    assert named.name == "imagenet-v2" and named.class_names[10] == "c10"


def test_imagenet_v2s_thousand_folders_get_imagenets_class_names():
    names = prompts.readable_class_names([str(i) for i in range(1000)])
    assert names == prompts.imagenet_class_names() and names[1] == "goldfish"
    assert prompts.readable_class_names([str(i) for i in range(999)])[1] == "1"  # not ImageNet: kept


def test_numbered_folders_with_a_gap_and_a_named_folder_as_imagenet_v2_are_refused(tmp_path):
    for label in (0, 1, 3):
        (tmp_path / "gap" / str(label)).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"numbered class folders .* missing \[2\]"):
        sources.ImageFolderSource(str(tmp_path / "gap"))
    (tmp_path / "named" / "cat").mkdir(parents=True)
    _photo(30, 30, 0).save(tmp_path / "named" / "cat" / "a.png")
    with pytest.raises(ValueError, match="not in ImageNet-V2's layout.*found e.g. 'cat'"):
        datasets.open_classification_set("imagenet-v2", str(tmp_path / "named"))
