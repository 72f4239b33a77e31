"""The shard tar format: a fast reader (index of the members of a tar held in memory) and the writer.

A shard is a ustar archive whose members are ``<key>.ids`` (the document's token ids, raw
little-endian, the manifest's dtype) and ``<key>.wwm`` (one byte per token, 1 where a word
starts), one pair per document, in order. ``<key>`` is a 10-digit document number, unique
within the shard. Headers carry mode 644, mtime 0 and no owner, so the same documents give
byte-identical shards (and hashes). Any tar reader (``tarfile``, webdataset) reads them; ours
indexes a whole shard with a few vectorised numpy operations (see ``bench/loader.py`` for
the comparison with webdataset's tar iterator).

Shards are untrusted input. Both readers (:func:`iter_tar_members`, :func:`parse_shard`) accept a
member size only as octal digits, optionally padded with spaces and NULs (a sign, another base
or GNU's base-256 form is refused), and only when the member fits in what is left of the file;
each header moves the position forward by at least one block, so parsing ends. Anything else is a
:class:`CorruptShardError` naming the shard, the byte offset of the header and the field. A shard
file larger than ``MAX_SHARD_BYTES`` (16 GiB) is neither written nor read. ``parse_shard`` with
``vocab_size`` also refuses a token id at or above it (one ``max`` over the ids).
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from .errors import DataError, UsageError

__all__ = ["CorruptShardError", "ShardData", "iter_tar_members", "parse_shard", "ShardWriter", "documents_blob",
           "max_token_id", "check_token_ids", "MAX_SHARD_BYTES"]

MAX_SHARD_BYTES = 1 << 34
"""The largest shard file (16 GiB): a shard is read whole into memory, by every loader worker."""


class CorruptShardError(DataError):
    """A shard is missing, truncated, unparsable or does not match its manifest entry."""


# --------------------------------------------------------------------------- reading


_OCTAL = re.compile(rb"[ \0]*([0-7]*)[ \0]*\Z")


def _member_size(field: bytes, pos: int, name: str, left: int) -> int:
    """The size field (header bytes 124-135) of the header at byte ``pos``: octal digits (padding: spaces,
    NULs), at most ``left`` (the bytes after the header); CorruptShardError naming the shard, the offset and
    the field otherwise."""
    m = _OCTAL.match(field)
    if m is None:
        why = "base-256 (a GNU extension) is not supported" if field[:1] in (b"\x80", b"\xff") else \
            "expected octal digits"
        raise CorruptShardError(f"{name}: bad tar header at byte {pos}: field 'size' is {field!r} ({why})")
    size = int(m.group(1) or b"0", 8)
    if size > left:
        raise CorruptShardError(f"{name}: truncated (the member at byte {pos} needs {size} bytes, the file has "
                                f"{left} after its header)")
    return size


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
        start = pos + 512
        size = _member_size(hdr[124:136], pos, name, n - start)
        member = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = hdr[345:500].split(b"\0", 1)[0]
        if prefix:
            member = prefix.decode("utf-8", "replace") + "/" + member
        if hdr[156:157] in (b"0", b"\0"):
            yield member, start, size
        pos = start + (size + 511) // 512 * 512     # > pos: every header moves on


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
        start = pos + 512
        size = _member_size(bytes(buf[pos + 124:pos + 136]), pos, name, n - start)
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


def max_token_id(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> int:
    """The largest id of the documents ``tokens[starts[i]:starts[i] + lengths[i]]`` (-1 when there is none):
    one vectorised pass over the ids (``np.maximum.reduceat``), none over the headers between them."""
    keep = lengths > 0
    if not keep.any():
        return -1
    first = starts[keep]
    bounds = np.empty(2 * len(first), np.int64)
    bounds[0::2], bounds[1::2] = first, first + lengths[keep]
    if bounds[-1] >= len(tokens):
        bounds = bounds[:-1]                          # the last document runs to the end of the array
    return int(np.maximum.reduceat(tokens, bounds)[0::2].max())


def check_token_ids(top: int, vocab_size: int, where: str) -> None:
    """CorruptShardError naming ``where`` when the largest token id ``top`` is not below ``vocab_size``."""
    if top >= vocab_size:
        raise CorruptShardError(f"{where}: token id {top} is not below the manifest's vocab_size {vocab_size}: "
                                "the shard does not belong to this set's tokenizer")


def parse_shard(buf: bytes, name: str, dtype: str | np.dtype, entry: Optional[dict] = None,
                verify_hash: bool = True, vocab_size: Optional[int] = None) -> ShardData:
    """Index one shard held in memory; CorruptShardError naming it (``name``: its path or URL) when it is
    truncated, unparsable or differs from its manifest ``entry`` (sha256, document and token counts), or,
    with ``vocab_size``, holds a token id at or above it."""
    path = name
    dtype = np.dtype(dtype).newbyteorder("<")
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
    tok_start = starts // dtype.itemsize
    if vocab_size is not None:
        check_token_ids(max_token_id(tokens, tok_start, lengths), vocab_size, path)
    return ShardData(os.path.basename(str(path)), tokens, marks, tok_start, wwm_start, lengths)


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
    hdr[148:156] = b"%06o\0 " % (_HDR_BASE_SUM + sum(nb) + sum(sb))
    return bytes(hdr)


_TEMPLATE = np.frombuffer(bytes(_HDR_TEMPLATE), np.uint8)
_POW10 = 10 ** np.arange(9, -1, -1, dtype=np.int64)
_POW8_11 = 8 ** np.arange(10, -1, -1, dtype=np.int64)
_POW8_6 = 8 ** np.arange(5, -1, -1, dtype=np.int64)
_EXT = np.frombuffer(b".ids.wwm", np.uint8).reshape(2, 4)


def documents_blob(keys: np.ndarray, ids: np.ndarray, lengths: np.ndarray,
                   marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tar members of many documents at once (what :meth:`ShardWriter.add` writes for each, byte for
    byte): ``keys`` int64 [D] (< 10**10, increasing), ``ids`` [total] in the shard dtype, ``lengths``
    int64 [D], ``marks`` uint8 [total]. Returns (the bytes as uint8 [n], bytes per document int64 [D])."""
    n_docs = len(lengths)
    item = ids.dtype.itemsize
    sizes = np.empty(2 * n_docs, np.int64)                       # members: doc 0 .ids, doc 0 .wwm, doc 1 .ids, ...
    sizes[0::2], sizes[1::2] = lengths * item, lengths
    if (sizes >= 8 ** 11).any() or (keys >= 10 ** 10).any():
        raise ValueError("documents_blob: a member over 8 GB or a key over 10 digits")
    span = 512 + (sizes + 511) // 512 * 512                       # header + padded data
    head = np.zeros(2 * n_docs, np.int64)
    np.cumsum(span[:-1], out=head[1:])
    hdr = np.repeat(_TEMPLATE[None, :], 2 * n_docs, axis=0)
    hdr[:, 0:10] = (np.repeat(keys, 2)[:, None] // _POW10 % 10 + 48).astype(np.uint8)
    hdr[:, 10:14] = np.tile(_EXT, (n_docs, 1))
    hdr[:, 124:135] = (sizes[:, None] // _POW8_11 % 8 + 48).astype(np.uint8)
    hdr[:, 135] = 0
    checksum = hdr.sum(axis=1, dtype=np.int64)                     # the checksum field counts as 8 spaces
    hdr[:, 148:154] = (checksum[:, None] // _POW8_6 % 8 + 48).astype(np.uint8)
    hdr[:, 154], hdr[:, 155] = 0, 32
    total = int(span.sum())
    out = np.zeros(total, np.uint8)
    out.reshape(-1, 512)[head // 512] = hdr
    for kind, data in ((0, ids.view(np.uint8)), (1, marks.view(np.uint8))):
        size = sizes[kind::2]
        src = np.zeros(n_docs, np.int64)
        np.cumsum(size[:-1], out=src[1:])
        out[np.repeat(head[kind::2] + 512 - src, size) + np.arange(len(data), dtype=np.int64)] = data
    return out, span[0::2] + span[1::2]


class ShardWriter:
    """Writes documents into shard-NNNNNN.tar files of about ``shard_size_bytes`` of token ids; ``entries``:
    the manifest entries of the shards written (name, num_docs, num_tokens, sha256, bytes: the file's size)."""

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

    def add_blob(self, blob, doc_bytes: np.ndarray, id_bytes: np.ndarray, tokens: np.ndarray) -> None:
        """Write documents whose tar members are already made (:func:`documents_blob`), cutting shards where
        :meth:`add` would: after the document that brings the shard to ``shard_size_bytes`` of ids or to
        ``max_docs_per_shard`` documents. ``doc_bytes``/``id_bytes``/``tokens``: int64 per document."""
        view = memoryview(blob).cast("B")
        first, pos, n = 0, 0, len(doc_bytes)
        while first < n:
            if self._f is None:
                self._open()
            reach = np.cumsum(id_bytes[first:]) + self._bytes
            take = int(np.searchsorted(reach, self.shard_size_bytes, side="left")) + 1   # closes after that one
            if self.max_docs:
                take = min(take, self.max_docs - self._cur["num_docs"])
            take = min(take, n - first)
            size = int(doc_bytes[first:first + take].sum())
            self._write(view[pos:pos + size])
            self._cur["num_docs"] += take
            self._cur["num_tokens"] += int(tokens[first:first + take].sum())
            self._bytes += int(id_bytes[first:first + take].sum())
            self.num_docs_total += take
            first, pos = first + take, pos + size
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
        self._cur["bytes"] = self._f.tell()
        self._f.close()
        self._f = None
        self._cur["sha256"] = self._hash.hexdigest()
        if self._cur["bytes"] > MAX_SHARD_BYTES:
            raise UsageError(f"{self._tmp}: a shard of {self._cur['bytes']} bytes is larger than readers take "
                             f"(MAX_SHARD_BYTES, {MAX_SHARD_BYTES}); use a smaller --shard-size-mb")
        os.replace(self._tmp, self.out_dir / self._cur["name"])
        self.entries.append(self._cur)

