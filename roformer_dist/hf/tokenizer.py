"""Our tokenizer as an HF ``tokenizers`` pipeline (``tokenizer.json``), so that
``transformers.AutoTokenizer.from_pretrained(export_dir)`` gives the ids the model was trained on.

What the shards were made with (``data_pipeline``): :func:`data_pipeline.corpus.normalize` (NFKC, Cc/Cf
characters removed, whitespace runs -> one space, stripped), then SentencePiece (Unigram) with identity
normalisation, no dummy prefix, spaces kept as ``▁``, byte fallback, and ``[CLS] ... [SEP]`` around each
document. The same pipeline in ``tokenizers``:

    normalizer      Sequence[NFKC, Replace(controls, ""), Replace(whitespace runs, " "), Strip]
                    (the character classes are enumerated from Python's ``unicodedata``, like corpus.py)
    pre-tokenizer   Split(the text of an unreachable piece, after its first character) + Metaspace("▁",
                    never prepend, no split): see "unreachable pieces" below
    model           Unigram(pieces, scores, unk_id=1, byte_fallback=True); for a BPE SentencePiece model
                    BPE(pieces, merges: every split of a piece into two pieces, by the piece's rank)
    post-processor  [CLS] $A [SEP]  /  [CLS] $A [SEP] $B:1 [SEP]:1  (token type ids 0 ... 0 1 ... 1)
    decoder         ▁ -> " ", byte fallback, fuse

Scores. SentencePiece's encoder scores a user-defined piece (our ``▁``) as ``bytes * max_score - 0.1``
where ``max_score`` is ``max(FLT_MIN, best normal score)``; we store that value. Control, unknown,
byte and unused pieces are never matched from text by SentencePiece, but ``tokenizers`` puts every
piece in its trie and scores unknown characters ``min(all scores) - 10``: they get the lowest normal
score (so the unknown score stays SentencePiece's) and are made unreachable by a pre-tokenizer split
after their first character (``<`` | ``0xE4>``, ``[`` | ``MASK]``). That split cannot change any other
segmentation as long as no normal piece contains the two characters around it
(:attr:`TokenizerReport.split_conflicts` lists those that do; none in any model we trained).

Where the two can still disagree: SentencePiece accumulates path scores in float32, ``tokenizers`` in
float64, so two segmentations whose scores differ by less than float32's resolution of the running
path score (e.g. 及其|他 vs 及|其他: -15.6152978 vs -15.6152997) may be resolved differently. Measured
in ``bench/hf_tokenizer.py`` and reported in docs/guides/export.md. Literal special-token strings (``[MASK]``) in the
input become the special ids (HF's convention, which fill-mask needs); ``split_special_tokens=True``
tokenises them as text, as our pipeline does. Tokenizers trained with jieba word pre-segmentation
cannot be expressed (jieba is a program, not a ``tokenizers`` component): the export writes the plain
pipeline and says how far its ids are from the training ids (:func:`roundtrip_agreement`).

An imported tokenizer (``data_pipeline.imported``: an HF tokenizer.json or a WordPiece vocab.txt the
shards were made with, with its own special ids) is exported as its own ``tokenizers`` pipeline
(:func:`build_imported_fast_tokenizer`; a vocab.txt as BERT's: BertNormalizer, BertPreTokenizer,
WordPiece) with the same normaliser as above put before its own (the shards hold the ids of the
normalised text) and the ``[CLS] $A [SEP]`` template at its ids; a vocab.txt is copied beside it.
"""

from __future__ import annotations

import json
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.imported import KINDS, SENTENCEPIECE, WORDPIECE_VOCAB, ImportedTokenizer, kind_of
from data_pipeline.tokenizer import SPECIAL_IDS, SPECIAL_TOKENS

__all__ = ["TokenizerReport", "read_sp_model", "build_fast_tokenizer", "build_imported_fast_tokenizer",
           "tokenizer_config", "special_tokens_map", "write_tokenizer_files", "write_imported_tokenizer_files",
           "load_hf_tokenizer", "Agreement", "agreement", "roundtrip_agreement", "TOKENIZER_FILES",
           "MODEL_INPUT_NAMES"]

SPACE = "\u2581"
MODEL_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.txt")
_FLT_MIN = float(np.finfo(np.float32).tiny)


def _onig_class(pred) -> str:
    """A ``tokenizers`` (Oniguruma) character class of every code point where ``pred(char)``."""
    cps = [cp for cp in range(0x110000) if pred(chr(cp))]
    parts, start, prev = [], cps[0], cps[0]
    for cp in cps[1:] + [-1]:
        if cp != prev + 1:
            parts.append(f"\\x{{{start:X}}}" + (f"-\\x{{{prev:X}}}" if prev > start else ""))
            start = cp
        prev = cp
    return "[" + "".join(parts) + "]"


def _normalizer():
    from tokenizers import Regex, normalizers

    # the same sets as data_pipeline.corpus: Cc/Cf except whitespace; whitespace = str.isspace (= re's \s)
    controls = _onig_class(lambda c: unicodedata.category(c) in ("Cc", "Cf") and not c.isspace())
    spaces = _onig_class(str.isspace)
    return normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(controls + "+"), ""),
                                 normalizers.Replace(Regex(spaces + "+"), " "), normalizers.Strip()])


@dataclass
class TokenizerReport:
    """What :func:`read_sp_model` found in a SentencePiece model."""

    path: Path
    vocab: list[tuple[str, float]]
    """(piece, score as tokenizers must see it), in id order."""
    jieba: bool
    """Trained on jieba pre-segmented text (a pretokenization delimiter is set)."""
    model_type: str
    unreachable: list[str] = field(default_factory=list)
    """Pieces SentencePiece never matches from text (control, unknown, byte, unused)."""
    split_conflicts: list[str] = field(default_factory=list)
    """Normal pieces that contain the two characters around an unreachable piece's split point."""
    mergeable: list[str] = field(default_factory=list)
    """Normal and user-defined pieces (what a BPE model's merges may build)."""


def read_sp_model(path: str | os.PathLike) -> TokenizerReport:
    """Pieces and effective scores of one of our SentencePiece models (checks the special ids)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    path = Path(path)
    try:
        proto = pb.ModelProto()
        proto.ParseFromString(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"tokenizer {path}: no such file (expected a SentencePiece .model)") from None
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise DataError(f"tokenizer {path}: not a SentencePiece model ({type(e).__name__}: {e})") from None
    kind = pb.ModelProto.SentencePiece
    pieces = list(proto.pieces)
    if not pieces:
        raise DataError(f"tokenizer {path}: not a SentencePiece model (no pieces)")
    for key, tok in SPECIAL_TOKENS.items():
        i = SPECIAL_IDS[key]
        if i >= len(pieces) or pieces[i].piece != tok:
            raise DataError(f"tokenizer {path}: {tok} must have id {i} (train it with "
                            "data_pipeline.tokenizer.train_tokenizer)")
    model_type = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)
    if model_type not in ("UNIGRAM", "BPE"):
        raise DataError(f"tokenizer {path}: a {model_type} SentencePiece model; the HF export supports the "
                        "unigram and bpe models roformer-data trains (or pass --no-tokenizer)")
    normal = [p.score for p in pieces if p.type == kind.NORMAL]
    lowest = min(normal)
    best = max(max(normal), _FLT_MIN)  # SentencePiece starts its max at FLT_MIN
    vocab, unreachable = [], []
    for p in pieces:
        if p.type == kind.NORMAL:
            score = float(p.score)
        elif p.type == kind.USER_DEFINED:
            score = float(np.float32(len(p.piece.encode("utf-8"))) * np.float32(best)) - 0.1
        else:
            score = float(lowest)
            unreachable.append(p.piece)
        vocab.append((p.piece, score))
    reachable = [p.piece for p in pieces if p.type in (kind.NORMAL, kind.USER_DEFINED)]
    heads = {u[:2] for u in unreachable if len(u) >= 2}
    conflicts = sorted(p for p in reachable if any(h in p for h in heads))
    conflicts += [u for u in unreachable if len(u) < 2]  # a one-character piece cannot be split off
    if model_type == "BPE":  # pieces only arise from merges of normal pieces: nothing to keep out of reach
        unreachable, conflicts = [], []
    return TokenizerReport(path, vocab, bool(proto.trainer_spec.pretokenization_delimiter), model_type,
                           unreachable, conflicts, reachable)


def _unreachable_pattern(unreachable: Sequence[str]) -> Optional[str]:
    """Regex matching, after its first character, the rest of the text of each unreachable piece."""
    import re

    byte_pieces = {f"<0x{b:02X}>" for b in range(256)}
    alts, rest = [], [u for u in unreachable if len(u) >= 2]
    if byte_pieces <= set(rest):  # SentencePiece's byte fallback: all 256, compactly
        alts.append("(?<=<)0x[0-9A-F]{2}>")
        rest = [u for u in rest if u not in byte_pieces]
    for head in sorted({u[0] for u in rest}):
        tails = sorted({re.escape(u[1:]) for u in rest if u[0] == head}, key=lambda t: (-len(t), t))
        alts.append(f"(?<={re.escape(head)})(?:{'|'.join(tails)})")
    return "|".join(alts) or None


def bpe_merges(rep: TokenizerReport) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE model: every split of a piece into two pieces, ranked by the merged
    piece's id (SentencePiece orders BPE pieces by merge priority), then by the parts' ids."""
    ids = {p: i for i, p in enumerate(rep.mergeable)}
    merges = []
    for piece in rep.mergeable:
        parts = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        merges += sorted(parts, key=lambda lr: (ids[lr[0]], ids[lr[1]]))
    return merges


def build_fast_tokenizer(sp_model: str | os.PathLike | TokenizerReport):
    """A ``tokenizers.Tokenizer`` equal to corpus.normalize + our SentencePiece model + [CLS]/[SEP]."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE, Unigram

    rep = sp_model if isinstance(sp_model, TokenizerReport) else read_sp_model(sp_model)
    if rep.model_type == "BPE":
        vocab = {piece: i for i, (piece, _) in enumerate(rep.vocab)}
        model = BPE(vocab, bpe_merges(rep), unk_token=SPECIAL_TOKENS["unk"], byte_fallback=True, fuse_unk=True)
    else:
        model = Unigram(rep.vocab, unk_id=SPECIAL_IDS["unk"], byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = _normalizer()
    steps = []
    pattern = _unreachable_pattern(rep.unreachable)
    if pattern:
        steps.append(pre_tokenizers.Split(Regex(pattern), "merged_with_next"))
    steps.append(pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _frame(tok, SPECIAL_IDS)
    return tok


def _frame(tok, special_ids: dict) -> None:
    """The five special tokens as special added tokens and the [CLS]/[SEP] template, at ``special_ids``."""
    from tokenizers import AddedToken, processors

    order = sorted(special_ids, key=special_ids.get)
    tok.add_special_tokens([AddedToken(SPECIAL_TOKENS[k], special=True, normalized=False) for k in order])
    cls, sep = SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, special_ids["cls"]), (sep, special_ids["sep"])])
    for key, tok_str in SPECIAL_TOKENS.items():
        assert tok.token_to_id(tok_str) == special_ids[key], tok_str


def build_imported_fast_tokenizer(imported: ImportedTokenizer):
    """A ``tokenizers.Tokenizer`` equal to corpus.normalize + the imported tokenizer (as the shards were made)
    + [CLS]/[SEP] at its ids (see the module docstring)."""
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_str(imported.tok.to_str())       # a copy (truncation and padding already off)
    own = tok.normalizer
    tok.normalizer = _normalizer() if own is None else normalizers.Sequence([_normalizer(), own])
    _frame(tok, imported.special_ids)
    return tok


def special_tokens_map() -> dict:
    return {f"{k}_token": v for k, v in SPECIAL_TOKENS.items()}


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json``: the generic fast class (it reads tokenizer.json as it is), our special
    tokens, and token type ids among the model inputs (transformers leaves them out by default)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(model_max_length),
            "padding_side": "right", "truncation_side": "right", "model_input_names": list(MODEL_INPUT_NAMES),
            "clean_up_tokenization_spaces": False, "split_special_tokens": False, **special_tokens_map()}


def _write_fast(out_dir: Path, tok, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json of the ``tokenizers.Tokenizer`` tok."""
    from data_pipeline.atomic import atomic_write_text

    atomic_write_text(out_dir / "tokenizer.json", tok.to_str(pretty=False))
    atomic_write_text(out_dir / "tokenizer_config.json",
                      json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n")
    atomic_write_text(out_dir / "special_tokens_map.json", json.dumps(special_tokens_map(), indent=2) + "\n")


def write_tokenizer_files(out_dir: str | os.PathLike, sp_model: str | os.PathLike, model_max_length: int,
                          rep: Optional[TokenizerReport] = None) -> TokenizerReport:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and tokenizer.model."""
    from data_pipeline.atomic import atomic_write_bytes

    out_dir = Path(out_dir)
    rep = rep or read_sp_model(sp_model)
    _write_fast(out_dir, build_fast_tokenizer(rep), model_max_length)
    atomic_write_bytes(out_dir / "tokenizer.model", Path(sp_model).read_bytes())
    return rep


def write_imported_tokenizer_files(out_dir: str | os.PathLike, imported: ImportedTokenizer,
                                   model_max_length: int) -> None:
    """Write tokenizer.json (:func:`build_imported_fast_tokenizer`), tokenizer_config.json,
    special_tokens_map.json and, for a WordPiece vocabulary, vocab.txt."""
    from data_pipeline.atomic import atomic_write_bytes

    out_dir = Path(out_dir)
    _write_fast(out_dir, build_imported_fast_tokenizer(imported), model_max_length)
    if imported.kind == WORDPIECE_VOCAB:
        atomic_write_bytes(out_dir / KINDS[WORDPIECE_VOCAB], imported.path.read_bytes())


def load_hf_tokenizer(source: str | os.PathLike, model_max_length: int = 512):
    """A transformers fast tokenizer from an export directory (its tokenizer.json, or one built from its
    tokenizer.model when an older export has none), from a SentencePiece model file, or from the imported
    tokenizer.json / vocab.txt of a shard set (as the shards were made: our normaliser first)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(source)
    if source.is_dir() and (source / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(source))
    model = source / "tokenizer.model" if source.is_dir() else source
    if not model.is_file():
        raise DataError(f"{source}: no tokenizer.json or tokenizer.model (expected an export of "
                        "roformer-convert to-hf, or a SentencePiece model)")
    kwargs = tokenizer_config(model_max_length)
    kwargs.pop("tokenizer_class")
    kind = kind_of(model)
    fast = build_fast_tokenizer(model) if kind == SENTENCEPIECE else \
        build_imported_fast_tokenizer(ImportedTokenizer(model, kind))
    return PreTrainedTokenizerFast(tokenizer_object=fast, **kwargs)


@dataclass
class Agreement:
    """How often the HF tokenizer gives the ids of our pipeline."""

    num_docs: int = 0
    num_equal: int = 0
    examples: list[dict] = field(default_factory=list)
    """The first few disagreements: text around the first differing token, both token lists there."""

    @property
    def rate(self) -> float:
        return self.num_equal / self.num_docs if self.num_docs else 1.0

    def summary(self) -> str:
        return (f"{self.num_equal}/{self.num_docs} documents give identical ids "
                f"({100 * self.rate:.2f}%)")


def _record(agr: Agreement, text: str, got: list[int], want: list[int], id_to_piece, max_examples: int) -> None:
    agr.num_docs += 1
    if got == want:
        agr.num_equal += 1
        return
    if len(agr.examples) < max_examples:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        lo = max(0, k - 2)
        agr.examples.append({"text": text[:120], "position": k,
                             "hf": [id_to_piece(i) for i in got[lo:k + 4]],
                             "ours": [id_to_piece(i) for i in want[lo:k + 4]]})


def _ours(tokenizer):
    """The pipeline's tokenizer: ``tokenizer`` when it is one already (SentencePiece or imported), else the
    SentencePiece model at that path."""
    from data_pipeline.tokenizer import Tokenizer

    return Tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer


def agreement(hf_tokenizer, texts: Iterable[str], tokenizer, max_examples: int = 5,
              batch: int = 256) -> Agreement:
    """Raw texts: ``hf_tokenizer(text)`` against ``[CLS] + encode(normalize(text)) + [SEP]``.

    ``hf_tokenizer``: a ``tokenizers.Tokenizer`` or a transformers fast tokenizer; ``tokenizer``: the
    pipeline's (a SentencePiece model path, a ``data_pipeline`` Tokenizer or ImportedTokenizer)."""
    from data_pipeline.corpus import normalize

    backend = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    ours = _ours(tokenizer)
    agr = Agreement()
    texts = list(texts)
    cls, sep = ours.special_ids["cls"], ours.special_ids["sep"]
    for start in range(0, len(texts), batch):
        chunk = texts[start:start + batch]
        for text, enc, ids in zip(chunk, backend.encode_batch(chunk),
                                  ours.encode_batch([normalize(t) for t in chunk])):
            _record(agr, text, enc.ids, [cls, *ids.tolist(), sep], ours.id_to_piece, max_examples)
    return agr


def roundtrip_agreement(hf_tokenizer, shard_dir: str | os.PathLike, tokenizer, max_docs: int = 1000,
                        max_examples: int = 3) -> Agreement:
    """Training documents of a shard set: decode the stored ids to text with ``tokenizer`` (as
    :func:`agreement` takes it; exact for SentencePiece: decode(encode(t)) == t for normalised text; a
    WordPiece decode is the lowercased pieces joined, which re-encodes to the same pieces) and check that
    the HF tokenizer gives the stored ids back (the first ``max_docs``)."""
    from data_pipeline.shards import read_manifest, read_shard

    backend = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    ours = _ours(tokenizer)
    m = read_manifest(shard_dir)
    agr = Agreement()
    for entry in m["shards"]:
        data = read_shard(Path(shard_dir) / entry["name"], m["dtype"], entry)
        docs = [data.tokens[s:s + n].astype(np.int64).tolist() for s, n in zip(data.tok_start, data.lengths)]
        docs = docs[:max_docs - agr.num_docs]
        texts = [ours.decode(d) for d in docs]
        for text, enc, want in zip(texts, backend.encode_batch(texts, add_special_tokens=False), docs):
            _record(agr, text, enc.ids, want, ours.id_to_piece, max_examples)
        if agr.num_docs >= max_docs:
            break
    return agr
