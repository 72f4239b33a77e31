"""Shard sets: the webdataset tar format, the manifest, the parallel writer and the reader.

A shard set is a directory (ARCHITECTURE.md, "Shards")::

    manifest.json            written last, atomically (tmp + rename)
    tokenizer.model          the SentencePiece model (``prepare`` puts it here)
    shard-000000.tar ...     members <key>.ids (raw little-endian token ids, dtype of the manifest)
                             and <key>.wwm (one byte per token, 1 where a word starts)

Keys are the global document index (``%010d``). Tar headers carry mtime 0 and no
owner, so the same input and tokenizer give byte-identical shards (and hashes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from .corpus import CorpusStats, iter_records, to_document
from .tokenizer import SPECIAL_IDS, Tokenizer, sha256_file

__all__ = ["FORMAT_VERSION", "MANIFEST", "CorruptShardError", "read_manifest", "tokenizer_path",
           "check_tokenizer", "iter_tar_members", "read_shard", "verify_shard_set", "ShardWriter",
           "build_shards", "write_shard_set"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_SHARD_NAME = re.compile(r"^shard-\d{6}\.tar$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class CorruptShardError(ValueError):
    """A shard is missing, truncated, unparsable or does not match its manifest entry."""


# --------------------------------------------------------------------------- manifest


def _field_error(path, key: str, expected: str, got) -> ValueError:
    return ValueError(f"{path}: field {key!r}: expected {expected}, got {got!r}")


def read_manifest(shard_dir: str | os.PathLike) -> dict:
    """Parse and validate ``<shard_dir>/manifest.json``; ValueError naming the file and field."""
    shard_dir = Path(shard_dir)
    path = shard_dir / MANIFEST
    if not shard_dir.is_dir():
        raise ValueError(f"{shard_dir}: not a shard set (no such directory)")
    if not path.is_file():
        raise ValueError(f"{shard_dir}: not a shard set (no {MANIFEST}; an interrupted build leaves none - "
                         f"re-run `roformer-data shards` or `roformer-data prepare`)")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(m).__name__}")

    def req(key, types, expected):
        if key not in m:
            raise ValueError(f"{path}: missing field {key!r} ({expected})")
        if not isinstance(m[key], types) or (isinstance(m[key], bool) and types is int):
            raise _field_error(path, key, expected, m[key])
        return m[key]

    if req("format", int, f"format version {FORMAT_VERSION}") != FORMAT_VERSION:
        raise _field_error(path, "format", f"format version {FORMAT_VERSION}", m["format"])
    tok = req("tokenizer", dict, "an object {path, sha256}")
    for k in ("path", "sha256"):
        if k not in tok or not (tok[k] is None or isinstance(tok[k], str)):
            raise _field_error(path, f"tokenizer.{k}", "a string (or null for a synthetic set)", tok.get(k))
    if tok["sha256"] is not None and not _HEX64.match(tok["sha256"]):
        raise _field_error(path, "tokenizer.sha256", "64 lowercase hex digits", tok["sha256"])
    vocab = req("vocab_size", int, "a positive integer")
    if vocab <= 0:
        raise _field_error(path, "vocab_size", "a positive integer", vocab)
    sp = req("special_ids", dict, "an object {pad, unk, cls, sep, mask}")
    for k in SPECIAL_IDS:
        if not isinstance(sp.get(k), int) or not 0 <= sp[k] < vocab:
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
    names = set()
    for i, s in enumerate(shards):
        key = f"shards[{i}]"
        if not isinstance(s, dict):
            raise _field_error(path, key, "an object {name, num_docs, num_tokens, sha256}", s)
        if not isinstance(s.get("name"), str) or not _SHARD_NAME.match(s["name"]):
            raise _field_error(path, f"{key}.name", "a file name like shard-000000.tar", s.get("name"))
        if s["name"] in names:
            raise _field_error(path, f"{key}.name", "a unique name", s["name"])
        names.add(s["name"])
        for k in ("num_docs", "num_tokens"):
            if not isinstance(s.get(k), int) or isinstance(s.get(k), bool) or s[k] < 0:
                raise _field_error(path, f"{key}.{k}", "a non-negative integer", s.get(k))
        if not isinstance(s.get("sha256"), str) or not _HEX64.match(s["sha256"]):
            raise _field_error(path, f"{key}.sha256", "64 lowercase hex digits", s.get("sha256"))
    for k in ("num_docs", "num_tokens"):
        total = sum(s[k] for s in shards)
        if req(k, int, "a non-negative integer") != total:
            raise _field_error(path, k, f"the sum over shards ({total})", m[k])
    return m


def tokenizer_path(shard_dir: str | os.PathLike, manifest: dict) -> Optional[Path]:
    """The tokenizer model of a shard set (its manifest path is relative to the set, or absolute)."""
    p = manifest["tokenizer"]["path"]
    return None if p is None else (Path(shard_dir) / p)


def check_tokenizer(shard_dir: str | os.PathLike, manifest: Optional[dict] = None, *,
                    tokenizer: str | os.PathLike | None = None, sha256: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> None:
    """ValueError unless the shard set was made with this tokenizer (file or hash) and vocabulary size.

    With no ``tokenizer``/``sha256`` the set's own model file is re-hashed against its manifest.
    """
    manifest = manifest if manifest is not None else read_manifest(shard_dir)
    mpath = Path(shard_dir) / MANIFEST
    want = manifest["tokenizer"]["sha256"]
    if tokenizer is not None:
        sha256 = sha256_file(tokenizer)
    elif sha256 is None and want is not None:
        own = tokenizer_path(shard_dir, manifest)
        if not own.is_file():
            raise ValueError(f"{mpath}: field 'tokenizer.path': the tokenizer model {own} is missing")
        sha256 = sha256_file(own)
        tokenizer = own
    if sha256 is not None and want is not None and sha256 != want:
        raise ValueError(f"{mpath}: tokenizer mismatch: the shards were made with a tokenizer of sha256 "
                         f"{want[:16]}..., but {tokenizer or 'the given tokenizer'} has sha256 {sha256[:16]}...")
    if vocab_size is not None and vocab_size != manifest["vocab_size"]:
        raise ValueError(f"{mpath}: vocab_size mismatch: the shards have vocab_size {manifest['vocab_size']}, "
                         f"the model expects {vocab_size}")


# --------------------------------------------------------------------------- tar reading


def iter_tar_members(buf, name: str = "shard") -> Iterator[tuple[str, int, int]]:
    """(member name, data offset, size) of the regular files of a tar held in memory.

    A minimal ustar parser (about 10x faster than :mod:`tarfile` per member); raises
    :class:`CorruptShardError` naming ``name`` on a bad header or a truncated archive.
    """
    mv = memoryview(buf)
    n = len(mv)
    pos = 0
    while True:
        if pos + 512 > n:
            raise CorruptShardError(f"{name}: truncated (archive ends at byte {n} without an end-of-archive "
                                    f"marker)")
        hdr = bytes(mv[pos:pos + 512])
        if hdr[0] == 0:  # end-of-archive block (member integrity is the sha256's job, not the header's)
            return
        if hdr[257:262] != b"ustar":
            raise CorruptShardError(f"{name}: bad tar header at byte {pos} (no ustar magic)")
        try:
            size = int(hdr[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise CorruptShardError(f"{name}: bad tar header at byte {pos} (size field "
                                    f"{hdr[124:136]!r})") from None
        member = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix and hdr[257:262] == b"ustar":
            member = prefix.decode("utf-8", "replace") + "/" + member
        start = pos + 512
        if start + size > n:
            raise CorruptShardError(f"{name}: truncated (member {member} needs {size} bytes at byte {start}, "
                                    f"the file has {n})")
        if hdr[156:157] in (b"0", b"\0"):
            yield member, start, size
        pos = start + (size + 511) // 512 * 512


@dataclass
class ShardData:
    """One shard in memory: the raw buffer and, per document, token offset and length."""
    name: str
    tokens: np.ndarray              # the whole file viewed as the manifest dtype
    marks: Optional[np.ndarray]     # the whole file viewed as uint8 (None without .wwm)
    tok_start: np.ndarray           # int64 [num_docs]: index into tokens
    wwm_start: Optional[np.ndarray]  # int64 [num_docs]: index into marks
    lengths: np.ndarray             # int64 [num_docs]: tokens per document

    @property
    def num_docs(self) -> int:
        return len(self.lengths)


_OCT = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_USTAR = np.frombuffer(b"ustar\0", np.uint8)


def _index_members_fast(buf: bytes):
    """Vectorised index of a shard in our writer's layout, or None (then the loop decides).

    Candidate headers are the 512-byte blocks with the ustar magic; the candidates are accepted
    only if they form the exact header chain (each header's size leads to the next candidate,
    the last to the end-of-archive block), so a magic-looking data block cannot fool it.
    """
    n = len(buf)
    nblocks = n // 512
    if nblocks < 3:
        return None
    blocks = np.frombuffer(buf, np.uint8, nblocks * 512).reshape(nblocks, 512)
    cand = np.flatnonzero((blocks[:, 257:263] == _USTAR).all(axis=1))
    if len(cand) == 0 or cand[0] != 0:
        return None
    head = blocks[:, :15][cand]                 # name (key + extension + NUL): copy only the fields
    field = blocks[:, 124:136][cand]
    digits = field[:, :11].astype(np.int64) - 48
    if ((digits < 0) | (digits > 7)).any() or (field[:, 11] != 0).any() or (head[:, 14] != 0).any():
        return None
    sizes = digits @ _OCT
    nxt = cand + 1 + (sizes + 511) // 512
    if not np.array_equal(nxt[:-1], cand[1:]) or nxt[-1] >= nblocks or blocks[nxt[-1], 0] != 0:
        return None
    if not np.isin(blocks[cand, 156], (48, 0)).all():
        return None
    ext = head[:, 10:14]
    is_ids = (ext == np.frombuffer(b".ids", np.uint8)).all(axis=1)
    is_wwm = (ext == np.frombuffer(b".wwm", np.uint8)).all(axis=1)
    keydig = head[:, :10].astype(np.int64) - 48
    if ((keydig < 0) | (keydig > 9)).any():
        return None
    keys = keydig @ (10 ** np.arange(9, -1, -1, dtype=np.int64))
    ik, wk = keys[is_ids], keys[is_wwm]
    if len(ik) > 1 and not (np.diff(ik) > 0).all():
        return None  # not strictly increasing keys: let the general path check for duplicates
    if len(wk) and not np.array_equal(ik, wk):
        return None
    starts = (cand + 1) * 512
    return starts[is_ids], sizes[is_ids], starts[is_wwm], sizes[is_wwm], ik, wk


def _index_members(buf: bytes, name: str):
    """Offsets and sizes of the .ids / .wwm members (a flat loop: the loader's hot path)."""
    fast = _index_members_fast(buf)
    if fast is not None:
        return fast
    n = len(buf)
    if n >= 512 and buf[0] != 0 and buf[257:262] != b"ustar":
        raise CorruptShardError(f"{name}: not a ustar tar file")
    pos = 0
    ids, wwm = [], []
    ids_append, wwm_append = ids.append, wwm.append
    while True:
        if pos + 512 > n:
            raise CorruptShardError(f"{name}: truncated (archive ends at byte {n} without an end-of-archive "
                                    f"marker)")
        if buf[pos] == 0:
            break
        try:
            size = int(buf[pos + 124:pos + 135], 8)  # our writer: 11 octal digits + NUL
        except ValueError:
            try:
                size = int(buf[pos + 124:pos + 136].rstrip(b"\0 ") or b"0", 8)
            except ValueError:
                raise CorruptShardError(f"{name}: bad tar header at byte {pos} (size field "
                                        f"{buf[pos + 124:pos + 136]!r})") from None
        start = pos + 512
        if start + size > n:
            raise CorruptShardError(f"{name}: truncated (a member needs {size} bytes at byte {start}, the file "
                                    f"has {n})")
        if buf[pos + 14] == 0:     # our writer's names: 10-digit key + .ids / .wwm
            member = buf[pos:pos + 14]
        else:
            if buf[pos + 257:pos + 262] != b"ustar":
                raise CorruptShardError(f"{name}: bad tar header at byte {pos} (no ustar magic)")
            member = buf[pos:pos + 100].rstrip(b"\0")
            if buf[pos + 345] != 0:
                member = buf[pos + 345:pos + 500].rstrip(b"\0") + b"/" + member
        if buf[pos + 156] in (48, 0):  # regular file
            if member.endswith(b".ids"):
                ids_append((start, size, member[:-4]))
            elif member.endswith(b".wwm"):
                wwm_append((start, size, member[:-4]))
        pos = start + ((size + 511) & ~511)
    starts, sizes, keys = (list(x) for x in zip(*ids)) if ids else ([], [], [])
    wstarts, wsizes, wkeys = (list(x) for x in zip(*wwm)) if wwm else ([], [], [])
    return starts, sizes, wstarts, wsizes, keys, wkeys


def read_shard(path: str | os.PathLike, dtype: str | np.dtype, entry: Optional[dict] = None,
               verify_hash: bool = True) -> ShardData:
    """Load and index one shard; CorruptShardError naming it when it is missing, truncated or differs
    from its manifest ``entry`` (sha256, document and token counts)."""
    path = Path(path)
    dtype = np.dtype(dtype).newbyteorder("<")
    try:
        buf = path.read_bytes()
    except FileNotFoundError:
        raise CorruptShardError(f"{path}: shard missing (listed in the manifest, not on disk)") from None
    except OSError as e:
        raise CorruptShardError(f"{path}: cannot read shard ({e})") from None
    if entry is not None and verify_hash:
        got = hashlib.sha256(buf).hexdigest()
        if got != entry["sha256"]:
            raise CorruptShardError(f"{path}: sha256 mismatch (manifest {entry['sha256'][:16]}..., file "
                                    f"{got[:16]}...): the shard is corrupt or from another build")
    starts, lengths, wstarts, wsizes, keys, wkeys = _index_members(buf, str(path))
    keys, wkeys = list(keys), list(wkeys)
    if len(keys) != len(set(keys)):
        raise CorruptShardError(f"{path}: duplicate document keys")
    lengths = np.asarray(lengths, np.int64)
    if (lengths % dtype.itemsize).any():
        bad = keys[int(np.flatnonzero(lengths % dtype.itemsize)[0])]
        raise CorruptShardError(f"{path}: member {bad}.ids has a size that is not a multiple of "
                                f"{dtype.itemsize} ({dtype.name})")
    if wkeys and wkeys != keys:  # not our writer's ids/wwm pairs in order: match them by key
        wmap = dict(zip(wkeys, zip(wstarts, wsizes)))
        if any(k not in wmap for k in keys):
            raise CorruptShardError(f"{path}: document {next(k for k in keys if k not in wmap)} has "
                                    f"no .wwm member")
        wstarts, wsizes = [wmap[k][0] for k in keys], [wmap[k][1] for k in keys]
    n_docs = len(keys)
    lengths //= dtype.itemsize
    starts = np.asarray(starts, np.int64)
    if wkeys and not np.array_equal(np.asarray(wsizes, np.int64), lengths):
        raise CorruptShardError(f"{path}: a .wwm member's length differs from its document's token count")
    usable = len(buf) // dtype.itemsize * dtype.itemsize
    tokens = np.frombuffer(buf, dtype=dtype, count=usable // dtype.itemsize)
    marks = wwm_start = None
    if wkeys:
        marks = np.frombuffer(buf, dtype=np.uint8)
        wwm_start = np.asarray(wstarts, np.int64)
    if entry is not None:
        if n_docs != entry["num_docs"] or int(lengths.sum()) != entry["num_tokens"]:
            raise CorruptShardError(f"{path}: holds {n_docs} documents / {int(lengths.sum())} tokens, the "
                                    f"manifest says {entry['num_docs']} / {entry['num_tokens']}")
    return ShardData(path.name, tokens, marks, starts // dtype.itemsize, wwm_start, lengths)


def verify_shard_set(shard_dir: str | os.PathLike) -> list[str]:
    """Re-hash and parse every shard and the tokenizer; returns the problems (empty = OK)."""
    shard_dir = Path(shard_dir)
    problems = []
    m = read_manifest(shard_dir)
    try:
        check_tokenizer(shard_dir, m)
    except (ValueError, OSError) as e:
        problems.append(str(e))
    for entry in m["shards"]:
        try:
            read_shard(shard_dir / entry["name"], m["dtype"], entry)
        except CorruptShardError as e:
            problems.append(str(e))
    return problems


# --------------------------------------------------------------------------- writing


def _tar_header_slow(name: str, size: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
    return ti.tobuf(format=tarfile.USTAR_FORMAT)


_HDR_TEMPLATE = bytearray(_tar_header_slow("x", 0))
_HDR_TEMPLATE[0:100] = bytes(100)
_HDR_TEMPLATE[124:136] = bytes(12)
_HDR_TEMPLATE[148:156] = b" " * 8
_HDR_BASE_SUM = sum(_HDR_TEMPLATE)


def _tar_header(name: str, size: int) -> bytes:
    """The ustar header tarfile would write (mode 644, mtime 0, no owner), ~10x faster."""
    nb = name.encode("ascii")
    if len(nb) > 100 or size >= 8 ** 11:
        return _tar_header_slow(name, size)
    sb = b"%011o\0" % size
    hdr = bytearray(_HDR_TEMPLATE)
    hdr[0:len(nb)] = nb
    hdr[124:136] = sb
    hdr[148:156] = b"%06o\0 " % (_HDR_BASE_SUM - 256 + 256 + sum(nb) + sum(sb))
    return bytes(hdr)


class ShardWriter:
    """Writes documents into shard-NNNNNN.tar files of about ``shard_size_bytes`` of token ids."""

    def __init__(self, out_dir: str | os.PathLike, dtype: np.dtype, shard_size_bytes: int,
                 max_docs_per_shard: Optional[int] = None):
        self.out_dir = Path(out_dir)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_size_bytes = max(1, int(shard_size_bytes))
        self.max_docs = max_docs_per_shard
        self.entries: list[dict] = []
        self.num_docs_total = 0
        self._f = None

    def _open(self) -> None:
        name = f"shard-{len(self.entries):06d}.tar"
        self._tmp = self.out_dir / (name + ".tmp")
        self._f = open(self._tmp, "wb")
        self._hash = hashlib.sha256()
        self._cur = {"name": name, "num_docs": 0, "num_tokens": 0, "sha256": ""}
        self._bytes = 0

    def _write(self, b: bytes) -> None:
        self._f.write(b)
        self._hash.update(b)

    def _member(self, name: str, data: bytes) -> None:
        self._write(_tar_header(name, len(data)))
        self._write(data)
        if len(data) % 512:
            self._write(b"\0" * (512 - len(data) % 512))

    def add(self, ids: np.ndarray, marks: Optional[np.ndarray] = None) -> None:
        if self._f is None:
            self._open()
        key = f"{self.num_docs_total:010d}"
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._member(key + ".ids", data)
        if marks is not None:
            self._member(key + ".wwm", np.ascontiguousarray(marks, dtype=np.uint8).tobytes())
        self.num_docs_total += 1
        self._cur["num_docs"] += 1
        self._cur["num_tokens"] += int(len(ids))
        self._bytes += len(data)
        if self._bytes >= self.shard_size_bytes or (self.max_docs and self._cur["num_docs"] >= self.max_docs):
            self.close_shard()

    def close_shard(self) -> None:
        if self._f is None:
            return
        end = b"\0" * 1024
        pos = self._f.tell() + len(end)
        end += b"\0" * ((-pos) % tarfile.RECORDSIZE)
        self._write(end)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        self._cur["sha256"] = self._hash.hexdigest()
        os.replace(self._tmp, self.out_dir / self._cur["name"])
        self.entries.append(self._cur)


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / MANIFEST)


def _prepare_out_dir(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # First thing: an interrupted (re)build must not leave a manifest that describes other shards.
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for p in out_dir.glob("shard-*.tar*"):
        p.unlink()


def _finish(out_dir: Path, writer: ShardWriter, vocab_size: int, tok: Optional[dict], wwm: bool,
            extra: dict) -> dict:
    writer.close_shard()
    if not writer.entries:
        raise ValueError(f"{out_dir}: no documents to write (every input document was empty or invalid)")
    manifest = {
        "format": FORMAT_VERSION,
        "tokenizer": tok or {"path": None, "sha256": None},
        "vocab_size": int(vocab_size),
        "special_ids": dict(SPECIAL_IDS),
        "dtype": writer.dtype.name,
        "wwm": wwm,
        "num_docs": sum(e["num_docs"] for e in writer.entries),
        "num_tokens": sum(e["num_tokens"] for e in writer.entries),
        "shards": writer.entries,
        **extra,
    }
    _write_manifest(out_dir, manifest)
    return manifest


def write_shard_set(docs: Iterable, out_dir: str | os.PathLike, vocab_size: int, *,
                    shard_size_mb: float = 64.0, max_docs_per_shard: Optional[int] = None,
                    tokenizer: str | os.PathLike | None = None) -> dict:
    """Write already-tokenised documents (arrays of ids, or (ids, marks) pairs) as a shard set.

    For tests, benchmarks and users who tokenise elsewhere; ``tokenizer`` (optional) is hashed
    into the manifest.
    """
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir)
    dtype = np.dtype("uint16") if vocab_size <= 1 << 16 else np.dtype("uint32")
    w = ShardWriter(out_dir, dtype, int(shard_size_mb * 1e6), max_docs_per_shard)
    wwm = None
    for d in docs:
        ids, marks = d if isinstance(d, tuple) else (d, None)
        wwm = marks is not None if wwm is None else wwm
        if len(ids):
            w.add(np.asarray(ids), marks)
    tok = None
    if tokenizer is not None:
        tok = {"path": os.path.relpath(Path(tokenizer).resolve(), out_dir.resolve()),
               "sha256": sha256_file(tokenizer)}
    return _finish(out_dir, w, vocab_size, tok, bool(wwm), {})


# Worker-process state for build_shards (one tokenizer per process).
_WORKER_TOK: Optional[Tokenizer] = None


def _init_worker(model: str, jieba: bool) -> None:
    global _WORKER_TOK
    _WORKER_TOK = Tokenizer(model, jieba=jieba)


def _encode_chunk(records: list) -> tuple[list, CorpusStats, int]:
    tok = _WORKER_TOK
    stats = CorpusStats()
    docs = [d for d in (to_document(r, stats) for r in records) if d is not None]
    out, text_bytes = [], 0
    for d, ids in zip(docs, tok.encode_batch([d.text for d in docs])):
        text_bytes += len(d.text.encode("utf-8"))
        if len(ids) == 0:
            stats.empty_docs += 1
            continue
        out.append((ids.astype(tok.dtype).tobytes(), tok.word_marks(d.text, ids, d.words).tobytes(), len(ids)))
    return out, stats, text_bytes


def _chunks(it: Iterable, n: int) -> Iterator[list]:
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


def build_shards(inputs, tokenizer: str | os.PathLike, out_dir: str | os.PathLike, *, workers: int = 1,
                 shard_size_mb: float = 64.0, max_docs_per_shard: Optional[int] = None, fmt: str = "auto",
                 doc_boundary: str = "line", jsonl_field: str = "text", strict: bool = False,
                 jieba: bool = False, progress: bool = True, chunk_docs: int = 256,
                 stats: Optional[CorpusStats] = None) -> dict:
    """Tokenise a corpus in ``workers`` processes into a shard set; returns the manifest.

    Documents keep the corpus order (files sorted, lines in order). The tokenizer model is
    copied into ``out_dir`` as ``tokenizer.model`` unless it is already there. The manifest
    is written last; an interrupted build leaves none, and re-running rebuilds the set.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    tok = Tokenizer(tokenizer, jieba=jieba)  # fail early on a bad model
    _prepare_out_dir(out_dir)
    model_in_set = out_dir / "tokenizer.model"
    if Path(tokenizer).resolve() != model_in_set.resolve():
        shutil.copyfile(tokenizer, model_in_set)
    stats = stats if stats is not None else CorpusStats()
    records = iter_records(inputs, fmt, doc_boundary, jsonl_field, strict, stats)
    writer = ShardWriter(out_dir, tok.dtype, int(shard_size_mb * 1e6), max_docs_per_shard)
    t0 = time.perf_counter()
    text_bytes = 0
    bar = tqdm(desc=f"shards -> {out_dir}", unit=" docs", disable=not progress, mininterval=1.0)
    pool = None
    try:
        if workers <= 1:
            _init_worker(str(model_in_set), jieba)
            results = map(_encode_chunk, _chunks(records, chunk_docs))
        else:
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
            pool = ctx.Pool(workers, initializer=_init_worker, initargs=(str(model_in_set), jieba))
            results = pool.imap(_encode_chunk, _chunks(records, chunk_docs), chunksize=1)
        for out, st, nbytes in results:
            for ids_b, wwm_b, n in out:
                writer.add(np.frombuffer(ids_b, tok.dtype), np.frombuffer(wwm_b, np.uint8))
            stats.docs += st.docs
            stats.chars += st.chars
            stats.bytes += st.bytes
            stats.empty_docs += st.empty_docs
            text_bytes += nbytes
            bar.update(len(out))
            el = max(time.perf_counter() - t0, 1e-9)
            tokens = sum(e["num_tokens"] for e in writer.entries) + (writer._cur["num_tokens"] if writer._f else 0)
            bar.set_postfix_str(f"{tokens / el / 1e3:.0f}k tok/s, {text_bytes / el / 1e6:.2f} MB/s, "
                                f"shard {len(writer.entries)}", refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = time.perf_counter() - t0
    manifest = _finish(out_dir, writer, tok.vocab_size, {"path": "tokenizer.model",
                                                         "sha256": sha256_file(model_in_set)},
                       True, {"jieba": jieba, "text_bytes": text_bytes,
                              "word_marks": "jieba" if jieba else "gold-or-pieces"})
    log.info("wrote %d shards, %d documents, %d tokens in %.1f s (%.2f MB of text/s); %s",
             len(writer.entries), manifest["num_docs"], manifest["num_tokens"], elapsed,
             text_bytes / max(elapsed, 1e-9) / 1e6, stats.summary())
    manifest["_build_seconds"] = elapsed  # not in the file: for callers that report throughput
    return manifest
