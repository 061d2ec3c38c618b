"""SigLIP and SigLIP 2 tokenizers: SentencePiece vocabularies read from a model's own files.

SigLIP reads a T5-like unigram vocabulary (32k English, 250k multilingual), SigLIP 2 Gemma's 256k BPE one.
`SentencePieceTokenizer.from_folder` reads a Hugging Face model folder: the vocabulary from `tokenizer.json` with
`tokenizers` if present (OpenCLIP's `timm/` folders, SigLIP 2), else `spiece.model` (transformers' SiglipTokenizer) or
`tokenizer.model` (Gemma) with `sentencepiece`; the class, special tokens, `add_bos_token`, `add_eos_token`,
`padding_side`, `do_lower_case`, `model_max_length` from `tokenizer_config.json` and `special_tokens_map.json`;
OpenCLIP's cleaning (its HFTokenizer's default: "whitespace") and length from `open_clip_config.json` if present.

A row is `[BOS] tokens [EOS] pad pad ...` (int32, `context_length` long), what `AutoTokenizer.from_pretrained(folder)(
texts, padding="max_length", truncation=True, max_length=context_length)` returns: a caption too long keeps its first
`context_length - specials` tokens and still ends in EOS (transformers cuts the text tokens, then adds the special
ones; big_vision's configs say `eos="sticky"`). Padding is on the folder's `padding_side`.

Cleaning (`clean`, `clean_text`) runs on each caption first. "canonicalize", "lower", "whitespace": OpenCLIP's
(open_clip/tokenizer.py); its SigLIP and SigLIP 2 models use "canonicalize": ftfy, HTML-unescape twice, strip; "_" to
spaces, ASCII punctuation removed, lowercase, whitespace runs to one space. "siglip" ("siglip-cased": no lowercasing):
SiglipTokenizer's own (lowercase when `do_lower_case`, ASCII punctuation removed, whitespace runs to one space), a
SiglipTokenizer folder's default. "none": other folders' (a SigLIP 2 `tokenizer.json` lowercases in its normalizer).

Facts the rows rely on (transformers 5.25, OpenCLIP 3.3.0, sentencepiece 0.2):
- SigLIP: `<pad>` 0, `</s>` 1, `<unk>` 2, no BOS; rows pad with `</s>` (SiglipTokenizer's `pad_token="</s>"`,
  SiglipTextConfig's `pad_token_id=1`, OpenCLIP's SigLipTokenizer's `pad_token_id = 1`, big_vision's
  `pad_value=1`). SiglipTokenizer encodes `"<unk>" + "▁" + text` ("▁" read as a space, whitespace runs made one) and
  drops the pieces of "<unk>"; the `spiece.model` route does the same, so ties between segmentations resolve alike.
- SigLIP 2: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4 (GemmaTokenizer's defaults, GemmaConverter's unk
  id); no BOS, EOS appended, right padding (OpenCLIP's SigLipTokenizer builds Gemma's with `add_bos_token=False,
  add_eos_token=True, padding_side="right"`; big_vision: `bos="no", eos="sticky"`). Where a folder does not say,
  transformers' GemmaTokenizer adds neither and pads on the left.
- Special-token strings in a caption ("</s>", "<pad>") are text, as with transformers' `split_special_tokens=True`:
  sentencepiece never matches control pieces in text; a unigram `tokenizer.json` may still pick the pieces "</s>"
  and "<unk>", as T5's fast tokenizer does. "canonicalize" and "siglip" remove their "<", "/" and ">".
- A unigram vocabulary's two routes give their transformers class's ids (`tokenizer.json`: T5's fast tokenizer;
  `spiece.model`: SiglipTokenizer), which differ on a few captions: where NFKC puts a space before combining marks
  ("´" is " ́"), and where two segmentations tie and float sums round differently.
"""

import html
import io
import json
import re
import string
from collections.abc import Iterable
from pathlib import Path

import ftfy
import numpy as np
import tokenizers

from clip_jax.errors import InvalidInput, MissingInput, require_extra
from clip_jax.text.clip_tokenizer import check_captions, is_plain_ascii

CONTEXT_LENGTH = 64  # SigLIP's and SigLIP 2's text length
TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model")  # in the order they are looked for
CLEAN_MODES = ("canonicalize", "lower", "whitespace", "siglip", "siglip-cased", "none")
STYLES = ("siglip", "gemma")

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_WHITESPACE = re.compile(r"\s+")  # the same characters as str.isspace
_SANE_MAX_LENGTH = 1 << 20  # transformers writes model_max_length = 1e30 for "no limit"

# What transformers 5 assumes when a folder's config does not say.
_T5 = dict(eos_token="</s>", unk_token="<unk>", add_eos_token=True, padding_side="right")
_GEMMA = dict(eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", unk_token="<unk>", add_eos_token=False,
              padding_side="left")
_CLASS_DEFAULTS = {"SiglipTokenizer": dict(_T5, pad_token="</s>"), "T5Tokenizer": dict(_T5, pad_token="<pad>"),
                   "GemmaTokenizer": _GEMMA, "Siglip2Tokenizer": _GEMMA}  # Siglip2's also lowercases
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def clean_text(text: str, mode: str) -> str:
    """`text` cleaned by `mode` (one of `CLEAN_MODES`, see the module docstring)."""
    if mode == "none":
        return text
    if mode in ("siglip", "siglip-cased"):
        text = text.lower() if mode == "siglip" else text
        return " ".join(text.translate(_PUNCTUATION).split())
    if not is_plain_ascii(text):  # else ftfy and HTML unescaping leave it as it is
        text = html.unescape(html.unescape(ftfy.fix_text(text)))
    text = text.strip()
    if mode == "canonicalize":
        return " ".join(text.replace("_", " ").translate(_PUNCTUATION).lower().split())
    text = " ".join(text.split())
    return text.lower() if mode == "lower" else text


class SentencePieceTokenizer:
    """A SigLIP / SigLIP 2 tokenizer: `tok(texts) -> int32 [N, context_length]`.

    Attributes: `vocab_size`, `pad_id`, `eos_id` and `bos_id` (None when rows have none), `context_length`,
    `clean` (the cleaning mode), `padding_side`. Build it with `from_folder` or `train_sentencepiece`.
    """

    def __init__(self, file_name: str, file_bytes: bytes, settings: dict, *, context_length: int, clean: str):
        self._file_name, self._file_bytes, self._settings = file_name, file_bytes, settings
        self.clean = _check_clean(clean)
        self.context_length = _check_context_length(context_length)
        self.padding_side = settings["padding_side"]
        if file_name == "tokenizer.json":
            self._encoder = _JsonEncoder(file_bytes, lowercase=settings["tokenizer_class"] == "Siglip2Tokenizer")
        else:
            self._encoder = _SentencePieceEncoder(file_bytes, settings)
        self.vocab_size = self._encoder.vocab_size
        self.pad_id = self._encoder.token_id(settings["pad_token"])
        if settings["add_eos_token"] is None:  # the tokenizer.json's post-processor says
            self._prefix, self._suffix = _template_ids(json.loads(file_bytes).get("post_processor"))
        else:
            self._prefix = [self._encoder.token_id(settings["bos_token"])] if settings["add_bos_token"] else []
            self._suffix = [self._encoder.token_id(settings["eos_token"])] if settings["add_eos_token"] else []
        self.bos_id = self._prefix[0] if self._prefix else None
        self.eos_id = self._suffix[-1] if self._suffix else None

    def __call__(
        self, texts: str | Iterable[str], context_length: int | None = None, *, return_truncated: bool = False
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Token ids of `texts`, int32 [N, context_length] (N = 1 for a single str; the tokenizer's own length when
        None). With `return_truncated=True` also returns bool [N]: whether a caption lost tokens to the length."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        check_captions(texts, who="the tokenizer")
        length = self.context_length if context_length is None else _check_context_length(context_length)
        room = length - len(self._prefix) - len(self._suffix)  # for text tokens
        if room < 0:
            raise InvalidInput(f"context_length must be at least {length - room} (room for BOS/EOS), got {length}")
        token_lists = self._encoder.encode([clean_text(text, self.clean) for text in texts])
        out = np.full((len(texts), length), self.pad_id, np.int32)
        for row, tokens in zip(out, token_lists):
            ids = self._prefix + tokens[:room] + self._suffix
            start = length - len(ids) if self.padding_side == "left" else 0
            row[start:start + len(ids)] = ids
        if return_truncated:
            return out, np.fromiter((len(tokens) > room for tokens in token_lists), bool, len(texts))
        return out

    @classmethod
    def from_folder(
        cls, folder: str | Path, context_length: int | None = None, *, clean: str | None = None,
        file: str | None = None,
    ) -> "SentencePieceTokenizer":
        """The tokenizer of a Hugging Face (or OpenCLIP hub) model folder. `file`: one of `TOKENIZER_FILES`, else
        the first the folder has (a SiglipTokenizer folder's `spiece.model`, as transformers reads it).
        `context_length`: else OpenCLIP's, else a `model_max_length` below 2**20, else 64. `clean`: else OpenCLIP's,
        else the folder's own."""
        folder = Path(folder)
        config = _read_config(folder)
        present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        siglip = config["tokenizer_class"] == "SiglipTokenizer" and "spiece.model" in present  # as transformers
        file_name = file or ("spiece.model" if siglip else present[0])
        if file_name not in TOKENIZER_FILES:
            raise InvalidInput(f"file must be one of {', '.join(TOKENIZER_FILES)}, got {file_name!r}")
        if not (folder / file_name).is_file():
            raise MissingInput(f"{folder / file_name} does not exist; pass another file= or leave it out")
        file_bytes = (folder / file_name).read_bytes()
        file_json = _read_json(folder / file_name) if file_name == "tokenizer.json" else {}
        settings = _settings(config, file_name, file_json)
        open_clip = _read_json(folder / "open_clip_config.json").get("model_cfg", {}).get("text_cfg", {})
        if context_length is None:
            context_length = open_clip.get("context_length") or settings["model_max_length"] or CONTEXT_LENGTH
        if clean is None:  # OpenCLIP's HFTokenizer cleans with "whitespace" unless the config says
            own = "whitespace" if open_clip.get("hf_tokenizer_name") else settings["clean"]
            clean = (open_clip.get("tokenizer_kwargs") or {}).get("clean", own)
        return cls(file_name, file_bytes, settings, context_length=context_length, clean=clean)

    def save(self, folder: str | Path) -> list[str]:
        """Writes the vocabulary file, `tokenizer_config.json` and `special_tokens_map.json` into `folder` (created
        if missing), so that `transformers.AutoTokenizer.from_pretrained(folder)` gives these rows for captions
        cleaned by `self.clean` (for every caption when `clean` is the folder's own). The cleaning mode is not a
        transformers setting: give it to `from_folder` again. Never replaces a file; returns the paths written."""
        folder = Path(folder)
        files = {self._file_name: self._file_bytes, **self._config_files()}
        for name in files:
            if (folder / name).exists():
                raise InvalidInput(f"{folder / name} already exists; save the tokenizer into a new folder")
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            with open(folder / name, "xb") as f:
                f.write(data)
        return [str(folder / name) for name in files]

    def _config_files(self) -> dict[str, bytes]:
        settings = self._settings
        tokens = {name: settings[name] for name in _SPECIAL_TOKENS if settings[name] is not None}
        config = {"tokenizer_class": settings["tokenizer_class"], **tokens}
        if settings["add_eos_token"] is not None:  # else the tokenizer.json's post-processor says
            config.update(add_bos_token=self.bos_id is not None, add_eos_token=self.eos_id is not None)
        if settings["tokenizer_class"] == "SiglipTokenizer":
            config["do_lower_case"] = self.clean != "siglip-cased"
        # SigLIP's text tower was trained attending to the pads: its HF folders return no attention mask.
        config.update(padding_side=self.padding_side, model_max_length=self.context_length,
                      model_input_names=["input_ids"])
        return {"tokenizer_config.json": _json_bytes(config), "special_tokens_map.json": _json_bytes(tokens)}


def train_sentencepiece(
    captions: Iterable[str], folder: str | Path, vocab_size: int, style: str = "siglip", *,
    context_length: int = CONTEXT_LENGTH, clean: str | None = None,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece vocabulary on `captions` (cleaned), writes its files into `folder` with `save`, and
    returns its tokenizer. `style="siglip"`: T5-like unigram (nmt_nfkc, dummy prefix, `<pad>` 0, `</s>` 1, `<unk>` 2,
    no BOS), rows as SigLIP's, read by SiglipTokenizer, `clean` "siglip" by default, `vocab_size` an upper bound.
    `style="gemma"`: BPE with Gemma's options as GemmaConverter lists them (byte fallback, digits split, no dummy
    prefix, whitespace kept, no normalization; `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `<mask>` 4), rows as SigLIP
    2's, read by GemmaTokenizer, `clean` "none" by default, `vocab_size` at least 261 plus the captions' characters."""
    require_extra("sentencepiece", None, "train_sentencepiece")
    import sentencepiece

    if style not in STYLES:
        raise InvalidInput(f"style must be one of {', '.join(STYLES)}, got {style!r}")
    clean = _check_clean(clean or ("siglip" if style == "siglip" else "none"))
    captions = list(captions)
    check_captions(captions, who="train_sentencepiece")
    cleaned = [text for text in (clean_text(caption, clean) for caption in captions) if text]
    if not cleaned:
        raise InvalidInput(f"none of the {len(captions)} captions has text left after cleaning ({clean!r}); "
                           "give captions to train the vocabulary on")
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(cleaned), model_writer=model, vocab_size=vocab_size, minloglevel=2,
            **(_SIGLIP_TRAINING if style == "siglip" else _GEMMA_TRAINING),
        )
    except RuntimeError as error:
        detail = re.sub(r"^INTERNAL: .*?\] ", "", str(error).strip().splitlines()[0])  # its check, then its words
        raise InvalidInput(f"sentencepiece cannot train a {vocab_size}-piece {style} vocabulary from these "
                           f"captions ({detail}); change vocab_size or give more captions") from None
    file_name, class_name = _STYLE_FILES[style]
    config = {"tokenizer_class": class_name, "add_bos_token": False, "add_eos_token": True, "padding_side": "right"}
    tokenizer = SentencePieceTokenizer(file_name, model.getvalue(), _settings(config, file_name, {}),
                                       context_length=context_length, clean=clean)
    tokenizer.save(folder)
    return tokenizer


_STYLE_FILES = {"siglip": ("spiece.model", "SiglipTokenizer"), "gemma": ("tokenizer.model", "GemmaTokenizer")}
_SIGLIP_TRAINING = dict(
    model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
    unk_piece="<unk>", normalization_rule_name="nmt_nfkc", hard_vocab_limit=False,
)
_GEMMA_TRAINING = dict(
    model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
    bos_piece="<bos>", unk_piece="<unk>", control_symbols=["<mask>"], byte_fallback=True, split_digits=True,
    add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
    normalization_rule_name="identity",
)


class _JsonEncoder:
    """Text tokens from a `tokenizer.json`, as transformers' fast tokenizers compute them; added tokens are not
    matched in the text."""

    def __init__(self, file_bytes: bytes, *, lowercase: bool):
        self._tokenizer = tokenizers.Tokenizer.from_str(file_bytes.decode("utf-8"))
        self._tokenizer.no_padding()  # transformers saves the last call's padding and truncation in the file
        self._tokenizer.no_truncation()
        self._tokenizer.encode_special_tokens = True
        if lowercase:  # what transformers' Siglip2Tokenizer puts before the file's normalizer
            steps = [tokenizers.normalizers.Lowercase(), self._tokenizer.normalizer]
            self._tokenizer.normalizer = tokenizers.normalizers.Sequence([s for s in steps if s is not None])
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        return _known_id(self._tokenizer.token_to_id(token), token)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


class _SentencePieceEncoder:
    """Text tokens from a SentencePiece model, as transformers' SiglipTokenizer (for a model with a dummy prefix)
    or GemmaTokenizer (for one without) computes them."""

    def __init__(self, file_bytes: bytes, settings: dict):
        require_extra("sentencepiece", None, "reading a spiece.model or tokenizer.model vocabulary",
                      alternative="give a folder with a tokenizer.json")
        import sentencepiece

        self._model = sentencepiece.SentencePieceProcessor(model_proto=file_bytes)
        self._siglip_prefix = self._model.normalize("a").startswith("▁")
        self._unk = settings["unk_token"] or self._model.id_to_piece(self._model.unk_id())
        self._unk_length = len(self._model.encode(self._unk))
        self._lowercase = settings["tokenizer_class"] == "Siglip2Tokenizer"
        self.vocab_size = self._model.get_piece_size()

    def token_id(self, token: str) -> int:
        piece_id = self._model.piece_to_id(token)
        return _known_id(piece_id if self._model.id_to_piece(piece_id) == token else None, token)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._lowercase:  # tokenizers' Lowercase normalizer maps each character on its own
            texts = ["".join(char.lower() for char in text) for text in texts]
        if not self._siglip_prefix:
            return self._model.encode(texts)
        # SiglipTokenizer: "▁" + text ("▁" read as a space, whitespace runs made one), after "<unk>", whose pieces
        # are then dropped.
        prefixed = [self._unk + _WHITESPACE.sub(" ", "▁" + text.replace("▁", " ")).rstrip() for text in texts]
        return [ids[self._unk_length:] for ids in self._model.encode(prefixed)]


def _template_ids(post_processor: dict | None) -> tuple[list[int], list[int]]:
    """The ids a tokenizer.json's post-processor puts before and after a single text."""
    if not post_processor:
        return [], []
    if post_processor.get("type") != "TemplateProcessing":
        raise InvalidInput(f"tokenizer.json has a {post_processor.get('type')} post-processor; only "
                           "TemplateProcessing is read: set add_bos_token / add_eos_token in tokenizer_config.json")
    names = [piece["SpecialToken"]["id"] if "SpecialToken" in piece else None for piece in post_processor["single"]]
    ids = [post_processor["special_tokens"][name]["ids"] if name else None for name in names]
    text = ids.index(None)
    return sum(ids[:text], []), sum(ids[text + 1:], [])


def _known_id(token_id: int | None, token: str) -> int:
    if token_id is None:
        raise InvalidInput(f"the special token {token!r} is not in the vocabulary; fix tokenizer_config.json")
    return token_id


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        value = error
    if not isinstance(value, dict):
        raise InvalidInput(f"{path} is not a JSON object ({value}); restore it from the model's source")
    return value


def _read_config(folder: Path) -> dict:
    """special_tokens_map.json overlaid by tokenizer_config.json; the class named without "Fast"."""
    if not folder.is_dir():
        raise MissingInput(f"tokenizer folder {folder} does not exist; point at a model folder")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise MissingInput(f"{folder} has none of the tokenizer files {', '.join(TOKENIZER_FILES)}; point at the "
                           "model folder that holds them, or write one with train_sentencepiece")
    config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
    config["tokenizer_class"] = (config.get("tokenizer_class") or "").removesuffix("Fast") or None
    if _read_json(folder / "config.json").get("model_type") == "siglip2":  # transformers overrides the class named
        config["tokenizer_class"] = "Siglip2Tokenizer"
    return config


def _settings(config: dict, file_name: str, file_json: dict) -> dict:
    """What transformers 5 makes of a folder's config read with `file_name`: class, special tokens, BOS/EOS (None:
    the tokenizer.json's post-processor decides), padding side, length, the folder's own cleaning."""
    by_file = {"spiece.model": "SiglipTokenizer", "tokenizer.model": "GemmaTokenizer"}
    class_name = config.get("tokenizer_class") or by_file.get(file_name, "PreTrainedTokenizerFast")
    defaults = _CLASS_DEFAULTS.get(class_name, {})
    file_padding = file_json.get("padding") or {}
    out = {"tokenizer_class": class_name}
    for name in _SPECIAL_TOKENS:
        value = config.get(name, defaults.get(name))
        out[name] = value.get("content") if isinstance(value, dict) else value
    out["pad_token"] = out["pad_token"] or file_padding.get("pad_token")
    if out["pad_token"] is None:
        raise InvalidInput(f"the tokenizer config names no pad_token and {class_name} has no default; add one")
    if class_name == "SiglipTokenizer" and file_name == "spiece.model":  # it always appends EOS
        out.update(add_bos_token=False, add_eos_token=True)
    elif "add_bos_token" in config or "add_eos_token" in config or file_name != "tokenizer.json":
        out.update(add_bos_token=bool(config.get("add_bos_token", False)),
                   add_eos_token=bool(config.get("add_eos_token", defaults.get("add_eos_token", False))))
    else:
        out.update(add_bos_token=None, add_eos_token=None)
    side = config.get("padding_side") or file_padding.get("direction", "").lower() or defaults.get("padding_side")
    out["padding_side"] = side or "right"
    max_length = config.get("model_max_length")
    out["model_max_length"] = max_length if isinstance(max_length, int) and max_length < _SANE_MAX_LENGTH else None
    lower = config.get("do_lower_case", True)
    out["clean"] = ("siglip" if lower else "siglip-cased") if class_name == "SiglipTokenizer" else "none"
    return out


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _check_clean(clean: str | None) -> str:
    clean = "none" if clean is None else clean
    if clean not in CLEAN_MODES:
        raise InvalidInput(f"clean must be one of {', '.join(CLEAN_MODES)} or None, got {clean!r}")
    return clean


def _check_context_length(context_length: int) -> int:
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise InvalidInput(f"context_length must be a positive int, got {context_length!r}")
    return context_length

