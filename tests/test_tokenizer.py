"""The CLIP tokenizer gives OpenCLIP's ids, row layout and truncation on hostile and ordinary captions."""

import html
import itertools
import random
import subprocess
import sys

import ftfy
import numpy as np
import open_clip
import pytest

from clip_jax.text import clip_tokenizer as tokenizer
from clip_jax.text.clip_tokenizer import CONTEXT_LENGTH, EOT_ID, PAD_ID, SOT_ID, VOCAB_SIZE, tokenize

_ASCII_WORDS = """a photo of the cat dog on with and in red blue big small new vintage women's it's don't
we'll they're i'm you've he'd IPHONE Samsung USB-C 4K HD 2019 x 1080p $19.99 50% off sale!!! (2 pack) #1 @home
e-mail www.example.com/path?q=1 a.b.c ... --- ??? !?! :-) <3 <b>bold</b> [tag] {json: 1} 'quoted' "double"
back\\slash under_score a+b=c ~tilde^caret |pipe| `tick`""".split()
_SCRIPTS = [
    "café", "naïve", "résumé", "Ångström", "Zürich", "Straße", "ĞÜŞİÖÇ", "İstanbul", "ΟΔΟΣ", "Σίσυφος", "ς",
    "Москва", "Ёлка", "שָׁלוֹם", "مرحبا بالعالم", "हिन्दी", "বাংলা", "தமிழ்", "ภาษาไทย", "ພາສາລາວ", "ქართული",
    "Հայերեն", "東京タワー", "日本の風景", "北京烤鸭", "서울특별시", "한국어", "ᄀᄁ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝟙𝟚𝟛", "①②③", "Ⅻ",
    "½¾", "²³", "٣٤٥", "१२३", "e\u0301", "a\u0308\u0304", "ǅ", "ﬀ", "ﬁ", "ﬂ", "ﬃ", "ＦＵＬＬＷＩＤＴＨ", "１２３",
    "ｶﾀｶﾅ", "\u212a", "ſ", "'ſ", "ŉ", "ẞ", "ᾈ", "\u0130", "Ǆ",
]
_ENTITIES = [
    "&amp;", "&amp;amp;", "&amp;amp;amp;", "&lt;b&gt;", "&quot;hi&quot;", "&#39;", "&#x27;", "&#233;",
    "&#xe9;", "&eacute;", "&EACUTE;", "&nbsp;", "&copy", "&amp", "&notin;", "&not", "&#0;", "&#x110000;",
    "&#xD800;", "&#128;", "&#1;", "&hellip;", "&mdash;", "&;", "& ", "&&", "&#;", "&#x;", "AT&T", "R&amp;D",
    "&lt;3",
]
_MOJIBAKE = [
    "Ã©", "Ã¼ber", "Ã¨", "â€™", "â€œquotedâ€\x9d", "â€”", "Ã\xa0 la", "Ã  la", "Â£5", "Â\xa0", "ðŸ˜€",
    "Ã¢â‚¬â„¢", "sÃ³", "voilÃ le", "Ð¿Ñ€Ð¸Ð²ÐµÑ‚", "\x80\x93", "\x85",
]
_EMOJI = ["😀", "❤️", "👍🏽", "👨‍👩‍👧‍👦", "🇺🇸", "🏳️‍🌈", "☺", "✔", "★★★", "🤖🦄", "\U0001faf6", "🏴󠁧󠁢󠁷󠁬󠁳󠁿"]
_QUOTES = ["“curly”", "‘single’", "it’s", "„low“", "«guillemets»", "‹›", "′″", "–", "—", "…", "•", "·", "¡¿"]
_CONTROL = [chr(c) for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]] + [
    "\x1b[31mred\x1b[0m", "\u200b", "\u200c", "\u200d", "\u200e", "\u202e", "\ufeff", "\ufffc", "\u2028",
    "\u2029", "\u00a0", "\u2003", "\u3000", "\u180e", "\u206a", "\ud83d\ude00", "\udc00",
]
_SPECIAL = [
    "<|startoftext|>", "<|endoftext|>", "<start_of_text>", "<end_of_text>", "<START_OF_TEXT>",
    "!<start_of_text>", "a<end_of_text>b", "1<start_of_text>", "'<end_of_text>", "<start_of_text>'s",
    "<<end_of_text>>", "<start_of_text",
]
_SEPARATORS = [" ", " ", " ", "", "  ", "\t", "\n", "\r\n", "\r", " \n ", "\x0b", "\x0c", "\x1c", "\u3000"]


def _fragment(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        return rng.choice(_ASCII_WORDS)
    if kind < 0.50:
        return "".join(rng.choice("0123456789.,:;!?-+*/%$#@()[]'\"") for _ in range(rng.randint(1, 8)))
    if kind < 0.52:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randint(1, 3)))  # any code point
    pool = rng.choice([_SCRIPTS, _SCRIPTS, _ENTITIES, _MOJIBAKE, _EMOJI, _QUOTES, _CONTROL, _SPECIAL])
    return rng.choice(pool)


def _hostile_caption(rng: random.Random) -> str:
    count = rng.randint(150, 400) if rng.random() < 0.03 else rng.randint(1, 12)
    parts = [_fragment(rng) for _ in range(count)]
    return "".join(p + rng.choice(_SEPARATORS) for p in parts).rstrip(rng.choice(["", " "]))


def _plain_caption(rng: random.Random) -> str:
    count = rng.randint(80, 200) if rng.random() < 0.03 else rng.randint(1, 20)
    words = [rng.choice(_ASCII_WORDS) for _ in range(count)]
    if rng.random() < 0.1:
        words.insert(rng.randrange(count), "&")
    caption = " ".join(w.capitalize() if rng.random() < 0.2 else w for w in words)
    return caption if rng.random() < 0.9 else f" {caption}\n\t"


EDGE_CASES = [
    "", " ", "   \t\n  ", "\n", "\r\n", "\x00", "&nbsp;", "&amp;nbsp;", "a", "A", "0", "0123456789",
    "!!!???...", "a photo of a cat.", "A PHOTO OF A CAT", "'s", "'S", "''s", "it's it'S IT's", "don't",
    "x'll'd've", "  leading and trailing  ", "tabs\tand\nnewlines\r\nand\rcr", "ⅰⅱⅲ", "ΟΔΟΣ ΟΔΟΣ.",
    "word " * 100, "supercalifragilisticexpialidocious" * 30, "🙂" * 100, "1" * 200, "&amp;" * 50, "<" * 300,
    *_SPECIAL, *_ENTITIES, *_MOJIBAKE, *_EMOJI, *_QUOTES, *_CONTROL,
]


@pytest.fixture(scope="module")
def captions() -> list[str]:
    rng = random.Random(20260)
    hostile = [_hostile_caption(rng) for _ in range(1700)]
    plain = [_plain_caption(rng) for _ in range(1300)]
    return EDGE_CASES + hostile + plain


@pytest.fixture(scope="module")
def reference_lengths(captions) -> np.ndarray:
    """Untruncated lengths (SOT + text + EOT) from OpenCLIP's own encoder."""
    simple = open_clip.tokenizer.SimpleTokenizer()
    return np.array([len(simple.encode(c)) + 2 for c in captions])


@pytest.mark.slow
@pytest.mark.parametrize("context_length", [CONTEXT_LENGTH, 9])
def test_ids_and_truncation_match_open_clip(captions, reference_lengths, context_length, monkeypatch):
    expected = open_clip.tokenize(captions, context_length=context_length).numpy()
    tokenizer._chunk_table.cache_clear()
    cold, truncated = tokenize(captions, context_length, return_truncated=True)
    warm = tokenize(captions, context_length)  # every chunk now comes from the table
    monkeypatch.setattr(tokenizer, "_MAX_TABLE_CHUNKS", 300)
    tokenizer._chunk_table.cache_clear()
    batches = [captions[i : i + 100] for i in range(0, len(captions), 100)]
    small_table = np.concatenate([tokenize(batch, context_length) for batch in batches])
    tokenizer._chunk_table.cache_clear()

    for ids in (cold, warm, small_table):
        assert ids.dtype == np.int32 and ids.shape == (len(captions), context_length)
        mismatched = np.flatnonzero((ids != expected).any(axis=1))
        assert mismatched.size == 0, f"{mismatched.size} rows differ, first: {captions[mismatched[0]]!r}"
    np.testing.assert_array_equal(truncated, reference_lengths > context_length)
    assert 0 < truncated.sum() < len(captions)  # both cases occur


def test_cleaning_matches_open_clip(captions):
    for caption in captions:
        expected = open_clip.tokenizer.whitespace_clean(open_clip.tokenizer.basic_clean(caption)).lower()
        assert " ".join(tokenizer._clean_chunks(caption, max_chunks=10**6)) == expected, repr(caption)


def test_ftfy_and_html_unescape_leave_plain_ascii_unchanged():
    """The shortcut skips ftfy and html.unescape only where they would return the caption unchanged."""
    rng = random.Random(7)
    tricky = "&#;<>/\\[]\x1b\r\n\t\x0b\x0c\x00\x7f aZ09'\"-.x"
    exhaustive = ["".join(p) for n in (1, 2) for p in itertools.product(map(chr, range(128)), repeat=n)]
    exhaustive += ["".join(p) for p in itertools.product(tricky, repeat=3)]
    sampled = ["".join(rng.choice(tricky) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    printable = [chr(c) for c in range(32, 127)] + ["\t", "\n", "& "] * 5
    sampled += ["".join(rng.choice(printable) for _ in range(rng.randint(1, 80))) for _ in range(3000)]
    accepted = [s for s in exhaustive + sampled if tokenizer.is_plain_ascii(s)]
    assert len(accepted) > 18_000
    for text in accepted:
        assert ftfy.fix_text(text) == text == html.unescape(html.unescape(text)), repr(text)


def test_plain_ascii_shortcut_declines_what_cleaning_might_change():
    changed = ["&amp;", "a &lt;b", "&#39;", "&x", "trailing &", "a\rb", "\x1b[31m", "a\x00b", "a\x0bb", "é"]
    for text in changed:
        assert not tokenizer.is_plain_ascii(text), repr(text)
    assert tokenizer.is_plain_ascii("Black & White\tphoto\n(2 pack), 50% off!")


def test_rows_are_sot_text_eot_then_padding():
    ids = tokenize("a photo of a cat")
    expected_text = open_clip.tokenizer.SimpleTokenizer().encode("a photo of a cat")
    assert ids.shape == (1, CONTEXT_LENGTH) and ids.dtype == np.int32
    n = len(expected_text)
    assert ids[0, 0] == SOT_ID and ids[0, n + 1] == EOT_ID
    assert ids[0, 1 : n + 1].tolist() == expected_text
    assert (ids[0, n + 2 :] == PAD_ID).all()
    assert tokenize([]).shape == (0, CONTEXT_LENGTH)
    assert tokenize(np.array(["a", "b"])).shape == (2, CONTEXT_LENGTH)  # numpy strings are str


def test_truncation_keeps_first_tokens_and_ends_in_eot():
    fits = " ".join(["a"] * (CONTEXT_LENGTH - 2))  # one token per "a"
    too_long = fits + " b c"
    ids, truncated = tokenize([fits, too_long], return_truncated=True)
    assert truncated.tolist() == [False, True]
    assert ids[0, -1] == ids[1, -1] == EOT_ID
    np.testing.assert_array_equal(ids[0], ids[1])
    np.testing.assert_array_equal(ids, open_clip.tokenize([fits, too_long]).numpy())


def test_constants_agree_with_open_clip():
    reference = open_clip.tokenizer.SimpleTokenizer()
    assert (SOT_ID, EOT_ID) == (reference.sot_token_id, reference.eot_token_id)
    assert VOCAB_SIZE == reference.vocab_size
    assert tokenizer._byte_pair_encoder().get_vocab() == reference.encoder
    assert open_clip.tokenizer.DEFAULT_CONTEXT_LENGTH == CONTEXT_LENGTH


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match=r"caption 1 is bytes.*decode"):
        tokenize(["ok", b"bytes"])
    with pytest.raises(ValueError, match="context_length must be at least 2"):
        tokenize("x", context_length=1)


@pytest.mark.subprocess
def test_imports_neither_torch_nor_tensorflow_nor_clu():
    code = (
        "import sys, clip_jax.text.clip_tokenizer as t; t.tokenize('x');"
        "bad = [m for m in ('torch', 'tensorflow', 'clu') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
