"""The tokenizer a model's text tower reads: CLIP's BPE (`clip_jax.text.clip_tokenizer`) unless its config names
another (`TextConfig.tokenizer`, OpenCLIP's `hf_tokenizer_name`): then the SentencePiece tokenizer whose files that
folder holds (SigLIP's, SigLIP 2's Gemma: `clip_jax.text.sentencepiece_tokenizer`), cleaning as `tokenizer_clean`
says.

    tokenize = tokenizer_for(config)      # checked now: the folder is there, its vocabulary is the model's
    tokens = tokenize(["a photo of a cat"])   # int32 [1, context_length]

It reads a model's config (`clip_jax.models.CLIPConfig`) without importing the models, which import the tokenizers'
cleaning modes: `clip_jax.text` imports nothing of clip_jax's but its errors. A `ModelTokenizer` is a small frozen
value (a folder name, a cleaning, a length): it pickles into data-loading worker processes, each of which reads the
folder once. OpenCLIP's named SigLIP models name their tokenizer on the Hugging Face Hub, which clip_jax never
downloads: such a name is refused in one line saying which folder to give instead.
"""

import dataclasses
import functools
import os

from clip_jax.errors import InvalidInput, MissingInput

TOKENIZER_FIX = ("give a folder holding the model's tokenizer files (tokenizer.json or spiece.model, as a "
                 "transformers SiglipModel folder or an OpenCLIP hub folder has them): --config.tokenizer=FOLDER, or "
                 "open the model from such a folder")


@dataclasses.dataclass(frozen=True)
class ModelTokenizer:
    """`tokenizer(texts, context_length=None, *, return_truncated=False) -> int32 [N, L]` for one model: CLIP's BPE
    (`folder` None) or the SentencePiece tokenizer in `folder`. L: the model's context length unless given."""

    context_length: int
    folder: str | None = None
    clean: str | None = None  # None: the folder's own cleaning

    def __call__(self, texts, context_length: int | None = None, *, return_truncated: bool = False):
        length = self.context_length if context_length is None else context_length
        if self.folder is None:
            from clip_jax.text.clip_tokenizer import tokenize

            return tokenize(texts, context_length=length, return_truncated=return_truncated)
        return _read(self.folder, self.clean)(texts, length, return_truncated=return_truncated)

    @property
    def vocab_size(self) -> int:
        if self.folder is None:
            from clip_jax.text.clip_tokenizer import VOCAB_SIZE

            return VOCAB_SIZE
        return _read(self.folder, self.clean).vocab_size


@functools.lru_cache(maxsize=8)
def _read(folder: str, clean: str | None):
    from clip_jax.text.sentencepiece_tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer.from_folder(folder, clean=clean)


def holds_tokenizer(folder: str) -> bool:
    """Whether `folder` holds a SentencePiece tokenizer's vocabulary file."""
    from clip_jax.text.sentencepiece_tokenizer import TOKENIZER_FILES

    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def tokenizer_for(config) -> ModelTokenizer:
    """The tokenizer of `config`'s text tower; a folder's is checked: it holds a tokenizer, whose vocabulary is the
    text tower's. (CLIP's BPE is not checked here: a test-sized tower may read other ids; `check_vocabulary`.)"""
    text = config.text
    folder, clean = text.tokenizer, text.tokenizer_clean
    if folder is None:
        return ModelTokenizer(text.context_length)
    if not os.path.isdir(folder):
        hub = "/" in folder and not os.path.isabs(folder) and not folder.startswith(".")
        what = "a Hugging Face Hub name, which clip_jax does not download" if hub else "not a folder"
        raise MissingInput(f"{config.name}'s tokenizer {folder} is {what}: {TOKENIZER_FIX}")
    if not holds_tokenizer(folder):
        from clip_jax.text.sentencepiece_tokenizer import TOKENIZER_FILES

        raise MissingInput(f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): {TOKENIZER_FIX}")
    tokenizer = ModelTokenizer(text.context_length, os.path.abspath(folder), clean)
    check_vocabulary(config, tokenizer, folder)
    return tokenizer


def with_folder_tokenizer(config, folder: str | None):
    """`config` reading its tokenizer from `folder` (with the folder's own cleaning), when the folder holds one and
    the model is not read by CLIP's BPE (a transformers CLIPModel folder may hold a `tokenizer.json` too)."""
    from clip_jax.text.clip_tokenizer import VOCAB_SIZE

    if not folder or not os.path.isdir(folder) or not holds_tokenizer(folder):
        return config
    if config.text.tokenizer is None and config.text.vocab_size == VOCAB_SIZE:
        return config
    text = dataclasses.replace(config.text, tokenizer=os.path.abspath(folder), tokenizer_clean=None)
    return dataclasses.replace(config, text=text)


def with_run_tokenizer(config, run_config):
    """The model of a run with the tokenizer the run reads: its `tokenizer` folder when set, else its pretrained
    folder's when that holds one (a SigLIP start), else the model config's own."""
    folder = run_config.get("tokenizer") or ""
    if folder:
        text = dataclasses.replace(config.text, tokenizer=folder, tokenizer_clean=None)
        return dataclasses.replace(config, text=text)
    return with_folder_tokenizer(config, run_config.get("pretrained") or None)


def check_vocabulary(config, tokenizer: ModelTokenizer, where: str = "") -> None:
    """Refuses a tokenizer whose vocabulary is not the text tower's: CLIP's BPE for a SigLIP model, or the reverse."""
    theirs, ours = tokenizer.vocab_size, config.text.vocab_size
    if theirs == ours or (tokenizer.folder is None and ours >= theirs):
        return
    if tokenizer.folder is None:
        raise InvalidInput(f"model {config.name!r} has a text vocabulary of {ours} tokens, fewer than the {theirs} of "
                           f"CLIP's BPE tokenizer; it cannot encode prompts or captions (a SigLIP model: "
                           f"{TOKENIZER_FIX})")
    raise InvalidInput(f"the tokenizer in {where} has {theirs:,} tokens but {config.name}'s text tower {ours:,}: it "
                       "is another model's; give the model its own tokenizer")
