"""A model opened from a path (`clip_jax.interop.opener.open_model`): its config, preprocessing, weights and
tokenizer, and, for a NaFlex model, the patch budget its images are read at (`--max_num_patches`)."""

import copy
import functools

from clip_jax.data.naflex import NaFlexResize, check_budget
from clip_jax.errors import InvalidInput
from clip_jax.interop.hf_processor import DEFAULT_MAX_NUM_PATCHES
from clip_jax.models.config import CLIPConfig, is_resnet
from clip_jax.normalization import OPENAI_MEAN, OPENAI_STD


class OpenedModel:
    """A model a path holds (`open_model`): its `config`, the `preprocessing` it was trained with, its `variables()`
    (read when asked: a checkpoint may be large) and its `tokenizer`."""

    def __init__(self, source, config: CLIPConfig, max_num_patches: int | None = None):
        self.source, self.config, self._max_num_patches = source, config, max_num_patches

    @property
    def path(self) -> str:
        return self.source.path

    @functools.cached_property
    def preprocessing(self) -> dict:
        return self.source.preprocessing()

    def normalization(self, mean=None, std=None) -> tuple[tuple, tuple]:
        """(mean, std) of the images: those given, else those the model was trained with, else OpenAI's."""
        return (tuple(mean or self.preprocessing.get("mean") or OPENAI_MEAN),
                tuple(std or self.preprocessing.get("std") or OPENAI_STD))

    @property
    def naflex(self) -> bool:
        return not is_resnet(self.config) and self.config.vision.naflex

    @property
    def resize_mode(self):
        """The eval transform's resize: "shortest" side then a center crop, "squash" (a SigLIP folder's), or a NaFlex
        model's `NaFlexResize` at `max_num_patches`."""
        if self.naflex:
            return NaFlexResize(self.config.vision.patch_size, self.max_num_patches)
        return self.preprocessing.get("resize_mode", "shortest")

    @property
    def max_num_patches(self) -> int | None:
        """A NaFlex model's patch budget: the command's `--max_num_patches`, else its image processor's, else
        Siglip2ImageProcessor's default (256). None for a model of one image size."""
        if not self.naflex:
            return None
        return self._max_num_patches or self.preprocessing.get("max_num_patches") or DEFAULT_MAX_NUM_PATCHES

    def at_budget(self, max_num_patches: int | None) -> "OpenedModel":
        """This model read at a `--max_num_patches` (None: its own budget), refused in one line for a model of one
        image size or a budget below one patch."""
        if max_num_patches is None:
            return self
        if not self.naflex:
            raise InvalidInput(f"--max_num_patches {max_num_patches}: {self.config.name} is not a NaFlex model (it "
                               f"reads images at {self.config.vision.image_size} px); leave --max_num_patches out")
        check_budget(max_num_patches)
        opened = copy.copy(self)  # keeps the preprocessing read already (a folder's processor is read once)
        opened._max_num_patches = max_num_patches
        return opened

    def budget_clause(self) -> str:
        """", at N patches" for a NaFlex model (a command's summary line names the budget), else ""."""
        return f", at {self.max_num_patches} patches" if self.naflex else ""

    def variables(self) -> dict:
        return self.source.variables(self.config)

    @property
    def tokenizer(self):
        """`tokenizer(texts) -> int32 [N, context_length]`: the model's own (`clip_jax.text.model_tokenizer`),
        checked."""
        from clip_jax.text.model_tokenizer import tokenizer_for

        return tokenizer_for(self.config)


def add_budget_argument(parser) -> None:
    """`--max_num_patches N`, which every command reading images with a model takes (a NaFlex model's only)."""
    parser.add_argument("--max_num_patches", type=int, help="a NaFlex model's patch budget per image (default: "
                        f"its image processor's, else {DEFAULT_MAX_NUM_PATCHES}); refused for other models")
