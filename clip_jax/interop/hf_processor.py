"""A transformers folder's image processor: what clip_jax's eval transforms read of it, and what they write.

`hf_preprocessing(folder)` reads the image processor, refusing in one line what clip_jax's transforms do not do:
CLIPImageProcessor's shortest side and center crop, SiglipImageProcessor's squash to a square ("squash"), and
Siglip2ImageProcessor's NaFlex resize (the image at its own aspect ratio within `max_num_patches` patches,
`resize_mode` "naflex"). transformers 5's `processor_config.json` (its "image_processor") is read first, then the
older `preprocessor_config.json`; a folder with neither gets its model's image processor's defaults
(`assumed_preprocessing`), which `missing_processor_note` names in one line. `preprocessor_config` and
`siglip_preprocessor_config` are the settings an export writes.
"""

import json
import os

from clip_jax.errors import InvalidInput
from clip_jax.interop import hf_siglip, hf_siglip2
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD

CONFIG = "config.json"
PREPROCESSOR = "preprocessor_config.json"  # the image processor's settings, as transformers 4 saves them
PROCESSOR = "processor_config.json"  # transformers 5's processor: the image processor under "image_processor"
_BICUBIC = 3  # PIL's Resampling.BICUBIC, as transformers' image processors name the resampling
_BILINEAR = 2  # PIL's Resampling.BILINEAR: Siglip2ImageProcessor's default
NAFLEX = "naflex"  # the `resize_mode` of a NaFlex model's preprocessing (`clip_jax.data.naflex.NaFlexResize`)
DEFAULT_MAX_NUM_PATCHES = hf_siglip2.MAX_NUM_PATCHES  # Siglip2ImageProcessor's default patch budget
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


def hf_preprocessing(folder: str) -> dict:
    """The preprocessing of a transformers folder's image processor, refusing what clip_jax's transforms do not do:
    for CLIPImageProcessor's resize of the shortest side (and center crop) the `mean` and `std` it names; for
    SiglipImageProcessor's resize of the whole image to a square (`size` {height, width}, no crop) its `mean` and
    `std` (SiglipImageProcessor's 0.5 where it names none) and `resize_mode` "squash"
    (`clip_jax.data.transforms.eval_crop`). The image processor is read from transformers 5's
    `processor_config.json` (under "image_processor") first, else from the older `preprocessor_config.json`; a folder
    with neither gets the defaults of its model's image processor (`assumed_preprocessing`)."""
    found = _image_processor(folder)
    if found is None:
        return assumed_preprocessing(folder)
    saved, path = found
    if _naflex_processor(saved, folder):
        return _naflex_preprocessing(saved, path)
    siglip = _siglip_processor(saved, folder)
    size = saved.get("size", {"height": 224, "width": 224} if siglip else None)
    if isinstance(size, dict) and ("height" in size or "width" in size):
        return _squash_preprocessing(saved, size, path, siglip)
    return _shortest_preprocessing(saved, path)


def _image_processor(folder: str) -> tuple[dict, str] | None:
    """(the image processor's settings, where they were read) of a transformers folder, None when it has none."""
    processor = os.path.join(folder, PROCESSOR)
    if os.path.isfile(processor):
        nested = _read_json(processor).get("image_processor")
        if isinstance(nested, dict):
            return nested, f"{processor} (its image_processor)"
    path = os.path.join(folder, PREPROCESSOR)
    return (_read_json(path), path) if os.path.isfile(path) else None


def _model_type(folder: str) -> str | None:
    try:
        return _read_json(os.path.join(folder, CONFIG)).get("model_type")
    except (InvalidInput, OSError):
        return None


def _is_siglip_folder(folder: str) -> bool:
    return _model_type(folder) == hf_siglip.MODEL_TYPE


def assumed_preprocessing(folder: str) -> dict:
    """What a folder without an image processor is read with: its model's image processor's defaults
    (SiglipImageProcessor's squash and mean/std 0.5 for a SiglipModel, CLIPImageProcessor's shortest side, center
    crop and OpenAI's mean/std for a CLIPModel), at the model's image size."""
    if _model_type(folder) == hf_siglip2.MODEL_TYPE:
        return {"mean": _SIGLIP_MEAN, "std": _SIGLIP_STD, "resize_mode": NAFLEX,
                "max_num_patches": DEFAULT_MAX_NUM_PATCHES}
    if _is_siglip_folder(folder):
        return {"mean": _SIGLIP_MEAN, "std": _SIGLIP_STD, "resize_mode": "squash"}
    return {"mean": OPENAI_MEAN, "std": OPENAI_STD}


def missing_processor_note(folder: str, image_size: int) -> str | None:
    """The line saying what a folder without an image processor is read with (None when it has one)."""
    if _image_processor(folder) is not None:
        return None
    assumed = assumed_preprocessing(folder)
    kind = {hf_siglip.MODEL_TYPE: "SiglipImageProcessor", hf_siglip2.MODEL_TYPE: "Siglip2ImageProcessor"}.get(
        _model_type(folder), "CLIPImageProcessor")
    resize = {"squash": f"the whole image squashed to {image_size} x {image_size} px",
              NAFLEX: f"the image at its own aspect ratio within {assumed.get('max_num_patches')} patches"}.get(
        assumed.get("resize_mode"), f"the shortest side to {image_size} px, then a {image_size} px center crop")
    numbers = lambda xs: "(" + ", ".join(f"{x:.4g}" for x in xs) + ")"  # noqa: E731
    return (f"{folder} has no image processor ({PROCESSOR} or {PREPROCESSOR}): assuming {kind}'s defaults: size "
            f"{image_size}, mean {numbers(assumed['mean'])}, std {numbers(assumed['std'])}, resize {resize} "
            "(save the model's processor beside it, or give --mean/--std, to read it otherwise)")


def _siglip_processor(saved: dict, folder: str) -> bool:
    """Whether the image processor takes SiglipImageProcessor's defaults (else CLIPImageProcessor's): as its
    `image_processor_type` says, else as the folder's model_type."""
    kind = saved.get("image_processor_type")
    if isinstance(kind, str) and kind.startswith(("Siglip", "CLIP")):
        return kind.startswith("Siglip")
    return _is_siglip_folder(folder)


def _naflex_processor(saved: dict, folder: str) -> bool:
    """Whether the image processor is SigLIP 2's NaFlex one: as its `image_processor_type` says, else as the
    folder's model_type."""
    kind = saved.get("image_processor_type")
    if isinstance(kind, str) and kind.startswith(("Siglip", "CLIP")):
        return kind.startswith("Siglip2")
    return _model_type(folder) == hf_siglip2.MODEL_TYPE


def _naflex_preprocessing(saved: dict, path: str) -> dict:
    """Siglip2ImageProcessor's settings: the image at its own aspect ratio within `max_num_patches` patches
    (antialiased bilinear), scaled to [0, 1], normalised; its `mean`, `std` and `max_num_patches`."""
    budget = saved.get("max_num_patches", DEFAULT_MAX_NUM_PATCHES)
    problems = [
        f"max_num_patches={budget!r} must be a positive whole number"
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1 else None,
        f"resample={saved.get('resample')}; clip_jax's NaFlex transform resizes bilinearly, antialiased, as "
        f"Siglip2ImageProcessor's default does (resample {_BILINEAR})"
        if saved.get("resample", _BILINEAR) != _BILINEAR else None,
        "do_resize=false: the images are left at their size; clip_jax's NaFlex transform fits them to the patch "
        "budget" if not saved.get("do_resize", True) else None,
        *_scaling_problems(saved),
    ]
    _refuse_first(problems, path)
    stats = {k: tuple(float(x) for x in saved.get(f"image_{k}", _SIGLIP_MEAN)) for k in ("mean", "std")}
    return {**stats, "resize_mode": NAFLEX, "max_num_patches": budget}


def _scaling_problems(saved: dict) -> list[str | None]:
    """What an image processor does to the resized pixels that clip_jax's transforms do not (None: nothing)."""
    factor = saved.get("rescale_factor", 1 / 255)
    return [
        f"do_rescale / rescale_factor: the pixels are not scaled by 1/255 (do_rescale {saved.get('do_rescale')}, "
        f"rescale_factor {saved.get('rescale_factor')}), as clip_jax's transforms scale them"
        if not saved.get("do_rescale", True) or not isinstance(factor, (int, float)) or abs(factor - 1 / 255) > 1e-12
        else None,
        "do_normalize=false: the pixels are not normalised; clip_jax's transforms normalise with a mean and std"
        if not saved.get("do_normalize", True) else None,
    ]


def _refuse_first(problems: list[str | None], path: str) -> None:
    """Raises the first of `problems` (None: none) in one line naming `path`."""
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise InvalidInput(f"{path}: {problem}")


def _squash_preprocessing(saved: dict, size: dict, path: str, siglip: bool) -> dict:
    """A resize of the whole image to `size` {height, width}, as SiglipImageProcessor does."""
    height, width = size.get("height"), size.get("width")
    crop = saved.get("crop_size") or {"height": 224, "width": 224}
    crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)
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
        *_scaling_problems(saved),
    ]
    _refuse_first(problems, path)
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


def naflex_preprocessor_config(patch_size: int, max_num_patches: int, mean, std) -> dict:
    """Siglip2ImageProcessor's settings for clip_jax's NaFlex eval transform: the image at its own aspect ratio
    within `max_num_patches` patches of `patch_size` (bilinear, antialiased), scale to [0, 1], normalise."""
    return {"image_processor_type": "Siglip2ImageProcessor", "processor_class": "Siglip2Processor",
            "do_convert_rgb": True, "do_resize": True, "patch_size": int(patch_size),
            "max_num_patches": int(max_num_patches), "resample": _BILINEAR, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [float(x) for x in mean],
            "image_std": [float(x) for x in std]}
