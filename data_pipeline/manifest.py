"""The shard-set manifest: reading and validating it, and checking it against its tokenizer.

``manifest.json`` (format 2) describes a shard set::

    format        2 (blocks of documents per tar member, :mod:`.tario`); 1 (a member pair per document,
                  sets written before) is read too; any other value is refused
    tokenizer     {path: "tokenizer.model" (a file of the set) or null, sha256: hex or null,
                   kind: "tokenizer-json" | "wordpiece-vocab" (an imported tokenizer; absent: our
                   SentencePiece model, "sentencepiece")}
    vocab_size    pieces of the tokenizer (the model's embedding rows), at most MAX_VOCAB_SIZE
    special_ids   {pad, unk, cls, sep, mask}: ours {0, 1, 2, 3, 4}; an imported tokenizer's are those
                  of its [PAD] [UNK] [CLS] [SEP] [MASK] tokens (BERT's vocab.txt: 0, 100, 101, 102, 103)
    dtype         "uint16" (vocab_size <= 65536) or "uint32": the token ids in the shards
    wwm           true when the shards carry word-start marks (.wwm members)
    num_docs, num_tokens   totals over the shards
    shards        [{name: shard-NNNNNN.tar, num_docs, num_tokens, sha256, bytes}, ...]

A manifest is only written once every shard it lists is complete (atomically, last), and a set is
only moved into place once its manifest exists (:class:`data_pipeline.atomic.StagedDir`).

A manifest is untrusted input: what it names is joined to the set's location or put into its URL
(a ``pipe:`` command), and what it counts sizes what is read. So ``shards[i].name`` must match
``shard-NNNNNN.tar`` (ASCII digits, nothing after), ``tokenizer.path`` must be a plain file name
inside the set (:func:`~data_pipeline.source.check_name`: no ``/``, ``..``, control characters; an
older manifest with a relative or absolute path is refused, naming the field), and numbers are
bounded: ``vocab_size`` at most ``MAX_VOCAB_SIZE`` (2**24), a shard's ``num_docs``,
``num_tokens`` and ``bytes`` at most ``MAX_SHARD_BYTES`` (16 GiB). ``bytes`` (the shard file's
size, written since this field exists; optional) bounds each read of a shard: a shard file
with more is refused without reading past byte ``bytes + 1``; without it the bound is what the
shard's documents can take in the tar format, twice over (:func:`shard_byte_limit`). The manifest
itself is read up to ``MAX_MANIFEST_BYTES`` (256 MiB), the tokenizer up to
``MAX_TOKENIZER_BYTES`` (256 MiB); JSON nested too deeply for the parser is a DataError.

Checks, each raising :class:`~data_pipeline.errors.DataError` naming the file and field:
:func:`read_manifest` (structure, types, totals, names, bounds), :func:`check_tokenizer` (the
tokenizer file against the manifest: sha256, vocabulary size, special ids, dtype) and
:func:`check_training_data` (what the trainer runs before it builds a model: the training set,
the eval set against it, the model's vocabulary size and the checkpoint's tokenizer). An error also
carries the field (``DataError.field``) and, from :func:`check_training_data`, which input it is about
(``DataError.input``, ``UsageError.argument``: a role of :mod:`.errors`, which the caller names in its
own words: this module knows no config keys or flags).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
from pathlib import Path
from typing import Optional

from .errors import EVAL_SET, MODEL_VOCAB_SIZE, TRAINING_SET, DataError, UsageError
from .imported import KINDS, manifest_kind, tokenizer_facts
from .source import ShardSource, TooLargeError, UrlError, check_name, name_problem
from .tario import MAX_SHARD_BYTES
from .tokenizer import SPECIAL_IDS, SPECIAL_TOKENS, sha256_file

__all__ = ["FORMAT_VERSION", "READ_FORMATS", "MANIFEST", "SHARD_NAME", "read_manifest", "parse_manifest",
           "tokenizer_path", "read_tokenizer", "check_tokenizer", "check_same_tokenizer", "check_training_data",
           "as_source", "dtype_for",
           "shard_byte_limit", "MAX_VOCAB_SIZE", "MAX_SHARD_BYTES", "MAX_MANIFEST_BYTES", "MAX_TOKENIZER_BYTES"]

FORMAT_VERSION = 2
"""What the builders write: format 2 stores documents in blocks (:mod:`.tario`)."""
READ_FORMATS = (1, 2)
"""What the readers take: format 1 (one tar member pair per document) reads as it always did."""
MANIFEST = "manifest.json"
SHARD_NAME = re.compile(r"^shard-[0-9]{6,}\.tar\Z")
MAX_VOCAB_SIZE = 1 << 24
"""The largest ``vocab_size`` a manifest may state (the masker draws random tokens from 24 bits)."""
MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest read (about a million shards)."""
MAX_TOKENIZER_BYTES = 256 << 20
"""The largest tokenizer file read (SentencePiece models of a million pieces are about 20 MB)."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def as_source(location) -> ShardSource:
    return location if isinstance(location, ShardSource) else ShardSource(location)


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlevel = 3


def _field_error(path, key: str, expected: str, got) -> DataError:
    return DataError(f"{path}: field {key!r}: expected {expected}, got {_REPR.repr(got)}", field=key)


def read_manifest(location) -> dict:
    """Read and validate the manifest of a shard set (directory, URL prefix or ShardSource)."""
    src = as_source(location)
    where = src.child(MANIFEST)
    if not src.is_url:
        if not src.location.is_dir():
            raise DataError(f"{src}: not a shard set (no such directory)")
        if not (src.location / MANIFEST).is_file():
            raise DataError(f"{src}: not a shard set (no {MANIFEST}; make one with `roformer-data prepare` "
                            f"or `roformer-data shards`)")
    try:
        raw = src.read(MANIFEST, "manifest", MAX_MANIFEST_BYTES)
    except TooLargeError:
        raise DataError(f"{where}: larger than {MAX_MANIFEST_BYTES} bytes (MAX_MANIFEST_BYTES): not a manifest") \
            from None
    except UrlError as e:
        raise DataError(f"{src}: not a readable shard set ({e})") from None
    except OSError as e:
        raise DataError(f"{where}: cannot read ({e.strerror})") from None
    return parse_manifest(raw, where)


def _count(value, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def _check_shard(path, i: int, s, names: set) -> None:
    key = f"shards[{i}]"
    if not isinstance(s, dict):
        raise _field_error(path, key, "an object {name, num_docs, num_tokens, sha256}", s)
    if not isinstance(s.get("name"), str) or not SHARD_NAME.match(s["name"]):
        raise _field_error(path, f"{key}.name", "a file name like shard-000000.tar", s.get("name"))
    if s["name"] in names:
        raise _field_error(path, f"{key}.name", "a unique name", s["name"])
    names.add(s["name"])
    for k in ("num_docs", "num_tokens"):
        if not _count(s.get(k), MAX_SHARD_BYTES):
            raise _field_error(path, f"{key}.{k}", f"a non-negative integer (at most {MAX_SHARD_BYTES})", s.get(k))
    if not isinstance(s.get("sha256"), str) or not _HEX64.match(s["sha256"]):
        raise _field_error(path, f"{key}.sha256", "64 lowercase hex digits", s.get("sha256"))
    if "bytes" in s and not _count(s["bytes"], MAX_SHARD_BYTES):
        raise _field_error(path, f"{key}.bytes", f"the shard's size in bytes (at most {MAX_SHARD_BYTES})", s["bytes"])


def _check_tokenizer_entry(path, tok: dict) -> None:
    for k in ("path", "sha256"):
        if k not in tok or not (tok[k] is None or isinstance(tok[k], str)):
            raise _field_error(path, f"tokenizer.{k}", "a string (or null for a synthetic set)", tok.get(k))
    problem = None if tok["path"] is None else name_problem(tok["path"])
    if problem is not None:
        raise DataError(f"{path}: field 'tokenizer.path': expected a plain file name inside the set (like "
                        f"tokenizer.model), got {_REPR.repr(tok['path'])}: {problem}", field="tokenizer.path")
    if tok["sha256"] is not None and not _HEX64.match(tok["sha256"]):
        raise _field_error(path, "tokenizer.sha256", "64 lowercase hex digits", tok["sha256"])
    if "kind" in tok and tok["kind"] not in KINDS:
        raise _field_error(path, "tokenizer.kind", " or ".join(map(repr, KINDS)), tok["kind"])


def parse_manifest(raw: bytes | str, path) -> dict:
    """Validate manifest JSON (see the module docstring); DataError naming ``path`` and the field."""
    try:
        m = json.loads(raw)
    except RecursionError:
        raise DataError(f"{path}: not a manifest (JSON nested too deeply)") from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(m).__name__}")

    def req(key, types, expected):
        if key not in m:
            raise DataError(f"{path}: missing field {key!r} ({expected})", field=key)
        if not isinstance(m[key], types) or (isinstance(m[key], bool) and types is int):
            raise _field_error(path, key, expected, m[key])
        return m[key]

    readable = f"format version {FORMAT_VERSION} (or {', '.join(map(str, READ_FORMATS[:-1]))})"
    if req("format", int, readable) not in READ_FORMATS:
        raise _field_error(path, "format", readable, m["format"])
    _check_tokenizer_entry(path, req("tokenizer", dict, "an object {path, sha256}"))
    vocab = req("vocab_size", int, "a positive integer")
    if not 0 < vocab <= MAX_VOCAB_SIZE:
        raise _field_error(path, "vocab_size", f"a positive integer (at most {MAX_VOCAB_SIZE})", vocab)
    sp = req("special_ids", dict, "an object {pad, unk, cls, sep, mask}")
    for k in SPECIAL_IDS:
        if not _count(sp.get(k), vocab - 1):
            raise _field_error(path, f"special_ids.{k}", f"an id in [0, {vocab})", sp.get(k))
    dtype = req("dtype", str, "'uint16' or 'uint32'")
    if dtype not in ("uint16", "uint32"):
        raise _field_error(path, "dtype", "'uint16' or 'uint32'", dtype)
    if dtype == "uint16" and vocab > 1 << 16:
        raise _field_error(path, "dtype", f"uint32 for vocab_size {vocab}", dtype)
    m.setdefault("wwm", False)
    if not isinstance(m["wwm"], bool):
        raise _field_error(path, "wwm", "true or false", m["wwm"])
    shards = req("shards", list, "a non-empty list of shard entries")
    if not shards:
        raise _field_error(path, "shards", "a non-empty list of shard entries", shards)
    names: set = set()
    for i, s in enumerate(shards):
        _check_shard(path, i, s, names)
    for k in ("num_docs", "num_tokens"):
        total = sum(s[k] for s in shards)
        if req(k, int, "a non-negative integer") != total:
            raise _field_error(path, k, f"the sum over shards ({total})", m[k])
    return m


def shard_byte_limit(entry: dict, itemsize: int) -> int:
    """The most bytes a read of the shard of manifest ``entry`` takes: its ``bytes`` when the manifest has
    them (every set written since format 2), else twice what its documents can take in the tar format
    (format 1's layout, the larger: two members of a header and padding each, ``itemsize + 1`` bytes a
    token, the end blocks) plus 1 MiB, at most MAX_SHARD_BYTES."""
    if "bytes" in entry:
        return int(entry["bytes"])
    need = 2 * 1024 * entry["num_docs"] + (itemsize + 1) * entry["num_tokens"] + 11264
    return min(MAX_SHARD_BYTES, 2 * need + (1 << 20))


# --------------------------------------------------------------------------- the tokenizer of a set


def tokenizer_path(shard_dir, manifest: dict) -> Optional[Path]:
    """The tokenizer file of a local shard set (a file of the set: ``parse_manifest`` checked the name)."""
    p = manifest["tokenizer"]["path"]
    return None if p is None else Path(str(shard_dir)) / check_name(p, f"{shard_dir}: field 'tokenizer.path'")


def read_tokenizer(location, manifest: dict) -> Optional[bytes]:
    """The bytes of the set's own tokenizer file (None for a set made without one)."""
    src = as_source(location)
    rel = manifest["tokenizer"]["path"]
    if rel is None:
        return None
    where, key = f"{src.child(MANIFEST)}: field 'tokenizer.path'", "tokenizer.path"
    try:
        return src.read(rel, "tokenizer", MAX_TOKENIZER_BYTES)
    except TooLargeError:
        raise DataError(f"{where}: the tokenizer {src.child(rel)} is larger than {MAX_TOKENIZER_BYTES} "
                        "bytes (MAX_TOKENIZER_BYTES): not a tokenizer", field=key) from None
    except FileNotFoundError:
        raise DataError(f"{where}: the tokenizer {src.child(rel)} is missing", field=key) from None
    except UrlError as e:
        raise DataError(f"{where}: {e}", field=key) from None
    except OSError as e:
        raise DataError(f"{where}: cannot read the tokenizer {src.child(rel)} ({e.strerror})", field=key) from None


def check_tokenizer(location, manifest: Optional[dict] = None, *, tokenizer: str | os.PathLike | None = None,
                    sha256: Optional[str] = None, vocab_size: Optional[int] = None) -> None:
    """DataError unless the set's tokenizer and manifest agree, naming the disagreeing field.

    Without ``tokenizer``/``sha256`` the set's own tokenizer (of ``tokenizer.kind``) is checked: its
    sha256 against ``tokenizer.sha256``, its size against ``vocab_size``, its special-token ids against
    ``special_ids``. With ``tokenizer`` (a file) or ``sha256``, that tokenizer must be the one the set
    was made with. ``vocab_size``: what a model expects (``vocab_size mismatch`` otherwise).
    """
    src = as_source(location)
    manifest = manifest if manifest is not None else read_manifest(src)
    mpath = src.child(MANIFEST)
    want = manifest["tokenizer"]["sha256"]
    name = tokenizer
    if tokenizer is not None:
        sha256 = sha256_file(tokenizer)
    elif sha256 is None and manifest["tokenizer"]["path"] is not None:
        model = read_tokenizer(src, manifest)
        name = src.child(manifest["tokenizer"]["path"])
        sha256 = hashlib.sha256(model).hexdigest()
        if want is not None and sha256 != want:
            raise DataError(f"{mpath}: field 'tokenizer.sha256': tokenizer mismatch: the shards were made with a "
                            f"tokenizer of sha256 {want[:16]}..., but {name} has sha256 {sha256[:16]}...",
                            field="tokenizer.sha256")
        size, ids = tokenizer_facts(model, str(name), manifest_kind(manifest))
        if size != manifest["vocab_size"]:
            raise DataError(f"{mpath}: field 'vocab_size' is {manifest['vocab_size']}, but the tokenizer {name} has "
                            f"{size} pieces (the manifest was edited or belongs to another tokenizer)",
                            field="vocab_size")
        for key, got in ids.items():
            if manifest["special_ids"][key] != got:
                raise DataError(f"{mpath}: field 'special_ids.{key}' is {manifest['special_ids'][key]}, but the "
                                f"tokenizer {name} has {SPECIAL_TOKENS[key]} at id {got}", field=f"special_ids.{key}")
        if manifest["dtype"] != dtype_for(size):
            raise DataError(f"{mpath}: field 'dtype' is {manifest['dtype']!r}, expected {dtype_for(size)!r} for "
                            f"{size} pieces", field="dtype")
    if sha256 is not None and want is not None and sha256 != want:
        raise DataError(f"{mpath}: field 'tokenizer.sha256': tokenizer mismatch: the shards were made with a "
                        f"tokenizer of sha256 {want[:16]}..., but {name or 'the given tokenizer'} has sha256 "
                        f"{sha256[:16]}...", field="tokenizer.sha256")
    if vocab_size is not None and vocab_size != manifest["vocab_size"]:
        raise DataError(f"{mpath}: vocab_size mismatch: the shards have vocab_size {manifest['vocab_size']}, "
                        f"the model expects {vocab_size}", field="vocab_size")


def check_same_tokenizer(m: dict, ref: dict, where: str, ref_name: str, *,
                         input: Optional[str] = None) -> None:  # noqa: A002
    """A DataError unless manifest ``m`` (described by ``where``) has the tokenizer of ``ref`` (``ref_name``):
    the same model (sha256), ``vocab_size``, ``special_ids`` and ``dtype``. ``input``: the error's role."""
    a, b = m["tokenizer"]["sha256"], ref["tokenizer"]["sha256"]
    if a != b:
        raise DataError(f"{where}: field 'tokenizer.sha256' is {a and a[:16]}..., {ref_name} is {b and b[:16]}...: "
                        "made with another tokenizer", input=input, field="tokenizer.sha256")
    for key in ("vocab_size", "special_ids", "dtype"):
        if m[key] != ref[key]:
            raise DataError(f"{where}: field {key!r} is {m[key]!r}, {ref_name} is {ref[key]!r}", input=input,
                            field=key)


def check_training_data(shards, eval_shards=None, *, model_vocab_size: Optional[int] = None,
                        checkpoint_tokenizer_sha256: Optional[str] = None) -> dict:
    """The checks made before training starts; returns the training set's manifest.

    Each set's manifest against its own tokenizer (:func:`check_tokenizer`); the eval set against
    the training set (tokenizer sha256, vocab_size, special_ids, dtype), the model's vocabulary size
    (None = take it from the manifest) and the tokenizer recorded in the checkpoint being resumed.
    Each error says which input it is about (``DataError.input``: :data:`~.errors.TRAINING_SET`,
    :data:`~.errors.EVAL_SET`; ``UsageError.argument``: :data:`~.errors.TRAINING_SET` when none is given,
    :data:`~.errors.MODEL_VOCAB_SIZE`) for the caller to name in its words, and the manifest field.
    """
    if not shards:
        raise UsageError("no training shard set given (a directory or URL made by `roformer-data prepare`)",
                         argument=TRAINING_SET)
    m = _checked_set(shards, TRAINING_SET)
    vocab, sha = m["vocab_size"], m["tokenizer"]["sha256"]
    if model_vocab_size is not None and model_vocab_size != vocab:
        raise UsageError(f"{model_vocab_size} differs from the shard manifest's vocab_size {vocab} "
                         f"({as_source(shards).child(MANIFEST)})", argument=MODEL_VOCAB_SIZE)
    if eval_shards:
        ev = _checked_set(eval_shards, EVAL_SET)
        check_same_tokenizer(ev, m, str(as_source(eval_shards).child(MANIFEST)), "the training set's", input=EVAL_SET)
    if checkpoint_tokenizer_sha256 and checkpoint_tokenizer_sha256 != sha:
        raise DataError(f"tokenizer sha256 {sha and sha[:12]} differs from the checkpoint's "
                        f"{checkpoint_tokenizer_sha256[:12]}; resuming on shards of another tokenizer would "
                        "scramble the vocabulary", input=TRAINING_SET, field="tokenizer.sha256")
    return m


def _checked_set(location, role: str) -> dict:
    """The manifest of the set at ``location``, checked against its own tokenizer; an error names ``role``."""
    try:
        m = read_manifest(location)
        check_tokenizer(location, m)
    except DataError as e:
        raise e.naming(role) from None
    return m
