"""The SigLIP / SigLIP 2 tokenizers give transformers' ids and OpenCLIP's cleaning, from either vocabulary file.

Two toy vocabularies are trained once from generated captions: a SigLIP-style unigram one (read by transformers'
SiglipTokenizer) and a Gemma-style BPE one (read by GemmaTokenizer). The references are transformers' tokenizers
loaded from the written folders, OpenCLIP's cleaning functions and HFTokenizer, and tokenizer.json files written by
transformers itself.
"""

import functools
import json
import random
import shutil

import numpy as np
import pytest
import transformers
from open_clip import tokenizer as open_clip_tokenizer

from clip_jax.errors import InvalidInput, MissingInput
from clip_jax.text.sentencepiece_tokenizer import (
    CONTEXT_LENGTH,
    TOKENIZER_FILES,
    SentencePieceTokenizer,
    clean_text,
    train_sentencepiece,
)

pytest.importorskip("sentencepiece")

_WORDS = """a an the photo picture of cat dog bird horse two three people man woman child sitting standing running on
in near with under red blue green yellow black white old new small big table street city beach river mountain sky
sunset night car bus train house window tree flower food plate cup water""".split()
_SCRIPTS = [
    "café", "naïve", "Zürich", "Straße", "İstanbul", "ΣΊΣΥΦΟΣ", "Σίσυφος", "Москва", "привет", "שָׁלוֹם", "مرحبا",
    "हिन्दी", "ภาษาไทย", "東京タワー", "北京烤鸭", "서울특별시", "ｶﾀｶﾅ", "ＦＵＬＬＷＩＤＴＨ", "１２３", "ﬁ", "½", "Ⅻ", "①②",
    "e\u0301", "\u212a", "ẞ", "ǅ", "𝔘𝔫𝔦",
]
_EMOJI = ["😀", "🐱", "❤️", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇺🇸", "★★★", "🤖🦄"]
_ODD = [
    "&amp;", "&amp;amp;", "&amp;lt;3", "&lt;b&gt;", "&quot;hi&quot;", "&#233;", "R&amp;D", "AT&T", "â€™", "Ã©",
    "snake_case", "__init__",
    "don't", "e-mail", "U.S.A.", "C++", "$19.99", "50%", "#tag", "@user", "3.14", "2024-01-02", "1,000,000",
    "▁", "a▁b", "</s>", "<unk>", "<pad>", "<eos>", "<bos>", "<mask>", "´", "¨", "™", "…", "—", "“quoted”",
    "\u200b", "\u00a0", "\u3000", "\t", "\n", "\r\n", "\x00", "\x1c", "\ufeff",
]
_PUNCTUATION = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def _captions(count: int, seed: int) -> list[str]:
    """Captions of every kind: ordinary, long (past 64 tokens), empty, whitespace or punctuation only, digits,
    scripts, emoji, HTML entities, mojibake, special-token strings."""
    rng = random.Random(seed)
    captions = ["", " ", " \t\n ", ".", "!!!", "...", "a", "A", "0", "1234567890", "😀", "東京", "▁", "</s>", "_",
                "with´\u0301dogwater", "a ¨\u0301 b"]  # NFKC: a space before combining marks
    while len(captions) < count:
        fragments = []
        for _ in range(rng.choice([1, 2, 4, 8, 12, 20, 40, 80])):
            kind = rng.random()
            if kind < 0.55:
                fragment = rng.choice(_WORDS)
            elif kind < 0.62:
                fragment = rng.choice(_WORDS).upper() if rng.random() < 0.5 else rng.choice(_WORDS).title()
            elif kind < 0.70:
                fragment = str(rng.randrange(10 ** rng.randint(1, 9)))
            elif kind < 0.77:
                fragment = rng.choice(_PUNCTUATION) * rng.randint(1, 3)
            elif kind < 0.85:
                fragment = rng.choice(_SCRIPTS)
            elif kind < 0.90:
                fragment = rng.choice(_EMOJI)
            else:
                fragment = rng.choice(_ODD)
            fragments.append(fragment)
        caption = rng.choice([" ", " ", " ", "", "  ", ", ", "_", "\t"]).join(fragments)
        captions.append(f" {caption} " if rng.random() < 0.1 else caption)
    return captions


CAPTIONS = _captions(3200, seed=1)


@functools.cache
def _cleaned(mode: str) -> tuple[str, ...]:
    """CAPTIONS cleaned by `mode`, once."""
    return tuple(clean_text(caption, mode) for caption in CAPTIONS)


def _hf_rows(hf_tokenizer, texts: list[str], length: int = CONTEXT_LENGTH) -> np.ndarray:
    """transformers' rows for texts already cleaned; special-token strings in them read as text, as ours read."""
    encoded = hf_tokenizer(texts, padding="max_length", truncation=True, max_length=length, split_special_tokens=True)
    return np.asarray(encoded["input_ids"], np.int32)


def _assert_same_rows(ours: np.ndarray, reference: np.ndarray, texts: list[str]) -> None:
    mismatched = np.flatnonzero((ours != reference).any(axis=1))
    if mismatched.size:
        first = mismatched[0]
        pytest.fail(f"{mismatched.size} of {len(texts)} rows differ; first {texts[first]!r}:\n"
                    f"ours      {ours[first].tolist()}\nreference {reference[first].tolist()}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two toy vocabularies, trained from captions other than the test captions, and their folders."""
    root = tmp_path_factory.mktemp("vocabularies")
    training = _captions(3000, seed=2)
    siglip = train_sentencepiece(training, root / "siglip", vocab_size=600, style="siglip")
    gemma = train_sentencepiece(training, root / "gemma", vocab_size=1000, style="gemma")
    return {"siglip": (root / "siglip", siglip), "gemma": (root / "gemma", gemma)}


@pytest.fixture(scope="module")
def json_folders(folders, tmp_path_factory):
    """The same vocabularies with a tokenizer.json that transformers wrote beside the SentencePiece file: SigLIP's
    as T5's fast tokenizer padding with `</s>` (OpenCLIP's `timm/` SigLIP folders; its config left as transformers
    writes it), Gemma's as transformers saves the GemmaTokenizer it read (SigLIP 2's folders; our config)."""
    root = tmp_path_factory.mktemp("json")
    t5_source = root / "t5_source"
    t5_source.mkdir()
    shutil.copy(folders["siglip"][0] / "spiece.model", t5_source / "spiece.model")
    (t5_source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "legacy": False, "pad_token": "</s>"}))
    for source, saved in ((t5_source, root / "siglip"), (folders["gemma"][0], root / "gemma_saved")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        tokenizer(["a"], padding="max_length", truncation=True, max_length=12)  # transformers saves this call's
        tokenizer.save_pretrained(saved)  # padding and truncation in tokenizer.json
    shutil.copy(t5_source / "spiece.model", root / "siglip" / "spiece.model")
    shutil.copytree(folders["gemma"][0], root / "gemma")
    shutil.copy(root / "gemma_saved" / "tokenizer.json", root / "gemma" / "tokenizer.json")
    return {"siglip": root / "siglip", "gemma": root / "gemma"}


@pytest.mark.parametrize("style, clean", [
    ("siglip", "canonicalize"), ("siglip", "siglip"), ("gemma", "canonicalize"), ("gemma", "none"),
])
def test_rows_match_transformers(folders, style, clean):
    folder, _ = folders[style]
    tokenizer = SentencePieceTokenizer.from_folder(folder, clean=clean)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    texts = list(_cleaned(clean))
    rows, truncated = tokenizer(CAPTIONS, return_truncated=True)
    assert rows.dtype == np.int32 and rows.shape == (len(CAPTIONS), CONTEXT_LENGTH)
    _assert_same_rows(rows, _hf_rows(reference, texts), texts)
    assert 0.05 < truncated.mean() < 0.6  # the captions do test truncation
    assert (rows[truncated, -1] == tokenizer.eos_id).all()  # EOS survives it
    short = tokenizer(CAPTIONS[:800], context_length=16)
    _assert_same_rows(short, _hf_rows(reference, texts[:800], 16), texts[:800])


def test_ids_and_layout_of_the_styles(folders):
    siglip, gemma = folders["siglip"][1], folders["gemma"][1]
    assert (siglip.pad_id, siglip.eos_id, siglip.bos_id, siglip.clean) == (1, 1, None, "siglip")
    assert (gemma.pad_id, gemma.eos_id, gemma.bos_id, gemma.clean) == (0, 1, None, "none")
    for tokenizer in (siglip, gemma):
        assert tokenizer.context_length == CONTEXT_LENGTH and tokenizer.padding_side == "right"
        empty = tokenizer("")
        assert empty.shape == (1, CONTEXT_LENGTH) and empty[0, 0] == tokenizer.eos_id
        assert (empty[0, 1:] == tokenizer.pad_id).all()


@pytest.mark.parametrize("mode", ["canonicalize", "lower", "whitespace"])
def test_cleaning_matches_open_clip(mode):
    reference = open_clip_tokenizer.get_clean_fn(mode)
    mismatched = [caption for caption, ours in zip(CAPTIONS, _cleaned(mode)) if ours != reference(caption)]
    assert not mismatched, f"{len(mismatched)} captions differ, first {mismatched[0]!r}"


def test_siglip_cleaning_matches_siglip_tokenizer(folders):
    reference = transformers.AutoTokenizer.from_pretrained(folders["siglip"][0])
    for cased in (False, True):
        reference.do_lower_case = not cased
        mode = "siglip-cased" if cased else "siglip"
        mismatched = [c for c in CAPTIONS if clean_text(c, mode) != reference.canonicalize_text(c)]
        assert not mismatched, f"{mode}: {len(mismatched)} captions differ, first {mismatched[0]!r}"


@pytest.mark.parametrize("clean", ["canonicalize", "none"])
def test_bpe_file_routes_agree(json_folders, clean):
    """Gemma's tokenizer.json read by `tokenizers` and its tokenizer.model read by `sentencepiece` give the same
    rows, transformers' rows (all given the captions cleaned)."""
    folder, texts = json_folders["gemma"], list(_cleaned(clean))
    from_json = SentencePieceTokenizer.from_folder(folder, clean="none", file="tokenizer.json")
    from_model = SentencePieceTokenizer.from_folder(folder, clean="none", file="tokenizer.model")
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    json_rows = from_json(texts)
    _assert_same_rows(json_rows, _hf_rows(reference, texts), texts)
    _assert_same_rows(from_model(texts), json_rows, texts)
    assert from_json.vocab_size == from_model.vocab_size == len(reference)


@pytest.mark.parametrize("clean", ["canonicalize", "siglip"])
def test_unigram_file_routes_differ_where_transformers_classes_differ(folders, json_folders, clean):
    """SigLIP's vocabulary read from tokenizer.json gives the rows of transformers' T5 fast tokenizer, read from
    spiece.model those of its SiglipTokenizer. The two differ on a few captions: where NFKC makes whitespace ("´" is
    " ́") and where two segmentations tie and the float sums round differently. Ours differ on exactly those."""
    texts = list(_cleaned(clean))
    from_json = SentencePieceTokenizer.from_folder(json_folders["siglip"], clean="none")  # tokenizer.json first
    from_model = SentencePieceTokenizer.from_folder(json_folders["siglip"], clean="none", file="spiece.model")
    t5_rows = _hf_rows(transformers.AutoTokenizer.from_pretrained(json_folders["siglip"]), texts)
    siglip_rows = _hf_rows(transformers.AutoTokenizer.from_pretrained(folders["siglip"][0]), texts)
    json_rows, model_rows = from_json(texts), from_model(texts)
    _assert_same_rows(json_rows, t5_rows, texts)
    _assert_same_rows(model_rows, siglip_rows, texts)
    ours_differ = (json_rows != model_rows).any(axis=1)
    np.testing.assert_array_equal(ours_differ, (t5_rows != siglip_rows).any(axis=1))
    assert ours_differ.mean() < 0.03


@pytest.mark.parametrize("file, named_by", [
    ("tokenizer.json", "tokenizer_config.json"), ("tokenizer.model", "tokenizer_config.json"),
    ("tokenizer.json", "config.json"),
])
def test_siglip2_folder_lowercases_as_transformers(json_folders, tmp_path, file, named_by):
    """A SigLIP 2 folder (Siglip2Tokenizer named, or a siglip2 model config beside GemmaTokenizer's) lowercases each
    character before the vocabulary, as transformers' Siglip2Tokenizer does."""
    folder = tmp_path / "siglip2"
    shutil.copytree(json_folders["gemma"], folder)
    if named_by == "config.json":
        (folder / "config.json").write_text(json.dumps({"model_type": "siglip2"}))
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Siglip2Tokenizer"}))
    if file == "tokenizer.model":
        (folder / "tokenizer.json").unlink()
    tokenizer = SentencePieceTokenizer.from_folder(folder, file=file)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert type(reference).__name__ == "Siglip2Tokenizer" and tokenizer.clean == "none"
    _assert_same_rows(tokenizer(CAPTIONS), _hf_rows(reference, CAPTIONS), CAPTIONS)


def test_unsaid_settings_are_transformers_defaults(folders, tmp_path):
    """A Gemma folder whose config names only the class: transformers adds neither BOS nor EOS and pads on the
    left; a vocabulary file alone is read as the class its name belongs to."""
    (tmp_path / "gemma").mkdir()
    shutil.copy(folders["gemma"][0] / "tokenizer.model", tmp_path / "gemma")
    (tmp_path / "gemma" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))
    tokenizer = SentencePieceTokenizer.from_folder(tmp_path / "gemma")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.padding_side) == (None, None, "left")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "gemma")
    _assert_same_rows(tokenizer(CAPTIONS[:1000]), _hf_rows(reference, CAPTIONS[:1000]), CAPTIONS[:1000])
    (tmp_path / "siglip").mkdir()
    shutil.copy(folders["siglip"][0] / "spiece.model", tmp_path / "siglip")
    bare = SentencePieceTokenizer.from_folder(tmp_path / "siglip")
    np.testing.assert_array_equal(bare(CAPTIONS[:1000]), folders["siglip"][1](CAPTIONS[:1000]))


@pytest.mark.parametrize("kwargs, clean", [({"clean": "canonicalize"}, "canonicalize"), (None, "whitespace")])
def test_open_clip_folder_matches_hf_tokenizer(json_folders, tmp_path, kwargs, clean):
    """A folder with OpenCLIP's config is read with its cleaning (HFTokenizer's default "whitespace" when it names
    none) and length, as OpenCLIP's HFTokenizer reads it. HFTokenizer lets transformers read special-token strings
    as the special tokens; ours reads them as text (the module docstring): captions with "<" are left out here."""
    captions = [caption for caption in CAPTIONS[:1500] if "<" not in clean_text(caption, clean)]
    for style in ("siglip", "gemma"):
        folder = tmp_path / style
        shutil.copytree(json_folders[style], folder)
        text_cfg = {"context_length": 32, "hf_tokenizer_name": "timm/any", "tokenizer_kwargs": kwargs}
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"text_cfg": text_cfg}}))
        tokenizer = SentencePieceTokenizer.from_folder(folder)
        assert (tokenizer.clean, tokenizer.context_length) == (clean, 32)
        reference = open_clip_tokenizer.HFTokenizer(str(folder), context_length=32, **(kwargs or {}))
        _assert_same_rows(tokenizer(captions), reference(captions).numpy().astype(np.int32), captions)


def test_save_then_transformers_gives_the_same_rows(folders, json_folders, tmp_path):
    loaded = {
        "siglip": SentencePieceTokenizer.from_folder(folders["siglip"][0], clean="canonicalize"),
        "gemma-json": SentencePieceTokenizer.from_folder(json_folders["gemma"], clean="canonicalize"),
        "t5-json": SentencePieceTokenizer.from_folder(json_folders["siglip"], clean="canonicalize"),
    }
    captions, texts = CAPTIONS[:1000], list(_cleaned("canonicalize")[:1000])
    for name, tokenizer in loaded.items():
        written = tokenizer.save(tmp_path / name)
        assert sorted(written) == sorted(str(p) for p in (tmp_path / name).iterdir())
        rows = tokenizer(captions)
        _assert_same_rows(rows, _hf_rows(transformers.AutoTokenizer.from_pretrained(tmp_path / name), texts), texts)
        again = SentencePieceTokenizer.from_folder(tmp_path / name, clean=tokenizer.clean)
        _assert_same_rows(again(captions), rows, captions)


def test_save_never_replaces_a_file(folders, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("mine")
    with pytest.raises(InvalidInput) as error:
        folders["siglip"][1].save(tmp_path)
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "tokenizer_config.json") in message
    assert (tmp_path / "tokenizer_config.json").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer_config.json"]  # nothing else written


def test_missing_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(MissingInput) as error:
        SentencePieceTokenizer.from_folder(tmp_path)
    message = str(error.value)
    assert "\n" not in message and str(tmp_path) in message
    assert all(name in message for name in TOKENIZER_FILES)
    with pytest.raises(MissingInput, match="does not exist"):
        SentencePieceTokenizer.from_folder(tmp_path / "absent")


def test_argument_checks(folders):
    tokenizer = folders["gemma"][1]
    with pytest.raises(TypeError, match="caption 1 is bytes.*decode"):
        tokenizer(["a", b"b"])
    with pytest.raises(InvalidInput, match="context_length"):
        tokenizer("a", context_length=0)
    with pytest.raises(InvalidInput, match="clean must be one of"):
        SentencePieceTokenizer.from_folder(folders["gemma"][0], clean="fancy")
    with pytest.raises(InvalidInput, match="style must be one of"):
        train_sentencepiece(["a"], folders["gemma"][0] / "new", 100, style="bert")
    with pytest.raises(InvalidInput, match="cannot train a 100-piece gemma vocabulary") as error:
        train_sentencepiece(CAPTIONS[:100], folders["gemma"][0] / "new", 100, style="gemma")
    assert "\n" not in str(error.value) and not (folders["gemma"][0] / "new").exists()
