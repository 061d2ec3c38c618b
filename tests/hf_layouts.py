"""A transformers model folder saved in either of transformers' layouts, and `embed`'s embeddings of it: what the
tests of CLIPModel and SiglipModel folders share."""

import json

import numpy as np

from clip_jax.evaluation import embed


def in_layout(folder, layout, tmp_path, processor):
    """A copy of a transformers model folder with `processor` (an image processor and a tokenizer) saved as
    transformers 5 saves it ("processor": `processor_config.json`, the image processor nested under
    "image_processor", no `preprocessor_config.json`), or as transformers 4 saved it ("preprocessor": the image
    processor's `preprocessor_config.json` beside the tokenizer's files)."""
    copy = tmp_path / f"{folder.name}-{layout}"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((folder / name).read_bytes())
    if layout == "processor":
        processor.save_pretrained(str(copy))
        assert "image_processor" in json.loads((copy / "processor_config.json").read_text())
        assert not (copy / "preprocessor_config.json").exists()
    else:
        processor.image_processor.save_pretrained(str(copy))
        processor.tokenizer.save_pretrained(str(copy))
        assert (copy / "preprocessor_config.json").is_file() and not (copy / "processor_config.json").exists()
    return copy


def embedded(folder, photos, out):
    """`embed`'s image and text embeddings of the images and captions in `photos`, the model in `folder`."""
    assert embed.main(["--input_dataset", str(photos), "--output_folder", str(out), "--clip_model", str(folder),
                       "--batch_size", "8"]) == 0
    return [np.load(out / kind / f"{kind}_0.npy").astype(np.float64) for kind in ("img_emb", "text_emb")]


def cosines(got, expected):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    return np.sum(got * expected, axis=-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)

