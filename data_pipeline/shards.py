"""Shard sets: building them (in parallel, never over a set that is in use), reading and verifying.

A shard set is a directory (or, for reading, a URL prefix: :mod:`.source`)::

    manifest.json            written last, atomically (:mod:`.manifest` describes its fields)
    tokenizer.model          the SentencePiece model (``prepare`` and ``shards`` put it here), or the
                             imported tokenizer.json / vocab.txt (:mod:`.imported`)
    shard-000000.tar ...     blocks of documents: members <key>.ids, <key>.len and <key>.wwm (:mod:`.tario`
                             describes the format; sets of format 1 hold one document per .ids/.wwm pair)

Building never destroys: the set is written into a staging directory beside its final place and
moved there only when it is complete (:class:`~data_pipeline.atomic.StagedDir`). An existing set
is replaced only with ``force=True`` (``--force``), and then only once the new one is complete; a
failed build leaves nothing behind. Inputs and the output location are checked before any
expensive work.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np

from .atomic import StagedDir, atomic_write_bytes, atomic_write_text
from .corpus import CHUNK_RECORDS, CorpusStats, check_inputs, iter_record_chunks, normalize_records
from .errors import OUTPUT, DataError, UsageError
from .formats import ReadOptions
from .imported import KINDS, SENTENCEPIECE, open_tokenizer
from .manifest import (FORMAT_VERSION, MANIFEST, as_source, check_tokenizer, dtype_for, read_manifest,
                       shard_byte_limit, tokenizer_path)
from .source import TooLargeError, UrlError, read_local_file
from .tario import MAX_SHARD_BYTES, CorruptShardError, ShardData, ShardWriter, iter_tar_members, parse_shard
from .tokenizer import SPECIAL_IDS, sha256_file

__all__ = ["FORMAT_VERSION", "MANIFEST", "CorruptShardError", "ShardData", "read_manifest", "tokenizer_path",
           "check_tokenizer", "iter_tar_members", "read_shard", "load_shard", "verify_shard_set", "ShardWriter",
           "build_shards", "write_shards", "write_shard_set", "stage_output", "write_manifest"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- reading


def _limit(entry: Optional[dict], dtype) -> int:
    return MAX_SHARD_BYTES if entry is None else shard_byte_limit(entry, np.dtype(dtype).itemsize)


def _size_error(where: str, entry: dict, limit: int) -> CorruptShardError:
    says = f"{entry['bytes']} bytes" if "bytes" in entry else f"at most {limit} bytes for its documents"
    return CorruptShardError(f"{where}: the shard is larger than the manifest says ({says}); reading stopped "
                             f"there")


def _check_size(where: str, buf: bytes, entry: Optional[dict]) -> None:
    if entry is not None and "bytes" in entry and len(buf) != entry["bytes"]:
        raise CorruptShardError(f"{where}: truncated (the file has {len(buf)} bytes, the manifest says "
                                f"{entry['bytes']})")


def read_shard(path: str | os.PathLike, dtype: str | np.dtype, entry: Optional[dict] = None,
               verify_hash: bool = True, vocab_size: Optional[int] = None) -> ShardData:
    """Load and index one local shard file (see :func:`~data_pipeline.tario.parse_shard`); no more than the
    manifest ``entry`` allows is read (:func:`~data_pipeline.manifest.shard_byte_limit`)."""
    path = Path(path)
    limit = _limit(entry, dtype)
    try:
        buf = read_local_file(path, limit)
    except FileNotFoundError:
        raise CorruptShardError(f"{path}: shard missing (listed in the manifest, not on disk)") from None
    except TooLargeError:
        raise (_size_error(str(path), entry, limit) if entry is not None else
               CorruptShardError(f"{path}: larger than MAX_SHARD_BYTES ({MAX_SHARD_BYTES} bytes)")) from None
    except DataError as e:
        raise CorruptShardError(str(e)) from None
    except OSError as e:
        raise CorruptShardError(f"{path}: cannot read shard ({e})") from None
    _check_size(str(path), buf, entry)
    return parse_shard(buf, str(path), dtype, entry, verify_hash, vocab_size)


def load_shard(location, manifest: dict, index: int, verify_hash: bool = True, check_ids: bool = True) -> ShardData:
    """Shard ``index`` of the manifest from a directory or URL prefix, its sha256 checked as it is read, no more
    than its manifest entry allows read; ``check_ids``: a token id at or above ``vocab_size`` is a
    CorruptShardError too (the loader checks the ids of each piece it reads instead)."""
    src = as_source(location)
    entry = manifest["shards"][index]
    vocab = manifest["vocab_size"] if check_ids else None
    if not src.is_url:
        return read_shard(src.local_path(entry["name"]), manifest["dtype"], entry, verify_hash, vocab)
    url = src.child(entry["name"])
    limit = _limit(entry, manifest["dtype"])
    try:
        buf = src.read(entry["name"], f"shard {entry['name']}", limit)
    except TooLargeError:
        raise _size_error(url, entry, limit) from None
    except UrlError as e:
        raise CorruptShardError(str(e)) from None
    _check_size(url, buf, entry)
    return parse_shard(buf, url, manifest["dtype"], entry, verify_hash, vocab)


def verify_shard_set(location) -> list[str]:
    """Re-hash and parse every shard and check the tokenizer against the manifest; the problems (empty = OK)."""
    problems = []
    m = read_manifest(location)
    try:
        check_tokenizer(location, m)
    except DataError as e:
        problems.append(str(e))
    for i in range(len(m["shards"])):
        try:
            load_shard(location, m, i)
        except CorruptShardError as e:
            problems.append(str(e))
    return problems


# --------------------------------------------------------------------------- output


def stage_output(out_dir: str | os.PathLike, force: bool = False,
                 replaceable: Optional[tuple[Callable[[Path], bool], str]] = None) -> StagedDir:
    """A staging directory for a new shard set at ``out_dir`` (see the module docstring).

    UsageError (about the :data:`~.errors.OUTPUT`) when ``out_dir`` holds a shard set and ``force`` is not
    set, holds anything else, or cannot be written (checked by creating the staging directory).
    ``replaceable``: (test, what) for another kind of output that ``force`` may replace (``prepare
    --source``'s mixture)."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{out}: exists and is not a directory; choose another --out", argument=OUTPUT)
        entries = list(out.iterdir())
        other = replaceable is not None and bool(entries) and replaceable[0](out)
        if entries and ((out / MANIFEST).is_file() or other):
            if not force:
                what = replaceable[1] if other else "a shard set"
                raise UsageError(f"{out}: {what} is already there; pass --force to replace it (the new "
                                 f"{'one' if other else 'set'} is built beside it and swapped in only when complete)",
                                 argument=OUTPUT)
        elif entries:
            raise UsageError(f"{out}: exists and is not a shard set ({len(entries)} entries, no {MANIFEST}); "
                             "choose another --out or empty it", argument=OUTPUT)
    try:
        return StagedDir(out)
    except OSError as e:
        raise UsageError(f"{out}: cannot write the output there ({e.strerror}: {e.filename})", argument=OUTPUT) \
            from None


def write_manifest(out_dir: Path, manifest: dict) -> None:
    import json

    atomic_write_text(Path(out_dir) / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False))


def _manifest(entries: list[dict], vocab_size: int, dtype: str, tok: Optional[dict], wwm: bool,
              extra: dict, special_ids: dict = SPECIAL_IDS) -> dict:
    return {
        "format": FORMAT_VERSION,
        "tokenizer": tok or {"path": None, "sha256": None},
        "vocab_size": int(vocab_size),
        "special_ids": dict(special_ids),
        "dtype": dtype,
        "wwm": wwm,
        "num_docs": sum(e["num_docs"] for e in entries),
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "shards": entries,
        **extra,
    }


def _tokenizer_entry(path: str, sha256: str, kind: str) -> dict:
    """A manifest's ``tokenizer`` entry; ``kind`` only for an imported tokenizer (older readers and every
    set made before them know only SentencePiece)."""
    return {"path": path, "sha256": sha256, **({} if kind == SENTENCEPIECE else {"kind": kind})}


def _tokenizer_into_set(tokenizer: str | os.PathLike, out_dir: Path, kind: str = SENTENCEPIECE) -> dict:
    """Copy the tokenizer file into the set under its kind's name unless it is already that file; its
    manifest entry ``{path, sha256[, kind]}``."""
    name = KINDS[kind]
    model_path = out_dir / name
    if Path(tokenizer).resolve() != model_path.resolve():
        atomic_write_bytes(model_path, Path(tokenizer).read_bytes())  # names model_path on a full disk
    return _tokenizer_entry(name, sha256_file(model_path), kind)


def write_shard_set(docs: Iterable, out_dir: str | os.PathLike, vocab_size: int, *,
                    shard_size_mb: float = 64.0, max_docs_per_shard: Optional[int] = None,
                    tokenizer: str | os.PathLike | None = None, force: bool = False) -> dict:
    """Write already-tokenised documents (arrays of ids, or (ids, marks) pairs) as a shard set.

    For tests, benchmarks and users who tokenise elsewhere; ``tokenizer`` (optional) is copied into
    the set as ``tokenizer.model`` and hashed into the manifest (a manifest names only files of its set).
    """
    out_dir = Path(out_dir)
    with stage_output(out_dir, force) as stage:
        w = ShardWriter(stage.path, dtype_for(vocab_size), int(shard_size_mb * 1e6), max_docs_per_shard)
        wwm = None
        for d in docs:
            ids, marks = d if isinstance(d, tuple) else (d, None)
            wwm = marks is not None if wwm is None else wwm
            if len(ids):
                w.add(np.asarray(ids), marks)
        w.close_shard()
        if not w.entries:
            raise DataError(f"{out_dir}: no documents to write")
        tok = None if tokenizer is None else _tokenizer_into_set(tokenizer, stage.path)
        manifest = _manifest(w.entries, vocab_size, w.dtype.name, tok, bool(wwm), {})
        write_manifest(stage.path, manifest)
        stage.commit()
    return manifest


# --------------------------------------------------------------------------- building from a corpus

# Worker-process state for build_shards (one tokenizer per process).
_WORKER_TOK = None


def _init_worker(model: str, kind: str, jieba: bool) -> None:
    global _WORKER_TOK
    _WORKER_TOK = open_tokenizer(model, kind, jieba)


def _encode_chunk(job: tuple[int, str, list[str]]) -> tuple:
    """A chunk of :func:`~data_pipeline.corpus.iter_record_chunks` -> (keys, token ids, lengths, word marks, stats)
    of its documents (in the worker processes). A document's key is its record's index, so keys follow the
    corpus order whatever the chunking (empty records leave gaps)."""
    first, kind, records = job
    tok = _WORKER_TOK
    stats = CorpusStats()
    keep, texts, words = normalize_records(kind, records, stats, utf8=tok.reads_utf8)
    keys = first + np.asarray(keep, np.int64)
    ids, lengths, marks = tok.encode_marked(texts, words)
    if (lengths == 0).any():                       # a text that encodes to nothing
        nonzero = np.flatnonzero(lengths)
        stats.empty_docs += len(lengths) - len(nonzero)
        keys, lengths = keys[nonzero], lengths[nonzero]
    # compact (3 bytes a token): the writer makes the blocks of tar members (about 1% more) from these
    return keys, ids.astype(tok.dtype), lengths, marks, stats


def write_shards(inputs, tokenizer: str | os.PathLike, out_dir: str | os.PathLike, *, workers: int = 1,
                 shard_size_mb: float = 64.0, max_docs_per_shard: Optional[int] = None, fmt: str = "auto",
                 read: ReadOptions = ReadOptions(), jieba: bool = False, progress: bool = True,
                 chunk_docs: int = CHUNK_RECORDS, stats: Optional[CorpusStats] = None, copy_tokenizer: bool = True,
                 progress_desc: Optional[str] = None, on_progress=None, warn_corpus: bool = True,
                 allow_empty: bool = False, kind: str = SENTENCEPIECE) -> dict:
    """Tokenise a corpus into shards + manifest inside the existing directory ``out_dir``.

    The building block of :func:`build_shards` (which stages the directory) and of the cluster
    tasks. ``tokenizer``: a file of ``kind`` (:data:`~data_pipeline.imported.KINDS`: our SentencePiece
    model or an imported tokenizer, :mod:`.imported`). ``copy_tokenizer``: copy it into ``out_dir``
    under its kind's name (recorded in the manifest), else record ``tokenizer``'s own path (the cluster
    tasks: such a manifest is only an intermediate result, :func:`~data_pipeline.cluster.merge` writes
    the set's).
    Shards are written in format 2 (:mod:`.tario`: blocks of documents) and the manifest says so.
    ``on_progress(docs, tokens, text_bytes)`` is called after each chunk. ``warn_corpus``: log the
    corpus warnings (binary-looking files, many skipped lines, over-long lines). ``read``: how the
    inputs are read (a format's options, whole: :class:`~data_pipeline.formats.base.ReadOptions`).
    ``allow_empty``: no documents is not an error (a cluster task whose input was all empty): the
    returned manifest then lists no shard and is not written.
    Returns the manifest (plus ``_build_seconds``).
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    tok = open_tokenizer(tokenizer, kind, jieba)
    if copy_tokenizer:
        tok_entry = _tokenizer_into_set(tokenizer, out_dir, kind)
        model_path = out_dir / tok_entry["path"]
    else:
        model_path = Path(tokenizer)
        tok_entry = _tokenizer_entry(str(model_path.resolve()), sha256_file(model_path), kind)
    stats = stats if stats is not None else CorpusStats()
    chunks = iter_record_chunks(inputs, fmt, read, stats, chunk_docs)
    writer = ShardWriter(out_dir, tok.dtype, int(shard_size_mb * 1e6), max_docs_per_shard)
    t0 = time.perf_counter()
    text_bytes = tokens = docs = 0
    bar = tqdm(desc=progress_desc or f"shards -> {out_dir}", unit=" docs", disable=not progress, mininterval=1.0)
    pool = None
    try:
        if workers <= 1:
            global _WORKER_TOK
            _WORKER_TOK = tok                # model_path holds a byte-identical copy of `tokenizer`
            results = map(_encode_chunk, chunks)
        else:
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(model_path), kind, jieba))
            results = pool.imap(_encode_chunk, chunks, chunksize=1)
        for keys, ids, lengths, marks, st in results:
            writer.add_docs(keys, ids, lengths, marks)
            tokens += int(lengths.sum())
            docs += len(lengths)
            stats.add_counts(st)
            text_bytes += st.bytes
            bar.update(len(lengths))
            el = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{tokens / el / 1e3:.0f}k tok/s, {text_bytes / el / 1e6:.2f} MB/s, "
                                f"shard {len(writer.entries)}", refresh=False)
            if on_progress is not None:
                on_progress(docs, tokens, text_bytes)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    writer.close_shard()
    if not writer.entries and not allow_empty:
        raise DataError(f"no documents to write: {stats.summary()} (inputs: "
                        f"{', '.join(map(str, inputs)) if isinstance(inputs, (list, tuple)) else inputs})")
    elapsed = time.perf_counter() - t0
    manifest = _manifest(writer.entries, tok.vocab_size, tok.dtype.name, tok_entry, True,
                         {"jieba": jieba, "text_bytes": text_bytes,
                          "word_marks": "jieba" if jieba else "gold-or-pieces"}, tok.special_ids)
    if writer.entries:
        write_manifest(out_dir, manifest)
    if warn_corpus:
        for w in stats.warnings():
            log.warning("%s", w)
    log.info("wrote %d shards, %d documents, %d tokens in %.1f s (%.2f MB of text/s); %s",
             len(writer.entries), manifest["num_docs"], manifest["num_tokens"], elapsed,
             text_bytes / max(elapsed, 1e-9) / 1e6, stats.summary())
    manifest["_build_seconds"] = elapsed  # not in the file: for callers that report throughput
    return manifest


def build_shards(inputs, tokenizer: str | os.PathLike, out_dir: str | os.PathLike, *, force: bool = False,
                 **kw) -> dict:
    """Tokenise a corpus in ``workers`` processes into a new shard set at ``out_dir``; returns the manifest.

    Documents keep the corpus order (files sorted, lines in order). The tokenizer is copied into the
    set (``tokenizer.model``, or an imported one's ``tokenizer.json`` / ``vocab.txt``). The set is staged
    beside ``out_dir`` and moved there when complete; an existing set is replaced only with
    ``force=True`` (see the module docstring). Keyword arguments: those of :func:`write_shards`.
    """
    open_tokenizer(tokenizer, kw.get("kind", SENTENCEPIECE), kw.get("jieba", False))  # fail early on a bad one
    check_inputs(inputs)
    with stage_output(out_dir, force) as stage:
        manifest = write_shards(inputs, tokenizer, stage.path, **kw)
        stage.commit()
    return manifest
