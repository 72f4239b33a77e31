"""Imported tokenizers: an existing HF ``tokenizer.json`` or WordPiece ``vocab.txt`` making the shards.

The public Chinese BERT / RoFormer checkpoints ship their own vocabulary, and a model continued from
one must see its ids. ``roformer-data prepare|shards --tokenizer PATH`` takes, besides one of our
SentencePiece models (``.model``):

- an HF ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``), used as it is, except that its
  truncation and padding settings are switched off (a document is never cut) and its post-processor is
  not applied (the loader frames rows itself);
- a WordPiece ``vocab.txt`` (one token a line, the line number its id), with the conventions of
  Google's Chinese BERT and of ``transformers.BertTokenizer``: text cleaned, a space put around every
  CJK character (each is its own word), lowercased, accents stripped as BERT does (NFD, combining marks
  removed: ``strip_accents`` follows ``lowercase``), split on whitespace and punctuation, then greedy
  longest-match WordPiece with ``##`` continuations, a word of more than 100 characters -> [UNK];
- a directory holding either (an HF repository: its ``tokenizer.json`` first, else ``vocab.txt``,
  else ``tokenizer.model``).

The project's normalisation (:func:`data_pipeline.corpus.normalize`) runs first, as for every corpus;
the imported tokenizer's own normaliser (BERT's lowercasing ...) then runs on top. Documents are
encoded without [CLS]/[SEP]. The special ids are those of the tokens ``[PAD] [UNK] [CLS] [SEP]
[MASK]`` in the imported vocabulary (BERT's: 0, 100, 101, 102, 103); a vocabulary without one of them
is refused, naming the file and the token. The manifest records them (``special_ids``) and the kind
(``tokenizer.kind``: :data:`KINDS`); the file is copied into the set under the name of its kind and
hashed like our ``.model``.

Word-start marks (whole-word masking): a token starts a word unless it continues the previous token's
pre-tokenizer word (for WordPiece: a piece starting with ``##``); with gold words (People's Daily) or
jieba's, a token starts a word when its first character starts one, so a Chinese word of several
characters is masked whole (as Chinese BERT-wwm). ``--jieba`` with an imported tokenizer gives only
the word marks: the encoding is the tokenizer's own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .errors import TOKENIZER, DataError, UsageError
from .tokenizer import SPECIAL_TOKENS, jieba_cut, sha256_file, word_lengths

__all__ = ["KINDS", "SENTENCEPIECE", "TOKENIZER_JSON", "WORDPIECE_VOCAB", "ImportedTokenizer", "find_tokenizer_file",
           "kind_of", "open_tokenizer", "tokenizer_facts", "manifest_kind"]

SENTENCEPIECE = "sentencepiece"
TOKENIZER_JSON = "tokenizer-json"
WORDPIECE_VOCAB = "wordpiece-vocab"
KINDS = {SENTENCEPIECE: "tokenizer.model", TOKENIZER_JSON: "tokenizer.json", WORDPIECE_VOCAB: "vocab.txt"}
"""``tokenizer.kind`` of a manifest -> the tokenizer's file name inside the shard set. A manifest without
``kind`` (every set made before imported tokenizers) is ``sentencepiece``."""
MAX_WORD_CHARS = 100
"""WordPiece: a longer word becomes [UNK] (BERT's ``max_input_chars_per_word``)."""


def manifest_kind(manifest: dict) -> str:
    """The tokenizer kind of a manifest (``sentencepiece`` when it names none)."""
    return manifest["tokenizer"].get("kind", SENTENCEPIECE)


def kind_of(path: str | os.PathLike) -> str:
    """The kind of a tokenizer file, from its name: ``*.model`` SentencePiece, ``*.json`` an HF
    tokenizer.json, ``*.txt`` a WordPiece vocabulary; UsageError (about the :data:`~.errors.TOKENIZER`) for anything
    else."""
    suffix = Path(path).suffix
    for kind, ext in ((SENTENCEPIECE, ".model"), (TOKENIZER_JSON, ".json"), (WORDPIECE_VOCAB, ".txt")):
        if suffix == ext:
            return kind
    raise UsageError(f"{path}: expected a SentencePiece .model, an HF tokenizer.json, a WordPiece vocab.txt or a "
                     "directory holding one of them", argument=TOKENIZER)


def find_tokenizer_file(path: str | os.PathLike) -> tuple[Path, str]:
    """(file, kind) of a ``--tokenizer`` argument: a file (:func:`kind_of`) or a directory holding
    ``tokenizer.json``, ``vocab.txt`` or ``tokenizer.model`` (the first found); UsageError otherwise."""
    p = Path(path)
    if p.is_dir():
        for kind in (TOKENIZER_JSON, WORDPIECE_VOCAB, SENTENCEPIECE):
            if (p / KINDS[kind]).is_file():
                return p / KINDS[kind], kind
        raise UsageError(f"{p}: the directory holds no tokenizer.json, vocab.txt or tokenizer.model",
                         argument=TOKENIZER)
    return p, kind_of(p)


def _read_text(path: Path, data: Optional[bytes], what: str) -> str:
    try:
        raw = data if data is not None else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"tokenizer {path}: no such file (expected {what})") from None
    except OSError as e:
        raise DataError(f"tokenizer {path}: cannot read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"tokenizer {path}: not UTF-8 text at byte {e.start} (expected {what})") from None


def _wordpiece(path: Path, text: str):
    """BERT's WordPiece pipeline of a vocab.txt (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    tokens = [t.rstrip("\r") for t in tokens]
    if not tokens:
        raise DataError(f"tokenizer {path}: empty (expected a WordPiece vocab.txt, one token a line)")
    if SPECIAL_TOKENS["unk"] not in tokens:
        raise DataError(f"tokenizer {path}: no {SPECIAL_TOKENS['unk']} token in the vocabulary (the unk token; an "
                        "imported tokenizer needs [PAD] [UNK] [CLS] [SEP] [MASK])")
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(tokens)}, unk_token=SPECIAL_TOKENS["unk"],
                              max_input_chars_per_word=MAX_WORD_CHARS))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok, len(tokens)


def _tokenizer_json(path: Path, text: str):
    from tokenizers import Tokenizer

    try:
        json.loads(text)
    except RecursionError:
        raise DataError(f"tokenizer {path}: not a tokenizer.json (JSON nested too deeply)") from None
    except ValueError as e:
        raise DataError(f"tokenizer {path}: not valid JSON ({e})") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise DataError(f"tokenizer {path}: not an HF tokenizers file ({e})") from None
    tok.no_truncation()
    tok.no_padding()
    return tok, max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


class ImportedTokenizer:
    """An imported tokenizer (see the module docstring) with the interface of
    :class:`data_pipeline.tokenizer.Tokenizer` that shard building, inspection and export use."""

    def __init__(self, path: str | os.PathLike, kind: str, jieba: bool = False, *, data: Optional[bytes] = None):
        """Load ``path`` of ``kind`` (``tokenizer-json`` or ``wordpiece-vocab``; with ``data``, the file's
        bytes, ``path`` then only names it). DataError naming the file when it cannot be read or parsed,
        or lacks one of the five special tokens."""
        self.path, self.kind, self.jieba = Path(path), kind, jieba
        what = "an HF tokenizer.json" if kind == TOKENIZER_JSON else "a WordPiece vocab.txt"
        text = _read_text(self.path, data, what)
        self._data = data
        self.tok, self.vocab_size = (_tokenizer_json if kind == TOKENIZER_JSON else _wordpiece)(self.path, text)
        self.special_ids = {}
        for key, token in SPECIAL_TOKENS.items():
            i = self.tok.token_to_id(token)
            if i is None:
                raise DataError(f"tokenizer {self.path}: no {token} token in the vocabulary (the {key} token; an "
                                "imported tokenizer needs [PAD] [UNK] [CLS] [SEP] [MASK])")
            self.special_ids[key] = int(i)
        self.dtype = np.dtype("uint16") if self.vocab_size <= 1 << 16 else np.dtype("uint32")
        self.reads_utf8 = False             # texts come as str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._data).hexdigest() if self._data is not None else sha256_file(self.path)

    def _encodings(self, texts: Sequence[str]):
        return self.tok.encode_batch(list(texts), add_special_tokens=False)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of a normalised text (int64)."""
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int64) for e in self._encodings(texts)]

    def encode_marked(self, texts: Sequence[str], words: Optional[Sequence[Optional[Sequence[str]]]] = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids int64 [total], each text's count int64 [n], word-start marks uint8 [total]) of normalised
        texts; ``words[i]``: the gold words of text i or None (see the module docstring)."""
        encs = self._encodings(texts)
        lengths = np.fromiter((len(e.ids) for e in encs), np.int64, len(encs))
        total = int(lengths.sum())
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), np.int64, total)
        word_ids = np.fromiter((-1 if w is None else w for e in encs for w in e.word_ids), np.int64, total)
        cont = np.zeros(total, bool)
        cont[1:] = (word_ids[1:] == word_ids[:-1]) & (word_ids[1:] >= 0)
        firsts = np.cumsum(lengths) - lengths
        cont[firsts[lengths > 0]] = False
        marks = (~cont).astype(np.uint8)
        if words is None and self.jieba:
            words = [[w for w in jieba_cut(t) if w] for t in texts]
        for i, doc_words in enumerate(words or ()):
            if doc_words is None or not lengths[i]:
                continue
            wlen = word_lengths([doc_words], len(doc_words))
            is_start = np.zeros(int(wlen.sum()) + 1, bool)
            is_start[np.cumsum(wlen) - wlen] = True
            starts = np.fromiter((s for s, _ in encs[i].offsets), np.int64, int(lengths[i]))
            doc = is_start[np.minimum(starts, len(is_start) - 1)]
            doc[0] = True
            marks[firsts[i]:firsts[i] + lengths[i]] = doc
        return ids, lengths, marks

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(int(i))


def open_tokenizer(path: str | os.PathLike, kind: str = SENTENCEPIECE, jieba: bool = False, *,
                   data: Optional[bytes] = None):
    """The tokenizer of ``kind`` at ``path`` (``data``: its bytes, read elsewhere): a SentencePiece
    :class:`~data_pipeline.tokenizer.Tokenizer` or an :class:`ImportedTokenizer`."""
    if kind == SENTENCEPIECE:
        from .tokenizer import Tokenizer

        return Tokenizer(path, jieba=jieba, model=data)
    return ImportedTokenizer(path, kind, jieba, data=data)


def tokenizer_facts(data: bytes, name: str, kind: str = SENTENCEPIECE) -> tuple[int, dict]:
    """(vocabulary size, {special: id as the tokenizer has it}) of a tokenizer file's bytes."""
    if kind == SENTENCEPIECE:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as e:
            raise DataError(f"tokenizer {name}: not a SentencePiece model ({e})") from None
        return sp.GetPieceSize(), {k: sp.PieceToId(tok) for k, tok in SPECIAL_TOKENS.items()}
    tok = ImportedTokenizer(name, kind, data=data)
    return tok.vocab_size, tok.special_ids
