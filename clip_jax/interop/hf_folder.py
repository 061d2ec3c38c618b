"""A transformers CLIPModel folder, written and read without transformers or torch.

`write_hf_files(folder, state_dict, config, mean, std)` writes what `CLIPModel.from_pretrained(folder)` and
`CLIPProcessor.from_pretrained(folder)` load: `config.json`, `model.safetensors` (float32), the image processor's
`preprocessor_config.json` (shortest side to the image size, bicubic, center crop, the mean and std) and the
tokenizer's files for clip_jax's BPE (`vocab.json`, `merges.txt`, `tokenizer_config.json`,
`special_tokens_map.json`). The readers take a folder in that layout, written by clip_jax or by transformers
(such as `openai/clip-vit-large-patch14`): `is_hf_folder`, `hf_model_config`, `check_hf_model`,
`hf_preprocessing`, `read_hf_state_dict` (OpenCLIP's names).
"""

import json
import os

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop.hf_clip import config_from_hf, from_hf_state_dict, hf_config, to_hf_state_dict
from clip_jax.models.config import CLIPConfig, is_resnet

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in the order transformers prefers them
PREPROCESSOR = "preprocessor_config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
HF_FILES = (CONFIG, WEIGHTS[0], PREPROCESSOR, *TOKENIZER_FILES)  # what the export writes
_BICUBIC = 3  # PIL's Resampling.BICUBIC, as transformers' image processors name the resampling
# OpenAI's names of the two special tokens, as CLIPTokenizer knows them; clip_jax's own are <start_of_text> etc.
_SOT, _EOT = "<|startoftext|>", "<|endoftext|>"


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} must hold a JSON object")
    return data


def is_hf_folder(path: str) -> bool:
    """A folder whose `config.json` is a transformers model's (it names a `model_type`; a clip_jax run's does not)."""
    config = os.path.join(path, CONFIG)
    if not os.path.isfile(config):
        return False
    try:
        return "model_type" in _read_json(config)
    except (InvalidInput, OSError):
        return False


def hf_model_config(folder: str) -> CLIPConfig:
    """The model a CLIPModel folder's `config.json` describes, named after the folder."""
    path = os.path.join(folder, CONFIG)
    return config_from_hf(_read_json(path), name=os.path.basename(os.path.normpath(folder)), where=path)


def _recorded(c: CLIPConfig) -> dict:
    """What a transformers `config.json` records of a ViT model, to compare with the model asked for (not the image
    size: a checkpoint's positional embedding is resized to the model's, as for any pretrained start)."""
    v, t = c.vision, c.text
    return {"embed_dim": c.embed_dim, "quick_gelu": c.quick_gelu,
            **{f"vision {k}": getattr(v, k) for k in ("patch_size", "width", "layers", "heads", "mlp_width")},
            **{f"text {k}": getattr(t, k) for k in ("context_length", "vocab_size", "width", "heads", "layers",
                                                    "mlp_width", "pool_type")},
            **{f"{tower} {k}": getattr(getattr(c, tower).block, k) for tower in ("vision", "text")
               for k in ("norm_eps", "gelu_approximate")}}


def check_hf_model(folder: str, held: CLIPConfig, wanted: CLIPConfig) -> None:
    """Refuses, in one line naming the differences, a CLIPModel folder whose model (`held`) is not `wanted`."""
    if is_resnet(wanted):
        differences = [f"{wanted.name} has a ResNet image tower, the folder's model a ViT"]
    else:
        ours, theirs = _recorded(held), _recorded(wanted)
        differences = [f"{what} {ours[what]} (not {theirs[what]})" for what in ours if ours[what] != theirs[what]]
    if differences:
        raise InvalidInput(f"{folder} holds another model than {wanted.name} (its {CONFIG}: "
                           f"{', '.join(differences)}): leave the model out to use the folder's, or name the "
                           "model it holds")


def hf_preprocessing(folder: str) -> dict:
    """The mean and std of a CLIPModel folder's image processor (`{}` without a `preprocessor_config.json`),
    refusing preprocessing clip_jax's transforms do not do."""
    path = os.path.join(folder, PREPROCESSOR)
    if not os.path.isfile(path):
        return {}
    saved = _read_json(path)
    size, crop = saved.get("size"), saved.get("crop_size")
    size = size.get("shortest_edge") if isinstance(size, dict) else size
    crop = crop.get("height") if isinstance(crop, dict) else crop
    if saved.get("resample", _BICUBIC) != _BICUBIC:
        raise InvalidInput(f"{path}: resample={saved['resample']}; clip_jax's transforms resize bicubically only "
                           f"(resample {_BICUBIC})")
    if saved.get("do_center_crop", True) and size is not None and crop is not None and size != crop:
        raise InvalidInput(f"{path}: the shortest side goes to {size} px, then a {crop} px crop; clip_jax's "
                           "transforms resize the shortest side to the crop's size")
    return {k: tuple(float(x) for x in saved[f"image_{k}"]) for k in ("mean", "std") if f"image_{k}" in saved}


def hf_weights_file(folder: str) -> str:
    for name in WEIGHTS:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise MissingInput(f"no model weights in {folder}: a transformers CLIPModel folder holds {WEIGHTS[0]} (or "
                       f"{WEIGHTS[1]}) beside its {CONFIG}")


def read_hf_state_dict(folder: str, config: CLIPConfig) -> dict:
    """The OpenCLIP state_dict of the CLIPModel in `folder`, whose model is `config` (`hf_model_config`)."""
    from clip_jax.interop.weight_files import read_arrays

    weights = hf_weights_file(folder)
    return from_hf_state_dict(read_arrays(weights), config, weights)


def _tokenizer_files(context_length: int) -> dict[str, str]:
    """File name -> text of CLIPTokenizer's files for clip_jax's BPE (`clip_jax.tokenizer`), cutting text to
    `context_length` tokens."""
    from clip_jax.tokenizer import bpe_vocabulary

    tokens, merges = bpe_vocabulary()
    vocab = {{"<start_of_text>": _SOT, "<end_of_text>": _EOT}.get(token, token): i for i, token in enumerate(tokens)}
    special = {"bos_token": _SOT, "eos_token": _EOT, "unk_token": _EOT, "pad_token": _EOT}
    config = {"tokenizer_class": "CLIPTokenizer", "processor_class": "CLIPProcessor",
              "model_max_length": int(context_length), "do_lower_case": True, "errors": "replace",
              "add_prefix_space": False, **special}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def preprocessor_config(image_size: int, mean, std) -> dict:
    """CLIPImageProcessor's settings for clip_jax's eval transform: shortest side to `image_size` (bicubic), center
    crop, scale to [0, 1], normalise."""
    return {"image_processor_type": "CLIPImageProcessor", "processor_class": "CLIPProcessor",
            "do_convert_rgb": True, "do_resize": True, "size": {"shortest_edge": int(image_size)},
            "resample": _BICUBIC, "do_center_crop": True, "crop_size": {"height": int(image_size),
                                                                         "width": int(image_size)},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]}


def write_hf_files(folder: str, state_dict: dict, config: CLIPConfig, *, mean, std) -> None:
    """Writes the CLIPModel folder files of `config` (its OpenCLIP `state_dict`) into `folder`, which the caller
    has claimed (`clip_jax.runtime.ownership`) for `HF_FILES`."""
    from clip_jax.interop.weight_files import write_safetensors

    texts = {CONFIG: json.dumps(hf_config(config), indent=2) + "\n",
             PREPROCESSOR: json.dumps(preprocessor_config(config.vision.image_size, mean, std), indent=2) + "\n",
             **_tokenizer_files(config.text.context_length)}
    write_safetensors(os.path.join(folder, WEIGHTS[0]), to_hf_state_dict(state_dict, config), {"format": "pt"})
    for name, text in texts.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
