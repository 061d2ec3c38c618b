"""A transformers CLIPModel or SiglipModel folder, written and read without transformers or torch.

`write_hf_files(folder, state_dict, config, mean, std)` writes what `CLIPModel.from_pretrained(folder)` and
`CLIPProcessor.from_pretrained(folder)` load: `config.json`, `model.safetensors` (float32), the image processor's
`preprocessor_config.json` (shortest side to the image size, bicubic, center crop, the mean and std) and the
tokenizer's files for clip_jax's BPE (`vocab.json`, `merges.txt`, `tokenizer_config.json`,
`special_tokens_map.json`). A SigLIP model (an attention-pooled image tower: `hf_model_type`) is written as what
`SiglipModel.from_pretrained(folder)` and `SiglipProcessor.from_pretrained(folder)` load: `config.json`,
`model.safetensors`, a SiglipImageProcessor's `preprocessor_config.json` (the whole image to the image size,
bicubic, no crop: "squash") and its SentencePiece tokenizer's files (`tokenizer_files=`, what `saved_tokenizer`
gives of an object with `save(folder)`). `hf_files(config, tokenizer_files)` names the files written;
`hf_unsupported(config)` says why a model has no transformers counterpart.

The readers take a folder in that layout, written by clip_jax or by transformers (such as
`openai/clip-vit-large-patch14` or `google/siglip-base-patch16-224`), and go by its `config.json`'s `model_type`
("clip": `clip_jax.interop.hf_clip`, "siglip": `clip_jax.interop.hf_siglip`): `is_hf_folder`, `hf_model_config`,
`check_hf_model`, `hf_preprocessing`, `read_hf_state_dict` (OpenCLIP's names).
"""

import json
import os
import tempfile

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import hf_clip, hf_siglip
from clip_jax.models.config import CLIPConfig, is_resnet

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in the order transformers prefers them
PREPROCESSOR = "preprocessor_config.json"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
HF_FILES = (CONFIG, WEIGHTS[0], PREPROCESSOR, *TOKENIZER_FILES)  # what the export writes of a CLIP model
# The files a SentencePiece tokenizer's save may write beside a SiglipModel's (SigLIP's spiece.model, SigLIP 2's
# tokenizer.model or tokenizer.json, their configs): an earlier export's, to remove when a later one writes none.
SIGLIP_TOKENIZER_FILES = ("spiece.model", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json")
_MODULES = {hf_clip.MODEL_TYPE: hf_clip, hf_siglip.MODEL_TYPE: hf_siglip}  # config.json's model_type -> its code
_BICUBIC = 3  # PIL's Resampling.BICUBIC, as transformers' image processors name the resampling
# OpenAI's names of the two special tokens, as CLIPTokenizer knows them; clip_jax's own are <start_of_text> etc.
_SOT, _EOT = "<|startoftext|>", "<|endoftext|>"
_SIGLIP_MEAN = _SIGLIP_STD = (0.5, 0.5, 0.5)  # SiglipImageProcessor's defaults (IMAGENET_STANDARD_MEAN / _STD)


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


def hf_model_type(config: CLIPConfig) -> str:
    """The transformers model `config` is written as: "siglip" for an attention-pooled (SigLIP) image tower, else
    "clip"."""
    return hf_siglip.MODEL_TYPE if not is_resnet(config) and config.vision.attention_pool else hf_clip.MODEL_TYPE


def hf_unsupported(config: CLIPConfig) -> str | None:
    """Why transformers' model of `config` (`hf_model_type`) cannot hold it (one clause), or None when it can."""
    return _MODULES[hf_model_type(config)].hf_unsupported(config)


def _module(saved: dict, where: str):
    """hf_clip or hf_siglip, as the `config.json` at `where` (`saved`) names its model_type."""
    model_type = saved.get("model_type")
    if model_type == hf_siglip.SIGLIP2_MODEL_TYPE:
        raise InvalidInput(hf_siglip.siglip2_refusal(where))
    if model_type not in _MODULES:
        raise InvalidInput(f"{where} is a transformers {model_type!r} model; clip_jax reads CLIPModel and SiglipModel "
                           f"folders (model_type {' or '.join(repr(t) for t in _MODULES)})")
    return _MODULES[model_type]


def hf_model_config(folder: str) -> CLIPConfig:
    """The model a CLIPModel or SiglipModel folder's `config.json` describes, named after the folder."""
    path = os.path.join(folder, CONFIG)
    saved = _read_json(path)
    return _module(saved, path).config_from_hf(saved, name=os.path.basename(os.path.normpath(folder)), where=path)


def _recorded(c: CLIPConfig) -> dict:
    """What a transformers `config.json` records of a ViT model, to compare with the model asked for (not the image
    size: a checkpoint's positional embedding is resized to the model's, as for any pretrained start; nor the
    logit_bias, which a pretrained start without one gets at its init)."""
    v, t = c.vision, c.text
    return {"embed_dim": c.embed_dim, "quick_gelu": c.quick_gelu,
            **{f"vision {k}": getattr(v, k) for k in ("patch_size", "width", "layers", "heads", "mlp_width",
                                                      "pool_type", "no_ln_pre")},
            **{f"text {k}": getattr(t, k) for k in ("context_length", "vocab_size", "width", "heads", "layers",
                                                    "mlp_width", "pool_type", "no_causal_mask", "proj_bias")},
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
    """The preprocessing of a transformers folder's image processor (`{}` without a `preprocessor_config.json`),
    refusing what clip_jax's transforms do not do: for CLIPImageProcessor's resize of the shortest side (and
    center crop) the `mean` and `std` it names; for SiglipImageProcessor's resize of the whole image to a square
    (`size` {height, width}, no crop) its `mean` and `std` (SiglipImageProcessor's 0.5 where it names none) and
    `resize_mode` "squash" (`clip_jax.data.transforms.eval_crop`)."""
    path = os.path.join(folder, PREPROCESSOR)
    if not os.path.isfile(path):
        return {}
    saved = _read_json(path)
    siglip = _siglip_processor(saved, folder)
    size = saved.get("size", {"height": 224, "width": 224} if siglip else None)
    if isinstance(size, dict) and ("height" in size or "width" in size):
        return _squash_preprocessing(saved, size, path, siglip)
    return _shortest_preprocessing(saved, path)


def _siglip_processor(saved: dict, folder: str) -> bool:
    """Whether the image processor takes SiglipImageProcessor's defaults (else CLIPImageProcessor's): as its
    `image_processor_type` says, else as the folder's model_type."""
    kind = saved.get("image_processor_type")
    if isinstance(kind, str) and kind.startswith(("Siglip", "CLIP")):
        return kind.startswith("Siglip")
    try:
        return _read_json(os.path.join(folder, CONFIG)).get("model_type") == hf_siglip.MODEL_TYPE
    except (InvalidInput, OSError):
        return False


def _squash_preprocessing(saved: dict, size: dict, path: str, siglip: bool) -> dict:
    """A resize of the whole image to `size` {height, width}, as SiglipImageProcessor does."""
    height, width = size.get("height"), size.get("width")
    crop = saved.get("crop_size") or {"height": 224, "width": 224}
    crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)
    factor = saved.get("rescale_factor", 1 / 255)
    problems = [
        f"size={size}: the image goes to {height} x {width} px; clip_jax's transforms squash it to a square"
        if height != width else None,
        f"resample={saved.get('resample')}; clip_jax's transforms resize bicubically only (resample {_BICUBIC})"
        if saved.get("resample", _BICUBIC) != _BICUBIC else None,
        "do_resize=false: the images are left at their size; clip_jax's transforms resize them"
        if not saved.get("do_resize", True) else None,
        f"do_center_crop=true: a {crop[0]} x {crop[1]} px crop after squashing to {height} x {width}; clip_jax's "
        "transforms squash to the model's size without a crop"
        if saved.get("do_center_crop", not siglip) and crop != (height, width) else None,
        f"do_rescale / rescale_factor: the pixels are not scaled by 1/255 (do_rescale {saved.get('do_rescale')}, "
        f"rescale_factor {saved.get('rescale_factor')}), as clip_jax's transforms scale them"
        if not saved.get("do_rescale", True) or not isinstance(factor, (int, float)) or abs(factor - 1 / 255) > 1e-12
        else None,
        "do_normalize=false: the pixels are not normalised; clip_jax's transforms normalise with a mean and std"
        if not saved.get("do_normalize", True) else None,
    ]
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise InvalidInput(f"{path}: {problem}")
    defaults = {"mean": _SIGLIP_MEAN, "std": _SIGLIP_STD} if siglip else {}
    stats = {k: tuple(float(x) for x in saved.get(f"image_{k}", defaults.get(k, ()))) for k in ("mean", "std")}
    return {**{k: v for k, v in stats.items() if v}, "resize_mode": "squash"}


def _shortest_preprocessing(saved: dict, path: str) -> dict:
    """CLIPImageProcessor's resize of the shortest side, then center crop: the mean and std it names."""
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
    raise MissingInput(f"no model weights in {folder}: a transformers model folder (CLIPModel, SiglipModel) holds "
                       f"{WEIGHTS[0]} (or {WEIGHTS[1]}) beside its {CONFIG}")


def read_hf_state_dict(folder: str, config: CLIPConfig) -> dict:
    """The OpenCLIP state_dict of the CLIPModel or SiglipModel in `folder`, whose model is `config`
    (`hf_model_config`)."""
    from clip_jax.interop.array_files import read_arrays

    weights = hf_weights_file(folder)
    return _MODULES[hf_model_type(config)].from_hf_state_dict(read_arrays(weights), config, weights)


def _tokenizer_files(context_length: int) -> dict[str, str]:
    """File name -> text of CLIPTokenizer's files for clip_jax's BPE (`clip_jax.text.clip_tokenizer`), cutting text to
    `context_length` tokens."""
    from clip_jax.text.clip_tokenizer import bpe_vocabulary

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


def siglip_preprocessor_config(image_size: int, mean, std) -> dict:
    """SiglipImageProcessor's settings for clip_jax's "squash" eval transform: the whole image to `image_size` x
    `image_size` (bicubic), no crop, scale to [0, 1], normalise."""
    return {"image_processor_type": "SiglipImageProcessor", "processor_class": "SiglipProcessor",
            "do_convert_rgb": True, "do_resize": True, "size": {"height": int(image_size), "width": int(image_size)},
            "resample": _BICUBIC, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]}


def _require_tokenizer(config: CLIPConfig, tokenizer_files) -> None:
    if not tokenizer_files:
        raise InvalidInput(f"{config.name} is a SigLIP model, whose transformers files include its SentencePiece "
                           "tokenizer's: give the tokenizer's files (tokenizer_files=saved_tokenizer(tokenizer)), or "
                           "write OpenCLIP's files only")


def saved_tokenizer(tokenizer) -> dict[str, bytes]:
    """File name -> bytes of what `tokenizer.save(folder)` writes, saved into an empty temporary folder (a
    tokenizer may refuse to replace its files: the export replaces an earlier export's)."""
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save(scratch)
        names = sorted(n for n in os.listdir(scratch) if os.path.isfile(os.path.join(scratch, n)))
        saved = {}
        for name in names:
            with open(os.path.join(scratch, name), "rb") as f:
                saved[name] = f.read()
        return saved


def write_files(folder: str, files: dict[str, bytes]) -> None:
    """Writes each of `files` (name -> bytes) into `folder`, which the caller has claimed for them (replacing those an
    earlier export of clip_jax's wrote)."""
    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)


def hf_files(config: CLIPConfig, tokenizer_files=None) -> tuple[str, ...]:
    """The files `write_hf_files` writes for `config`: `HF_FILES` for a CLIP model; for a SigLIP model its config,
    weights, image processor and its tokenizer's files (the names of `tokenizer_files`)."""
    if hf_model_type(config) == hf_clip.MODEL_TYPE:
        return HF_FILES
    _require_tokenizer(config, tokenizer_files)
    return tuple(dict.fromkeys((CONFIG, WEIGHTS[0], PREPROCESSOR, *tokenizer_files)))


def write_hf_files(folder: str, state_dict: dict, config: CLIPConfig, *, mean, std,
                   tokenizer_files: dict[str, bytes] | None = None, resize_mode: str = "shortest") -> None:
    """Writes the CLIPModel or SiglipModel folder files of `config` (its OpenCLIP `state_dict`) into `folder`, which
    the caller has claimed (`clip_jax.runtime.ownership`) for `hf_files(config, tokenizer_files)`. A SigLIP model
    needs its tokenizer's files (`saved_tokenizer(tokenizer)`: name -> bytes). `resize_mode`: the eval transform the
    model is used with: "squash" writes SiglipImageProcessor's settings, "shortest" CLIPImageProcessor's (shortest
    side, center crop; a SiglipProcessor takes either)."""
    from clip_jax.interop.array_files import write_safetensors

    siglip = hf_model_type(config) == hf_siglip.MODEL_TYPE
    if siglip:
        _require_tokenizer(config, tokenizer_files)
    module = _MODULES[hf_model_type(config)]
    squash = siglip and resize_mode == "squash"
    processor = (siglip_preprocessor_config if squash else preprocessor_config)(config.vision.image_size, mean, std)
    if siglip and not squash:
        processor["processor_class"] = "SiglipProcessor"
    texts = {CONFIG: json.dumps(module.hf_config(config), indent=2) + "\n",  # refuses a model it cannot hold
             PREPROCESSOR: json.dumps(processor, indent=2) + "\n",
             **({} if siglip else _tokenizer_files(config.text.context_length))}
    write_safetensors(os.path.join(folder, WEIGHTS[0]), module.to_hf_state_dict(state_dict, config), {"format": "pt"})
    write_files(folder, {**(tokenizer_files if siglip else {}), **{n: t.encode("utf-8") for n, t in texts.items()}})
