"""A transformers model folder saved in either of transformers' layouts, and `embed`'s embeddings of it; SigLIP
models, theirs and ours, moved from their init: what the tests of CLIPModel, SiglipModel and Siglip2Model share."""

import json

import jax
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



def moved_from_init(model):
    """A transformers SigLIP model (torch) with its norms, biases, probe and positions moved from their init, in
    place (torch's generator seeded by the caller)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(("bias", "probe", "position_embedding.weight")):
                p.add_(0.2 * torch.randn_like(p))
    return model


def off_init(tree, seed):
    """Every leaf but the kernels and token embeddings moved from its init (norms, biases, probe, positions,
    logit scale and bias)."""
    rng = np.random.default_rng(seed)
    moved = lambda path, x: x if path[-1].key in ("kernel", "embedding") else (  # noqa: E731
        x + 0.2 * rng.standard_normal(np.shape(x)).astype(np.asarray(x).dtype))
    return jax.tree_util.tree_map_with_path(moved, jax.device_get(tree))
