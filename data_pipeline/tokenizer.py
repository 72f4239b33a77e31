"""SentencePiece tokenizer: training, loading, encoding with word-start marks.

Special tokens have fixed ids, recorded in every manifest:
``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4`` (a set made with an imported tokenizer records that
tokenizer's own: :mod:`data_pipeline.imported`). [PAD] and [UNK] are SentencePiece's
pad/unk pieces; [CLS] [SEP] [MASK] are *control* symbols, so the text "[SEP]" in a
document is tokenised as ordinary characters and never becomes id 3.

Text is normalised by :mod:`data_pipeline.corpus` before it gets here, so the model
uses SentencePiece's ``identity`` normalisation, no dummy prefix and no whitespace
removal: ``decode(encode(text)) == text`` for every normalised text (byte fallback
covers characters outside the vocabulary).

Word pre-segmentation with jieba (``jieba=True``, the WoBERT / RoFormer word-level
style): training sees jieba words as pre-tokens (pieces never cross a word) and
encoding encodes word by word, so whole words become single tokens where the
vocabulary has them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from .errors import DataError, UsageError

__all__ = ["SPECIAL_TOKENS", "SPECIAL_IDS", "train_tokenizer", "Tokenizer", "sha256_file", "jieba_cut",
           "split_long", "word_lengths"]

log = logging.getLogger(__name__)

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
SPECIAL_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
_DELIM = "\t"  # jieba pre-token delimiter during training (normalised text has no tabs)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _import_jieba():
    try:
        import jieba  # noqa: PLC0415 - optional, imported only behind the flag
    except ImportError:
        raise UsageError("jieba word pre-segmentation was requested (--jieba / jieba=True) but jieba is not "
                          "installed: pip install jieba  (or pip install 'roformer-dist[jieba]')") from None
    jieba.setLogLevel(60)
    return jieba


def jieba_cut(text: str) -> list[str]:
    """jieba words of a text (``"".join(words) == text``)."""
    return list(_import_jieba().cut(text, HMM=True))


_BREAKS = [c.encode() for c in "\n。！？；!?;.，, "]


def split_long(text: str, max_bytes: int) -> list[str]:
    """``text`` in pieces of at most ``max_bytes`` UTF-8 bytes, cut after a sentence end, comma or space
    in the second half of a piece when there is one (else at a character boundary)."""
    b = text.encode("utf-8")
    if len(b) <= max_bytes:
        return [text]
    pieces = []
    while len(b) > max_bytes:
        cut = max_bytes
        while cut > 0 and (b[cut] & 0xC0) == 0x80:     # not inside a UTF-8 character
            cut -= 1
        best = max((b.rfind(br, max_bytes // 2, cut) + len(br) for br in _BREAKS if b.rfind(br, max_bytes // 2, cut) >= 0),
                   default=-1)
        cut = best if best > 0 else cut
        pieces.append(b[:cut].decode("utf-8"))
        b = b[cut:]
    if b:
        pieces.append(b.decode("utf-8"))
    return pieces


def train_tokenizer(texts: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int = 32000, *,
                    model_type: str = "unigram", character_coverage: float = 0.9995,
                    byte_fallback: bool = True, input_sentence_size: int = 2_000_000,
                    num_threads: Optional[int] = None, jieba: bool = False, seed: int = 0,
                    max_sentence_length: int = 1 << 14, report: Optional[dict] = None) -> Path:
    """Train a SentencePiece model on normalised texts; returns the ``.model`` path.

    ``input_sentence_size`` caps the sentences SentencePiece samples (uniformly, seeded)
    for training, so that a corpus of tens of GB trains in bounded memory. Texts longer than
    ``max_sentence_length`` bytes (SentencePiece would drop them) are split into pieces first.
    The vocabulary size is a soft limit: a small corpus may give fewer pieces (the real size
    goes into the manifest; a warning says so). ``report`` (a dict) receives ``texts``,
    ``split_texts``, ``split_pieces``, ``vocab_size`` and ``requested_vocab_size``.
    Errors: UsageError for impossible settings, DataError when there is no text at all.
    """
    import sentencepiece as spm

    if model_type not in ("unigram", "bpe"):
        raise UsageError(f"model_type: expected 'unigram' or 'bpe', got {model_type!r}")
    if vocab_size < len(SPECIAL_IDS) + 256 * byte_fallback + 1:
        raise UsageError(f"vocab_size: {vocab_size} is too small (5 special ids"
                         f"{' + 256 byte-fallback pieces' if byte_fallback else ''} + at least one piece)")
    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    if jieba:
        _import_jieba()
    counts = {"texts": 0, "split_texts": 0, "split_pieces": 0}
    limit = max_sentence_length // 2 if jieba else max_sentence_length  # jieba adds a delimiter per word

    failure: list[BaseException] = []   # SentencePiece turns an error of our iterator into "INTERNAL: ..."

    def pieces(it: Iterator[str]) -> Iterator[str]:
        try:
            for t in it:
                counts["texts"] += 1
                parts = split_long(t, limit - 1)
                if len(parts) > 1:
                    counts["split_texts"] += 1
                    counts["split_pieces"] += len(parts)
                yield from parts
        except BaseException as e:
            failure.append(e)
            raise

    texts = iter(texts)
    first = next(texts, None)
    while first is not None and not first:
        first = next(texts, None)
    if first is None:
        raise DataError("the corpus has no text to train a tokenizer on (every document was empty or invalid)")
    stream = pieces(itertools.chain([first], texts))
    if jieba:
        def sentences() -> Iterator[str]:
            for t in stream:
                yield _DELIM.join(w for w in jieba_cut(t) if w)
    else:
        def sentences() -> Iterator[str]:
            yield from stream

    spm.set_random_generator_seed(seed if seed else 1)  # sentence sampling is reproducible
    try:
        _train(spm, sentences(), model_prefix, vocab_size, model_type, character_coverage, byte_fallback,
               input_sentence_size, num_threads, max_sentence_length, jieba)
    except RuntimeError as e:
        if failure:
            raise failure[0] from None
        if "Vocabulary size is smaller than required_chars" in str(e):
            raise UsageError(f"vocab_size: {vocab_size} is smaller than the characters needed for "
                             f"character_coverage {character_coverage} ({str(e).split('.')[-3].strip()}); "
                             f"raise vocab_size or lower character_coverage") from None
        raise
    model = Path(str(model_prefix) + ".model")
    got = Tokenizer(model).vocab_size  # also checks the special ids
    if counts["split_texts"]:
        log.warning("tokenizer training: %d documents longer than %d bytes were split into %d pieces (SentencePiece "
                    "drops longer sentences)", counts["split_texts"], limit - 1, counts["split_pieces"])
    if got < vocab_size:
        log.warning("tokenizer: %d pieces, fewer than the %d asked for: the corpus is too small or too repetitive "
                    "for that vocabulary (%d documents)", got, vocab_size, counts["texts"])
    if report is not None:
        report.update(counts, vocab_size=got, requested_vocab_size=vocab_size)
    return model


def _train(spm, sentences, model_prefix, vocab_size, model_type, character_coverage, byte_fallback,
           input_sentence_size, num_threads, max_sentence_length, jieba) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        num_threads=num_threads or os.cpu_count() or 1,
        max_sentence_length=max_sentence_length,
        hard_vocab_limit=False,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        pad_id=SPECIAL_IDS["pad"], pad_piece=SPECIAL_TOKENS["pad"],
        unk_id=SPECIAL_IDS["unk"], unk_piece=SPECIAL_TOKENS["unk"],
        bos_id=-1, eos_id=-1,
        control_symbols=[SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"], SPECIAL_TOKENS["mask"]],
        # The space piece must exist even when the training text has no spaces (typical for Chinese),
        # else a space would byte-fall-back to the bytes of U+2581 and decode as '▁', not ' '.
        user_defined_symbols=["\u2581"],
        pretokenization_delimiter=_DELIM if jieba else "",
        minloglevel=2,
    )


def word_lengths(docs: Sequence[Sequence[str] | np.ndarray], total: int) -> np.ndarray:
    """The characters of every word of ``docs`` (each a list of words, or already their lengths: an int
    array, as :func:`~data_pipeline.corpus.normalize_records` gives them), concatenated (int64 [total])."""
    if not any(isinstance(w, np.ndarray) for w in docs):
        return np.fromiter(map(len, itertools.chain.from_iterable(docs)), np.int64, total)
    return np.concatenate([w if isinstance(w, np.ndarray) else np.fromiter(map(len, w), np.int64, len(w))
                           for w in docs]).astype(np.int64, copy=False)


_ASCII_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_PROBE = ["中文，全角１２ text 123", "", "𠀀龘 [SEP]"]


def _buffer_encoder(sp) -> Optional[Callable[[list], list]]:
    """SentencePiece's batch encoding into int32 buffers, one thread (what its ``out_type="numpy"`` wraps, without
    an array object per text), or None where this sentencepiece has no such call or it disagrees with ``Encode``
    on a probe."""
    fn = getattr(getattr(sp, "_processor", None), "_EncodeAsBufferBatch", None)
    if fn is None:
        return None

    def encode(texts: list) -> list:          # of str or UTF-8 bytes
        # (input, num_threads, thread_pool, enable_sampling, nbest_size, alpha, add_bos, add_eos, reverse)
        return fn(texts, 1, None, False, 0, 0.0, False, False, False)

    try:
        got = [np.frombuffer(b, np.int32).tolist() for b in encode(_PROBE)]
    except (TypeError, ValueError, RuntimeError):
        return None
    return encode if got == sp.Encode(_PROBE) else None


class Tokenizer:
    """A loaded SentencePiece model with the project's special ids and word-start marks."""

    def __init__(self, path: str | os.PathLike, jieba: bool = False, *, model: Optional[bytes] = None):
        """Load ``path`` (or, with ``model``, the serialized model; ``path`` then only names it)."""
        import sentencepiece as spm

        self.path = Path(path)
        if model is None and not self.path.is_file():
            raise DataError(f"tokenizer {self.path}: no such file (expected a SentencePiece .model)")
        self.sp = spm.SentencePieceProcessor()
        try:
            if model is None:
                self.sp.Load(str(self.path))
            else:
                self.sp.LoadFromSerializedProto(model)
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer {self.path}: not a SentencePiece model ({e})") from None
        self._model = model
        self.jieba = jieba
        self.vocab_size = self.sp.GetPieceSize()
        self.special_ids = dict(SPECIAL_IDS)
        for key, tok in SPECIAL_TOKENS.items():
            got = self.sp.PieceToId(tok)
            if got != SPECIAL_IDS[key] or self.sp.IdToPiece(SPECIAL_IDS[key]) != tok:
                raise DataError(f"tokenizer {self.path}: {tok} must have id {SPECIAL_IDS[key]}, has id {got} "
                                 f"(train it with data_pipeline.tokenizer.train_tokenizer)")
        self.dtype = np.dtype("uint16") if self.vocab_size <= 1 << 16 else np.dtype("uint32")
        self._tables = False
        self._buffers = None if jieba else _buffer_encoder(self.sp)
        self.reads_utf8 = not jieba         # encode_flat / encode_marked take texts as UTF-8 bytes too

    def __getattr__(self, name: str):
        # the per-piece tables of word_marks, built on first use (from the whole vocabulary)
        if name in ("char_len", "_flags") and not self._tables:
            self._build_tables()
            return getattr(self, name)
        raise AttributeError(name)

    def _build_tables(self) -> None:
        self._tables = True
        n = self.vocab_size
        ids = list(range(n))
        pieces = self.sp.IdToPiece(ids)
        byte = np.array(self.sp.IsByte(ids), bool)
        plain = ~(byte | np.array(self.sp.IsControl(ids), bool) | np.array(self.sp.IsUnknown(ids), bool))
        texts = [p.replace("\u2581", " ") if ok else "" for p, ok in zip(pieces, plain.tolist())]
        byte_ids = np.flatnonzero(byte)
        value = np.array([int(pieces[i][3:5], 16) for i in byte_ids], np.int64)
        cont_byte = np.zeros(n, bool)               # byte-fallback piece of a UTF-8 continuation byte
        cont_byte[byte_ids] = (value >= 0x80) & (value < 0xC0)
        self.char_len = np.fromiter(map(len, texts), np.int64, n)  # characters each piece starts in the text
        self.char_len[byte_ids] = ~cont_byte[byte_ids]             # (byte fallback: at a character's lead byte)
        prefixed = np.fromiter((p.startswith("\u2581") for p in pieces), bool, n) & plain
        starts_alnum = np.fromiter((t[:1] in _ASCII_ALNUM for t in texts), bool, n)
        ends_alnum = np.fromiter((t[-1:] in _ASCII_ALNUM for t in texts), bool, n)
        # one gather per token: bit 0 "continues a letter/digit run when the piece before ends one" (no '▁'
        # before it), bit 1 "ends a letter/digit run", bit 2 "a UTF-8 continuation byte"
        self._flags = ((starts_alnum & ~prefixed) | ends_alnum << 1 | cont_byte << 2).astype(np.uint8)

    def _continues(self, ids: np.ndarray) -> np.ndarray:
        """bool per token: it continues the word of the token before (a run of ASCII letters/digits without '▁',
        or a UTF-8 continuation byte of byte fallback); the first token never does."""
        f = self._flags[ids]
        cont = np.zeros(len(ids), bool)
        if len(ids) > 1:
            cont[1:] = ((f[1:] & (f[:-1] >> 1) & 1) | (f[1:] >> 2)).astype(bool)
        return cont

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._model).hexdigest() if self._model is not None else sha256_file(self.path)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of a normalised text (int64)."""
        if self.jieba:
            words = [w for w in jieba_cut(text) if w]
            ids = self.sp.Encode(words) if words else []
            return np.fromiter((i for w in ids for i in w), np.int64)
        return np.asarray(self.sp.Encode(text), np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self.jieba:
            return [self.encode(t) for t in texts]
        return [np.asarray(ids, np.int64) for ids in self.sp.Encode(list(texts))]

    def encode_flat(self, texts: Sequence[str] | Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of normalised texts (str, or UTF-8 bytes where :attr:`reads_utf8`), concatenated (int32 or
        int64 [total]), and each text's count (int64 [n])."""
        if self.jieba:
            arrays = [self.encode(t) for t in texts]
            lengths = np.fromiter(map(len, arrays), np.int64, len(arrays))
            return (np.concatenate(arrays) if arrays else np.zeros(0, np.int64)), lengths
        if self._buffers is not None:                  # no Python int per token
            views = list(map(memoryview, self._buffers(list(texts))))
            return np.frombuffer(b"".join(views), np.int32), np.fromiter(map(len, views), np.int64, len(views))
        ids = self.sp.Encode(list(texts), num_threads=1)   # one thread: the builder runs one process per core
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(lengths.sum())), lengths

    def encode_marked(self, texts: Sequence[str] | Sequence[bytes],
                      words: Optional[Sequence[Optional[Sequence[str]]]] = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids int32/int64 [total], each text's count int64 [n], :meth:`word_marks_flat` uint8 [total]) of
        normalised texts; ``words[i]``: the gold words of text i (or their lengths, :func:`word_lengths`) or None."""
        ids, lengths = self.encode_flat(texts)
        keep = np.flatnonzero(lengths)
        if len(keep) < len(lengths):                   # texts that encode to nothing have no marks
            texts = [texts[i] for i in keep]
            words = None if words is None else [words[i] for i in keep]
        return ids, lengths, self.word_marks_flat(ids, lengths[keep], texts, words)

    def word_marks_flat(self, ids: np.ndarray, lengths: np.ndarray, texts: Sequence[str],
                        words: Optional[Sequence[Optional[Sequence[str]]]] = None) -> np.ndarray:
        """:meth:`word_marks` of many documents at once: ``ids``/``lengths`` as :meth:`encode_flat` returns
        them (every length > 0), ``words[i]`` the gold words of document i or None. uint8 [total]."""
        n = len(ids)
        if n == 0:
            return np.zeros(0, np.uint8)
        firsts = np.zeros(len(lengths), np.int64)                    # index of each document's first token
        np.cumsum(lengths[:-1], out=firsts[1:])
        cont = self._continues(ids)
        cont[firsts] = False
        marks = (~cont).astype(np.uint8)
        if words is None and self.jieba:
            words = [[w for w in jieba_cut(t) if w] for t in texts]
        if words is None or all(w is None for w in words):
            return marks
        has = np.fromiter((w is not None for w in words), bool, len(words))
        doc_of = np.repeat(np.arange(len(lengths)), lengths)
        clen = self.char_len[ids]
        before = np.cumsum(clen) - clen                               # chars before each token (all documents)
        tok_start = before - before[firsts][doc_of]                   # ... within its document
        with_words = [w for w in words if w is not None]
        num_words = np.fromiter(map(len, with_words), np.int64, len(with_words))
        wlen = word_lengths(with_words, int(num_words.sum()))
        text_len = np.zeros(len(lengths), np.int64)                   # chars of each document (its words' sum)
        wdoc = np.repeat(np.flatnonzero(has), num_words)
        text_len[:] = np.bincount(wdoc, weights=wlen, minlength=len(lengths))    # exact: sums far below 2**53
        base = np.zeros(len(lengths) + 1, np.int64)                   # a slot of text_len + 1 per document
        np.cumsum(text_len + 1, out=base[1:])
        wbefore = np.cumsum(wlen) - wlen
        wfirst = np.zeros(len(with_words), np.int64)
        np.cumsum(num_words[:-1], out=wfirst[1:])
        wstart = wbefore - np.repeat(wbefore[wfirst] if len(wfirst) else wfirst, num_words)
        is_start = np.zeros(int(base[-1]), bool)
        is_start[base[wdoc] + wstart] = True
        gold = is_start[base[doc_of] + np.minimum(tok_start, text_len[doc_of])]
        gold[firsts] = True
        return np.where(has[doc_of], gold, marks.astype(bool)).astype(np.uint8)

    def decode(self, ids) -> str:
        return self.sp.Decode([int(i) for i in np.asarray(ids).ravel()])

    def id_to_piece(self, i: int) -> str:
        return self.sp.IdToPiece(int(i))

    def word_marks(self, text: str, ids: np.ndarray, words: Optional[Sequence[str]] = None) -> np.ndarray:
        """uint8 per token, 1 where a word starts.

        With ``words`` (gold segmentation, or jieba's), a token starts a word when its first
        character is a word's first character (a piece spanning two words belongs to the first).
        Without, a token starts a word unless it continues a run of ASCII letters/digits
        (no '▁' before it) or is a UTF-8 continuation byte of byte fallback: every Chinese
        piece is then its own word.
        """
        ids = np.asarray(ids, np.int64)
        n = len(ids)
        if n == 0:
            return np.zeros(0, np.uint8)
        if words is None and self.jieba:
            words = [w for w in jieba_cut(text) if w]
        if words is not None:
            tok_starts = np.zeros(n, np.int64)
            np.cumsum(self.char_len[ids][:-1], out=tok_starts[1:])
            wlen = np.fromiter(map(len, words), np.int64, len(words))
            total = int(wlen.sum())
            is_start = np.zeros(total + 1, bool)
            is_start[np.concatenate(([0], np.cumsum(wlen)[:-1]))] = True
            marks = is_start[np.minimum(tok_starts, total)]
            marks[0] = True
            return marks.astype(np.uint8)
        return (~self._continues(ids)).astype(np.uint8)
