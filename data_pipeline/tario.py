"""The shard tar format: a fast reader (index of the members of a tar held in memory) and the writer.

A shard is a ustar archive of *blocks* of consecutive documents (format 2, what :class:`ShardWriter`
writes), three members each, in order::

    <key>.ids   the token ids of the block's documents, concatenated (raw little-endian, the manifest's dtype)
    <key>.len   each document's token count, uint32 little-endian (so the block's documents are known)
    <key>.wwm   one byte per token, 1 where a word starts, concatenated like .ids (absent without marks)

``<key>`` is the 10-digit number of the block's first document (unique and increasing within the
shard); a block closes after the document that brings it to ``BLOCK_TOKENS`` (65536) tokens, and
at the end of the shard, so the layout depends only on the documents, never on how the builder
batched them. Documents, not blocks, are the unit of everything above this module
(:class:`ShardData` is per document: counts, resume positions, shuffling). Format 1 (sets written
before blocks existed: manifest ``format`` 1) has one document per ``<key>.ids`` / ``<key>.wwm``
pair and no ``.len``: the reader takes both (a ``.ids`` member without a ``.len`` is one document).
Headers carry mode 644, mtime 0 and no owner, so the same documents give byte-identical shards (and
hashes). Any tar reader (``tar``, ``tarfile``, webdataset: a block is one sample) reads them; ours
indexes a whole shard with a few vectorised numpy operations (see ``bench/loader.py`` for the
comparison with webdataset's tar iterator).

Shards are untrusted input. Both readers (:func:`iter_tar_members`, :func:`parse_shard`) accept a
member size only as octal digits, optionally padded with spaces and NULs (a sign, another base
or GNU's base-256 form is refused), and only when the member fits in what is left of the file;
each header moves the position forward by at least one block, so parsing ends. A ``.len`` member
must hold a multiple of 4 bytes whose counts add up to its ``.ids`` (and ``.wwm``) member, and a
shard with ``.len`` members must have one for every ``.ids``. Anything else is a
:class:`CorruptShardError` naming the shard, the byte offset of the header or the member, and the
field. A shard file larger than ``MAX_SHARD_BYTES`` (16 GiB) is neither written nor read.
``parse_shard`` with ``vocab_size`` also refuses a token id at or above it (one ``max`` over the ids).
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

__all__ = ["CorruptShardError", "ShardData", "iter_tar_members", "parse_shard", "ShardWriter", "max_token_id",
           "check_token_ids", "MAX_SHARD_BYTES", "BLOCK_TOKENS"]

MAX_SHARD_BYTES = 1 << 34
"""The largest shard file (16 GiB): a shard is read whole into memory, by every loader worker."""
BLOCK_TOKENS = 1 << 16
"""A block of documents closes after the document that brings it to this many tokens (module docstring):
its three 512-byte headers and padding are then about 1% of its 3 bytes a token."""


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


_EXTS = (b".ids", b".wwm", b".len")


def _index_members_fast(buf: bytes):
    """Vectorised index of a shard in our writer's layout, or None (then the loop decides): for each of
    ``.ids``, ``.wwm``, ``.len`` (:data:`_EXTS`), the (data offsets, sizes, keys) of its members.

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
    keydig = head[:, :10].astype(np.int64) - 48
    if ((keydig < 0) | (keydig > 9)).any():
        return None
    keys = keydig @ (10 ** np.arange(9, -1, -1, dtype=np.int64))
    starts = (cand + 1) * 512
    out = []
    for e in _EXTS:
        sel = (ext == np.frombuffer(e, np.uint8)).all(axis=1)
        out.append((starts[sel], sizes[sel], keys[sel]))
    ik = out[0][2]
    if len(ik) > 1 and not (np.diff(ik) > 0).all():
        return None  # not strictly increasing keys: let the general path check for duplicates
    if any(len(k) and not np.array_equal(ik, k) for _, _, k in out[1:]):
        return None
    return out


def _index_members(buf: bytes, name: str):
    """:func:`_index_members_fast`'s result, by a flat loop where that declines (the general layout)."""
    fast = _index_members_fast(buf)
    if fast is not None:
        return fast
    n = len(buf)
    if n >= 512 and buf[0] != 0 and buf[257:262] != b"ustar":
        raise CorruptShardError(f"{name}: not a ustar tar file")
    pos = 0
    found: dict[bytes, list] = {e: [] for e in _EXTS}
    while True:
        if pos + 512 > n:
            raise CorruptShardError(f"{name}: truncated (archive ends at byte {n} without an end-of-archive "
                                    f"marker)")
        if buf[pos] == 0:
            break
        start = pos + 512
        size = _member_size(bytes(buf[pos + 124:pos + 136]), pos, name, n - start)
        if buf[pos + 14] == 0:     # our writer's names: 10-digit key + .ids / .wwm / .len
            member = buf[pos:pos + 14]
        else:
            if buf[pos + 257:pos + 262] != b"ustar":
                raise CorruptShardError(f"{name}: bad tar header at byte {pos} (no ustar magic)")
            member = buf[pos:pos + 100].rstrip(b"\0")
            if buf[pos + 345] != 0:
                member = buf[pos + 345:pos + 500].rstrip(b"\0") + b"/" + member
        if buf[pos + 156] in (48, 0):  # regular file
            group = found.get(bytes(member[-4:]))
            if group is not None:
                group.append((start, size, bytes(member[:-4])))
        pos = start + ((size + 511) & ~511)
    return [tuple(list(x) for x in zip(*found[e])) if found[e] else ([], [], []) for e in _EXTS]


def _by_key(path: str, keys: list, got: tuple, ext: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of the ``ext`` members in the order of the ``.ids`` ``keys`` (matched by key)."""
    starts, sizes, their = got
    if list(their) != keys:  # not our writer's order: match them by key
        where = dict(zip(their, zip(starts, sizes)))
        missing = next((k for k in keys if k not in where), None)
        if missing is not None:
            shown = missing.decode("utf-8", "replace") if isinstance(missing, bytes) else f"{int(missing):010d}"
            raise CorruptShardError(f"{path}: document {shown} has no {ext} member")
        starts, sizes = [where[k][0] for k in keys], [where[k][1] for k in keys]
    return np.asarray(starts, np.int64), np.asarray(sizes, np.int64)


def _gather(buf: bytes, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The bytes ``buf[starts[i]:starts[i] + sizes[i]]`` of every i, concatenated (uint8)."""
    u8 = np.frombuffer(buf, np.uint8)
    if len(starts) == 1:
        return u8[starts[0]:starts[0] + sizes[0]]
    first = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    return u8[np.repeat(starts - first, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)]


def _documents_of_blocks(path: str, buf: bytes, itemsize: int, ids: tuple, lens: tuple,
                         wwm: Optional[tuple]) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Per-document (token starts, lengths, mark starts) of the blocks whose .ids / .len (/ .wwm) members
    are at ``ids`` / ``lens`` / ``wwm`` = (offsets, sizes) (format 2)."""
    (istart, isize), (lstart, lsize) = ids, lens
    if (lsize % 4).any():
        raise CorruptShardError(f"{path}: a .len member (at byte {int(lstart[np.flatnonzero(lsize % 4)[0]])}) has a "
                                "size that is not a multiple of 4 (uint32 counts)")
    per_block = lsize // 4
    lengths = _gather(buf, lstart, lsize).view("<u4").astype(np.int64) if len(lsize) else np.zeros(0, np.int64)
    csum = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=csum[1:])
    first = np.zeros(len(per_block) + 1, np.int64)
    np.cumsum(per_block, out=first[1:])
    block_tokens = csum[first[1:]] - csum[first[:-1]]
    for what, (starts, sizes), scale in (("ids", ids, itemsize), ("wwm", wwm, 1)):
        if starts is not None and not np.array_equal(block_tokens * scale, sizes):
            b = int(np.flatnonzero(block_tokens * scale != sizes)[0])
            raise CorruptShardError(f"{path}: the .len member at byte {int(lstart[b])} counts {int(block_tokens[b])} "
                                    f"tokens, its .{what} member holds {int(sizes[b]) // scale}")
    within = csum[:-1] - np.repeat(csum[first[:-1]], per_block)      # tokens before a document in its block
    tok_start = np.repeat(istart // itemsize, per_block) + within
    wwm_start = None if wwm[0] is None else np.repeat(wwm[0], per_block) + within
    return tok_start, lengths, wwm_start


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
    """Index one shard held in memory (format 2 blocks or format 1 documents, see the module docstring);
    CorruptShardError naming it (``name``: its path or URL) when it is truncated, unparsable or differs
    from its manifest ``entry`` (sha256, document and token counts), or, with ``vocab_size``, holds a
    token id at or above it."""
    path = name
    dtype = np.dtype(dtype).newbyteorder("<")
    if entry is not None and verify_hash:
        got = hashlib.sha256(buf).hexdigest()
        if got != entry["sha256"]:
            raise CorruptShardError(f"{path}: sha256 mismatch (manifest {entry['sha256'][:16]}..., file "
                                    f"{got[:16]}...): the shard is corrupt or from another build")
    ids, wwm, lens = _index_members(buf, str(path))
    starts, sizes, keys = ids
    keys = list(keys)
    if len(keys) != len(set(keys)):
        raise CorruptShardError(f"{path}: duplicate document keys")
    sizes = np.asarray(sizes, np.int64)
    if (sizes % dtype.itemsize).any():
        bad = keys[int(np.flatnonzero(sizes % dtype.itemsize)[0])]
        bad = bad.decode("utf-8", "replace") if isinstance(bad, bytes) else f"{int(bad):010d}"
        raise CorruptShardError(f"{path}: member {bad}.ids has a size that is not a multiple of "
                                f"{dtype.itemsize} ({dtype.name})")
    starts = np.asarray(starts, np.int64)
    has_wwm = len(wwm[2]) > 0
    wpos = _by_key(path, keys, wwm, ".wwm") if has_wwm else (None, None)
    if len(lens[2]):                                   # format 2: blocks of documents
        tok_start, lengths, wwm_start = _documents_of_blocks(path, buf, dtype.itemsize, (starts, sizes),
                                                             _by_key(path, keys, lens, ".len"), wpos)
    else:                                              # format 1: a document per member
        lengths = sizes // dtype.itemsize
        tok_start = starts // dtype.itemsize
        wwm_start = wpos[0]
        if has_wwm and not np.array_equal(wpos[1], lengths):
            raise CorruptShardError(f"{path}: a .wwm member's length differs from its document's token count")
    n_docs = len(lengths)
    usable = len(buf) // dtype.itemsize * dtype.itemsize
    tokens = np.frombuffer(buf, dtype=dtype, count=usable // dtype.itemsize)
    marks = np.frombuffer(buf, dtype=np.uint8) if has_wwm else None
    if entry is not None:
        if n_docs != entry["num_docs"] or int(lengths.sum()) != entry["num_tokens"]:
            raise CorruptShardError(f"{path}: holds {n_docs} documents / {int(lengths.sum())} tokens, the "
                                    f"manifest says {entry['num_docs']} / {entry['num_tokens']}")
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


class ShardWriter:
    """Writes documents into shard-NNNNNN.tar files of about ``shard_size_bytes`` of token ids, in blocks of
    about ``block_tokens`` tokens (format 2, module docstring); ``entries``: the manifest entries of the
    shards written (name, num_docs, num_tokens, sha256, bytes: the file's size).

    A shard closes after the document that brings it to ``shard_size_bytes`` of ids or to
    ``max_docs_per_shard`` documents; the shards, blocks and bytes depend only on the sequence of
    documents (and keys), never on how they were handed to :meth:`add_docs`."""

    def __init__(self, out_dir: str | os.PathLike, dtype: np.dtype, shard_size_bytes: int,
                 max_docs_per_shard: Optional[int] = None, block_tokens: int = BLOCK_TOKENS):
        self.out_dir = Path(out_dir)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_size_bytes = max(1, int(shard_size_bytes))
        self.max_docs = max_docs_per_shard
        self.block_tokens = max(1, int(block_tokens))
        self.entries: list[dict] = []
        self.num_docs_total = 0
        self.wwm: Optional[bool] = None
        self._f = None
        self._block: list[tuple] = []       # (keys, ids, lengths, marks) of the open block
        self._block_tokens = 0

    def _open(self) -> None:
        name = f"shard-{len(self.entries):06d}.tar"
        self._tmp = self.out_dir / (name + ".tmp")
        self._f = open(self._tmp, "wb")
        self._hash = hashlib.sha256()
        self._cur = {"name": name, "num_docs": 0, "num_tokens": 0, "sha256": ""}
        self._bytes = 0

    def _write(self, b) -> None:
        self._f.write(b)
        self._hash.update(b)

    def _member(self, name: str, data: np.ndarray) -> None:
        self._write(_tar_header(name, data.nbytes))
        self._write(data.data)
        if data.nbytes % 512:
            self._write(bytes(512 - data.nbytes % 512))

    def _flush_block(self) -> None:
        if not self._block:
            return
        parts = self._block
        key = f"{int(parts[0][0][0]):010d}"
        cat = (lambda i: parts[0][i]) if len(parts) == 1 else (lambda i: np.concatenate([p[i] for p in parts]))
        self._member(key + ".ids", np.ascontiguousarray(cat(1), self.dtype))
        self._member(key + ".len", np.ascontiguousarray(cat(2), "<u4"))
        if self.wwm:
            self._member(key + ".wwm", np.ascontiguousarray(cat(3), np.uint8))
        self._block, self._block_tokens = [], 0

    def _into_blocks(self, keys, ids, lengths, marks) -> None:
        """Documents of the open shard into blocks (a block closes after the document reaching block_tokens)."""
        first, pos, n = 0, 0, len(lengths)
        while first < n:
            reach = np.cumsum(lengths[first:]) + self._block_tokens
            take = min(int(np.searchsorted(reach, self.block_tokens, side="left")) + 1, n - first)
            tok = int(reach[take - 1]) - self._block_tokens
            self._block.append((keys[first:first + take], ids[pos:pos + tok], lengths[first:first + take],
                                None if marks is None else marks[pos:pos + tok]))
            self._block_tokens += tok
            first, pos = first + take, pos + tok
            if self._block_tokens >= self.block_tokens:
                self._flush_block()

    def add_docs(self, keys: np.ndarray, ids: np.ndarray, lengths: np.ndarray,
                 marks: Optional[np.ndarray] = None) -> None:
        """Write documents: ``keys`` int64 [D] (increasing, < 10**10: a block's key is its first document's),
        ``ids`` [total] (the shard dtype), ``lengths`` int64 [D] (tokens per document, each > 0), ``marks``
        uint8 [total] or None (the same for every call)."""
        has = marks is not None
        if self.wwm is None:
            self.wwm = has
        elif has != self.wwm:
            raise ValueError("ShardWriter: documents with and without word marks in one shard set")
        keys = np.asarray(keys, np.int64)
        lengths = np.asarray(lengths, np.int64)
        if len(keys) and int(keys[-1]) >= 10 ** 10:
            raise ValueError("ShardWriter: a document key over 10 digits")
        first, pos, n = 0, 0, len(lengths)
        while first < n:
            if self._f is None:
                self._open()
            reach = np.cumsum(lengths[first:]) * self.dtype.itemsize + self._bytes
            take = int(np.searchsorted(reach, self.shard_size_bytes, side="left")) + 1   # closes after that one
            if self.max_docs:
                take = min(take, self.max_docs - self._cur["num_docs"])
            take = min(take, n - first)
            tok = int(lengths[first:first + take].sum())
            self._into_blocks(keys[first:first + take], ids[pos:pos + tok], lengths[first:first + take],
                              None if marks is None else marks[pos:pos + tok])
            self._cur["num_docs"] += take
            self._cur["num_tokens"] += tok
            self._bytes += tok * self.dtype.itemsize
            self.num_docs_total += take
            first, pos = first + take, pos + tok
            if self._bytes >= self.shard_size_bytes or (self.max_docs and self._cur["num_docs"] >= self.max_docs):
                self.close_shard()

    def add(self, ids: np.ndarray, marks: Optional[np.ndarray] = None) -> None:
        """One document, keyed by its number in the whole set."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        self.add_docs(np.array([self.num_docs_total]), ids, np.array([len(ids)]),
                      None if marks is None else np.ascontiguousarray(marks, dtype=np.uint8))

    def close_shard(self) -> None:
        if self._f is None:
            return
        self._flush_block()
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
