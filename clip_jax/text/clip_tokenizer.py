"""OpenAI CLIP's byte-level BPE tokenizer, id for id the same as OpenCLIP's `open_clip.tokenize`.

A caption is cleaned (ftfy, HTML-unescaped twice, whitespace collapsed, lowercased), split into words by
CLIP's pattern, and each word is byte-pair encoded with OpenAI's vocabulary (`bpe_simple_vocab_16e6.txt.gz`,
MIT, shipped with this package). A row reads `SOT text EOT 0 0 ...`; a caption too long for the context keeps its
first `context_length - 2` text tokens and still ends in EOT.

Two facts make it fast without changing a single id:
- ftfy and `html.unescape` return printable ASCII (tabs and newlines allowed) unchanged when no `&` in it can
  start an entity, i.e. each `&` is followed by a space. Such captions, the bulk of web alt-texts, skip them.
- No alternative of the word pattern matches a space, so the tokens of a cleaned caption are the tokens of
  its space-separated chunks, one after the other. Token ids are kept per chunk in a bounded table; chunks not
  in it are encoded in one batch by a native BPE (HF `tokenizers`). Only the first `context_length - 1` chunks of a
  caption are encoded: each chunk gives at least one token, so the rest can change neither the ids nor whether
  the caption was truncated.
"""

import functools
import gzip
import html
import importlib.resources
import itertools
import re
from collections.abc import Iterable

import ftfy
import numpy as np
import regex
import tokenizers

from clip_jax.errors import InvalidInput

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
NUM_MERGES = 48_894  # the first merges of the file, as OpenAI's CLIP uses them
VOCAB_SIZE = 49_408  # 256 bytes, 256 word-final bytes, the merges, SOT, EOT
SOT_ID = 49_406  # "<start_of_text>"
EOT_ID = 49_407  # "<end_of_text>"
PAD_ID = 0
CONTEXT_LENGTH = 77

_SPECIAL_WORDS = {"<start_of_text>": SOT_ID, "<end_of_text>": EOT_ID}
_WORD_PATTERN = regex.compile(
    r"<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+",
    regex.IGNORECASE,
)
_PLAIN_ASCII = re.compile(r"[\t\n\x20-\x7e]*")
_MAX_TABLE_CHUNKS = 1 << 18  # a full table starts again empty; ~40 MB at most


def tokenize(
    texts: str | Iterable[str], context_length: int = CONTEXT_LENGTH, *, return_truncated: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts`, int32 [N, context_length] (N = 1 for a single str).

    With `return_truncated=True` also returns bool [N]: whether a caption lost tokens to the context length.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    check_captions(texts)
    if context_length < 2:
        raise InvalidInput(f"context_length must be at least 2 (room for SOT and EOT), got {context_length}")

    chunks_per_caption = [_clean_chunks(text, context_length - 1) for text in texts]
    chunks = list(itertools.chain.from_iterable(chunks_per_caption))
    chunk_ids = _chunk_table().lookup(chunks)
    ids = np.fromiter(itertools.chain.from_iterable(chunk_ids), np.int32)  # [T] all captions' text tokens

    num_rows = len(texts)
    chunk_token_end = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, chunk_ids), np.int64, len(chunks)), out=chunk_token_end[1:])
    row_chunk_end = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.fromiter(map(len, chunks_per_caption), np.int64, num_rows), out=row_chunk_end[1:])
    row_token_bounds = chunk_token_end[row_chunk_end]  # [N + 1]
    num_text_tokens = np.diff(row_token_bounds)  # [N], counted up to the cut described above
    kept = np.minimum(num_text_tokens, context_length - 2)

    rows = np.repeat(np.arange(num_rows), kept)
    positions = np.arange(rows.size) - np.repeat(np.cumsum(kept) - kept, kept)
    out = np.full((num_rows, context_length), PAD_ID, np.int32)
    out[:, 0] = SOT_ID
    out[rows, 1 + positions] = ids[np.repeat(row_token_bounds[:-1], kept) + positions]
    out[np.arange(num_rows), kept + 1] = EOT_ID
    if return_truncated:
        return out, num_text_tokens > context_length - 2
    return out


def check_captions(texts: list, who: str = "tokenize") -> None:
    """Refuses a caption that is not a str (bytes: decode them first), naming its index; `who` names the caller."""
    if all(isinstance(text, str) for text in texts):
        return
    index, bad = next((i, t) for i, t in enumerate(texts) if not isinstance(t, str))
    hint = " (decode bytes first, e.g. caption.decode('utf-8'))" if isinstance(bad, bytes) else ""
    raise TypeError(f"{who} expects str captions; caption {index} is {type(bad).__name__}{hint}")


def _clean_chunks(text: str, max_chunks: int) -> list[str]:
    """The caption cleaned as OpenCLIP cleans it, split at its single spaces; at most `max_chunks` chunks."""
    if is_plain_ascii(text):
        chunks = text.lower().split()
    else:
        text = html.unescape(html.unescape(ftfy.fix_text(text)))
        text = " ".join(text.split()).lower()
        chunks = text.split(" ") if text else []
    return chunks[:max_chunks] if len(chunks) > max_chunks else chunks


def is_plain_ascii(text: str) -> bool:
    """True if ftfy.fix_text and html.unescape both return `text` unchanged.

    They do for printable ASCII, tabs and newlines (every ftfy fix but entity decoding looks for other
    characters only) in which no `&` starts an entity (both decoders need a non-space character after it).
    """
    return (
        text.isascii()
        and (text.isprintable() or _PLAIN_ASCII.fullmatch(text) is not None)
        and ("&" not in text or "&" not in text.replace("& ", ""))
    )


class _ChunkTable:
    """Token ids of chunks of cleaned text (no spaces), filled in batches by the native BPE."""

    def __init__(self, bpe: tokenizers.Tokenizer):
        self._bpe = bpe
        self._ids: dict[str, tuple[int, ...]] = {}

    def lookup(self, chunks: list[str]) -> list[tuple[int, ...]]:
        table = self._ids  # entries are only ever added, so a concurrent call may at worst encode twice
        new = set(chunks).difference(table)
        if new:
            if len(table) + len(new) > _MAX_TABLE_CHUNKS:
                table, new = {}, set(chunks)
            table.update(self._encode(list(new)))
            self._ids = table
        return list(map(table.__getitem__, chunks))

    def _encode(self, chunks: list[str]) -> dict[str, tuple[int, ...]]:
        words_per_chunk = [_WORD_PATTERN.findall(chunk) for chunk in chunks]
        words = list(set(itertools.chain.from_iterable(words_per_chunk)) - _SPECIAL_WORDS.keys())
        encoding = self._bpe.encode(words, is_pretokenized=True, add_special_tokens=False)
        word_index = np.asarray(encoding.word_ids, np.int64)  # [tokens], non-decreasing
        bounds = np.flatnonzero(np.diff(word_index, prepend=-1, append=len(words))).tolist()
        if len(bounds) != len(words) + 1:
            raise RuntimeError("the BPE returned no tokens for some word; the vocabulary file is damaged")
        token_ids = encoding.ids
        word_ids = {w: tuple(token_ids[a:b]) for w, a, b in zip(words, bounds[:-1], bounds[1:])}
        word_ids.update((w, (i,)) for w, i in _SPECIAL_WORDS.items())
        return {
            chunk: tuple(itertools.chain.from_iterable(map(word_ids.__getitem__, ws)))
            for chunk, ws in zip(chunks, words_per_chunk)
        }


@functools.cache
def _chunk_table() -> _ChunkTable:
    return _ChunkTable(_byte_pair_encoder())


def _byte_pair_encoder() -> tokenizers.Tokenizer:
    """HF `tokenizers` BPE over CLIP's byte alphabet with its `</w>` word ends; one word per input item."""
    tokens, merges = bpe_vocabulary()
    vocab = {token: i for i, token in enumerate(tokens)}  # a repeated token keeps its last id, as in OpenCLIP
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges, end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return bpe


def bpe_vocabulary() -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens, merges): the token of each id, 0 to VOCAB_SIZE - 1 (the last two `<start_of_text>`,
    `<end_of_text>`), and the merges in the order they apply, from the vocabulary file shipped with clip_jax."""
    vocab_text = gzip.decompress(importlib.resources.files("clip_jax.text").joinpath(VOCAB_FILE).read_bytes())
    lines = vocab_text.decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 1 + NUM_MERGES]]
    if len(merges) != NUM_MERGES or any(len(m) != 2 for m in merges):
        raise RuntimeError(f"{VOCAB_FILE} in the clip_jax package is damaged: expected {NUM_MERGES} merges")
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges] + list(_SPECIAL_WORDS)
    return tokens, merges


def _byte_alphabet() -> list[str]:
    """The character standing for each byte, in vocabulary order: printable Latin-1 bytes stand for
    themselves; the other 68 take the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
