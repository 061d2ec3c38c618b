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
`openai/clip-vit-large-patch14`, `google/siglip-base-patch16-224` or `google/siglip2-base-patch16-naflex`), and go by
its `config.json`'s `model_type` ("clip": `clip_jax.interop.hf_clip`, "siglip": `clip_jax.interop.hf_siglip`,
"siglip2": SigLIP 2's NaFlex model, `clip_jax.interop.hf_siglip2`): `is_hf_folder`, `hf_model_config`,
`check_hf_model`, `hf_preprocessing` (its image processor: `clip_jax.interop.hf_processor`), `read_hf_state_dict`
(OpenCLIP's names).
"""

import json
import os
import tempfile

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.interop import hf_clip, hf_siglip, hf_siglip2
from clip_jax.interop.hf_processor import (  # noqa: F401 - the folder's image processor, read through this module
    PREPROCESSOR, _read_json, assumed_preprocessing, hf_preprocessing, missing_processor_note,
    naflex_preprocessor_config, preprocessor_config, siglip_preprocessor_config)
from clip_jax.models.config import CLIPConfig, is_resnet

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in the order transformers prefers them
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
HF_FILES = (CONFIG, WEIGHTS[0], PREPROCESSOR, *TOKENIZER_FILES)  # what the export writes of a CLIP model
# The files a SentencePiece tokenizer's save may write beside a SiglipModel's (SigLIP's spiece.model, SigLIP 2's
# tokenizer.model or tokenizer.json, their configs): an earlier export's, to remove when a later one writes none.
SIGLIP_TOKENIZER_FILES = ("spiece.model", "tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json")
# config.json's model_type -> its code
_MODULES = {hf_clip.MODEL_TYPE: hf_clip, hf_siglip.MODEL_TYPE: hf_siglip, hf_siglip2.MODEL_TYPE: hf_siglip2}
# OpenAI's names of the two special tokens, as CLIPTokenizer knows them; clip_jax's own are <start_of_text> etc.
_SOT, _EOT = "<|startoftext|>", "<|endoftext|>"


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
    """The transformers model `config` is written as: "siglip2" for a NaFlex image tower, "siglip" for another
    attention-pooled (SigLIP) one, else "clip"."""
    if is_resnet(config) or not config.vision.attention_pool:
        return hf_clip.MODEL_TYPE
    return hf_siglip2.MODEL_TYPE if config.vision.naflex else hf_siglip.MODEL_TYPE


def hf_unsupported(config: CLIPConfig) -> str | None:
    """Why transformers' model of `config` (`hf_model_type`) cannot hold it (one clause), or None when it can."""
    return _MODULES[hf_model_type(config)].hf_unsupported(config)


def _module(saved: dict, where: str):
    """hf_clip, hf_siglip or hf_siglip2, as the `config.json` at `where` (`saved`) names its model_type."""
    model_type = saved.get("model_type")
    if model_type not in _MODULES:
        raise InvalidInput(f"{where} is a transformers {model_type!r} model; clip_jax reads CLIPModel and SiglipModel "
                           f"folders, and Siglip2Model's (model_type {', '.join(repr(t) for t in _MODULES)})")
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


def clip_tokenizer_files(context_length: int) -> dict[str, str]:
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
    """The files `write_hf_files` writes for `config`: `HF_FILES` for a CLIP model; for a SigLIP (or SigLIP 2
    NaFlex) model its config, weights, image processor and its tokenizer's files (the names of `tokenizer_files`)."""
    if hf_model_type(config) == hf_clip.MODEL_TYPE:
        return HF_FILES
    _require_tokenizer(config, tokenizer_files)
    return tuple(dict.fromkeys((CONFIG, WEIGHTS[0], PREPROCESSOR, *tokenizer_files)))


def write_hf_files(folder: str, state_dict: dict, config: CLIPConfig, *, mean, std,
                   tokenizer_files: dict[str, bytes] | None = None, resize_mode="shortest") -> None:
    """Writes the CLIPModel, SiglipModel or Siglip2Model folder files of `config` (its OpenCLIP `state_dict`) into
    `folder`, which the caller has claimed (`clip_jax.runtime.ownership`) for `hf_files(config, tokenizer_files)`. A
    SigLIP model needs its tokenizer's files (`saved_tokenizer(tokenizer)`: name -> bytes). `resize_mode`: the eval
    transform the model is used with: "squash" writes SiglipImageProcessor's settings, "shortest"
    CLIPImageProcessor's (shortest side, center crop; a SiglipProcessor takes either), a NaFlex model's
    `NaFlexResize` Siglip2ImageProcessor's at its patch budget."""
    from clip_jax.interop.array_files import write_safetensors

    siglip = hf_model_type(config) != hf_clip.MODEL_TYPE
    if siglip:
        _require_tokenizer(config, tokenizer_files)
    module = _MODULES[hf_model_type(config)]
    squash = siglip and resize_mode == "squash"
    if hf_model_type(config) == hf_siglip2.MODEL_TYPE:
        budget = getattr(resize_mode, "max_num_patches", hf_siglip2.MAX_NUM_PATCHES)
        processor = naflex_preprocessor_config(config.vision.patch_size, budget, mean, std)
    else:
        processor = (siglip_preprocessor_config if squash else preprocessor_config)(config.vision.image_size, mean,
                                                                                     std)
    if siglip and not squash and "processor_class" not in processor:
        processor["processor_class"] = "SiglipProcessor"
    texts = {CONFIG: json.dumps(module.hf_config(config), indent=2) + "\n",  # refuses a model it cannot hold
             PREPROCESSOR: json.dumps(processor, indent=2) + "\n",
             **({} if siglip else clip_tokenizer_files(config.text.context_length))}
    write_safetensors(os.path.join(folder, WEIGHTS[0]), module.to_hf_state_dict(state_dict, config), {"format": "pt"})
    write_files(folder, {**(tokenizer_files if siglip else {}), **{n: t.encode("utf-8") for n, t in texts.items()}})
