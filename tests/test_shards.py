import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import cli
from data_pipeline.corpus import read_documents
from data_pipeline.errors import DataError, UsageError
from data_pipeline.formats import ReadOptions
from data_pipeline.loader import ShardLoader
from data_pipeline.shards import (CorruptShardError, build_shards, check_tokenizer, read_manifest, read_shard,
                                  verify_shard_set)
from data_pipeline.tokenizer import Tokenizer


def _copy(small_shards, tmp_path):
    d = tmp_path / "set"
    shutil.copytree(small_shards.dir, d)
    return d


def test_manifest_contract_and_totals_equal_tar_contents(small_shards):
    m = read_manifest(small_shards.dir)
    assert m["format"] == 2 and m["dtype"] == "uint16" and m["vocab_size"] == small_shards.vocab_size
    assert m["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert m["tokenizer"]["path"] == "tokenizer.model" and len(m["tokenizer"]["sha256"]) == 64
    assert len(m["shards"]) == 8
    docs = tokens = 0
    for e in m["shards"]:  # counted with the standard library's tar reader, not ours: blocks of documents
        with tarfile.open(small_shards.dir / e["name"]) as tf:
            members = tf.getmembers()
            assert [x.name.split(".")[1] for x in members] == ["ids", "len", "wwm"] * (len(members) // 3)
            by = {ext: [x for x in members if x.name.endswith(ext)] for ext in (".ids", ".len", ".wwm")}
            counts = np.concatenate([np.frombuffer(tf.extractfile(x).read(), "<u4") for x in by[".len"]])
            assert len(counts) == e["num_docs"] and counts.sum() == e["num_tokens"] and counts.min() > 0
            assert sum(x.size for x in by[".ids"]) == 2 * e["num_tokens"] == 2 * sum(x.size for x in by[".wwm"])
        docs += e["num_docs"]
        tokens += e["num_tokens"]
    assert (docs, tokens) == (m["num_docs"], m["num_tokens"])


def test_decode_of_shards_is_the_normalised_source(small_shards):
    m = read_manifest(small_shards.dir)
    tk = Tokenizer(small_shards.tokenizer)
    decoded = []
    for e in m["shards"]:
        sd = read_shard(small_shards.dir / e["name"], m["dtype"], e)
        decoded += [tk.decode(sd.tokens[s:s + n]) for s, n in zip(sd.tok_start, sd.lengths)]
    assert decoded == [d.text for d in read_documents(small_shards.source)]


def test_wwm_marks_follow_gold_words(small_shards):
    m = read_manifest(small_shards.dir)
    e = m["shards"][0]
    sd = read_shard(small_shards.dir / e["name"], m["dtype"], e)
    tk = Tokenizer(small_shards.tokenizer)
    doc = next(iter(read_documents(small_shards.source)))
    ids = sd.tokens[sd.tok_start[0]:sd.tok_start[0] + sd.lengths[0]]
    marks = sd.marks[sd.wwm_start[0]:sd.wwm_start[0] + sd.lengths[0]]
    assert marks.tolist() == tk.word_marks(doc.text, ids.astype(np.int64), doc.words).tolist()
    assert 0 < marks.mean() < 1


def test_cli_prepare_then_inspect_verify(tmp_path, peoples_daily, capsys):
    src = tmp_path / "pd.txt"
    src.write_text("".join(open(peoples_daily, encoding="utf-8").readlines()[:300]), encoding="utf-8")
    out = tmp_path / "prep"
    assert cli.main(["prepare", "--input", str(src), "--vocab-size", "3000", "--out", str(out)]) == 0
    assert (out / "tokenizer.model").is_file() and (out / "manifest.json").is_file()
    assert cli.main(["inspect", "--verify", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verify: OK" in text and "300 documents" in text and "迈向充满希望的新世纪" in text


def test_same_input_gives_identical_shards_with_two_workers(tmp_path, small_shards):
    m2 = build_shards(small_shards.source, small_shards.tokenizer, tmp_path / "w2", workers=2,
                      max_docs_per_shard=200, progress=False)
    m1 = read_manifest(small_shards.dir)
    assert [e["sha256"] for e in m1["shards"]] == [e["sha256"] for e in m2["shards"]]


def test_failed_rebuild_keeps_the_old_set_and_leaves_nothing(tmp_path, small_shards):
    out = tmp_path / "set"
    good = build_shards(small_shards.eval_source, small_shards.tokenizer, out, max_docs_per_shard=100,
                        progress=False)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(open(small_shards.eval_source, "rb").read() + b"\xff\n")
    with pytest.raises(UsageError, match="a shard set is already there; pass --force"):
        build_shards(small_shards.eval_source, small_shards.tokenizer, out, progress=False)
    with pytest.raises(DataError, match=r"bad\.txt:401: invalid UTF-8"):
        build_shards(bad, small_shards.tokenizer, out, max_docs_per_shard=100, progress=False,
                     force=True, read=ReadOptions(strict=True))
    assert read_manifest(out)["shards"] == good["shards"] and verify_shard_set(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "set"]       # no staging left behind
    again = build_shards(small_shards.eval_source, small_shards.tokenizer, out, max_docs_per_shard=50,
                         progress=False, force=True)
    assert len(again["shards"]) == 8 and verify_shard_set(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "set"]


def test_truncated_shard(tmp_path, small_shards, capsys):
    d = _copy(small_shards, tmp_path)
    p = d / "shard-000002.tar"
    p.write_bytes(p.read_bytes()[:5000])
    assert cli.main(["inspect", "--verify", str(d)]) == 4
    assert "shard-000002.tar" in capsys.readouterr().err
    m = read_manifest(d)
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar: truncated"):
        read_shard(p, m["dtype"], m["shards"][2], verify_hash=False)
    with pytest.raises(Exception, match=r"shard-000002\.tar"):
        for _ in ShardLoader(d, seq_len=64, micro_batch_size=4, num_workers=0, max_epochs=1):
            pass


def test_hash_mismatch_and_skip_bad_shards(tmp_path, small_shards, caplog):
    d = _copy(small_shards, tmp_path)
    p = d / "shard-000005.tar"
    b = bytearray(p.read_bytes())
    b[2000] ^= 0xFF  # one flipped bit in a token: parses fine, only the hash tells
    p.write_bytes(bytes(b))
    assert any("shard-000005.tar: sha256 mismatch" in x for x in verify_shard_set(d))
    with pytest.raises(Exception, match=r"shard-000005\.tar: sha256 mismatch"):
        list(ShardLoader(d, seq_len=64, micro_batch_size=4, num_workers=0, max_epochs=1))
    ld = ShardLoader(d, seq_len=64, micro_batch_size=4, num_workers=1, max_epochs=1, skip_bad_shards=True)
    with caplog.at_level("WARNING"):
        n = sum(1 for _ in ld)
    m = read_manifest(d)
    assert n > 0 and ld.stats["bad_shards_skipped"] == 1 and ld.stats["bad_shards"] == ["shard-000005.tar"]
    assert ld.stats["docs"] == m["num_docs"] - m["shards"][5]["num_docs"]
    assert "shard-000005.tar" in caplog.text


def test_missing_shard_file(tmp_path, small_shards, capsys):
    d = _copy(small_shards, tmp_path)
    (d / "shard-000001.tar").unlink()
    assert cli.main(["inspect", "--verify", str(d)]) == 4
    assert "shard-000001.tar: shard missing" in capsys.readouterr().err


def test_tokenizer_mismatch(tmp_path, small_shards, capsys):
    d = _copy(small_shards, tmp_path)
    other = tmp_path / "other.model"
    shutil.copyfile(small_shards.tokenizer, other)
    with open(other, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        check_tokenizer(d, tokenizer=other)
    with pytest.raises(ValueError, match="vocab_size mismatch: the shards have vocab_size 4000, the model expects 8000"):
        check_tokenizer(d, vocab_size=8000)
    check_tokenizer(d, tokenizer=small_shards.tokenizer, vocab_size=4000)
    shutil.copyfile(other, d / "tokenizer.model")  # the set's own model replaced
    assert cli.main(["inspect", "--verify", str(d)]) == 4
    assert "tokenizer mismatch" in capsys.readouterr().err


def test_manifest_errors_name_the_field(tmp_path, small_shards):
    with pytest.raises(ValueError, match="not a shard set"):
        read_manifest(tmp_path)
    d = _copy(small_shards, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["shards"][3]["num_docs"] = -1
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"manifest.json: field 'shards\[3\].num_docs': expected a non-negative"):
        read_manifest(d)
    m["shards"][3]["num_docs"] = 205
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"field 'num_docs': expected the sum over shards"):
        read_manifest(d)
    del m["vocab_size"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="missing field 'vocab_size'"):
        read_manifest(d)


def test_fast_tar_index_equals_the_general_parser(small_shards):
    from data_pipeline.tario import _index_members_fast, iter_tar_members

    buf = (small_shards.dir / "shard-000000.tar").read_bytes()
    fast = _index_members_fast(buf)
    assert fast is not None
    members = list(iter_tar_members(buf, "shard-000000.tar"))
    for (starts, sizes, _), ext in zip(fast, (".ids", ".wwm", ".len")):
        assert [(s, z) for n, s, z in members if n.endswith(ext)] == list(zip(starts.tolist(), sizes.tolist()))
    assert _index_members_fast(buf[:len(buf) // 2]) is None   # truncated: the general path reports it


def test_writer_output_depends_only_on_the_documents(tmp_path):
    """add_docs in any batching writes byte for byte what add() writes one by one: the same shard cuts
    (shard size, max_docs_per_shard), blocks (block_tokens) and hashes; every reader gets the documents."""
    import webdataset as wds

    from data_pipeline.tario import ShardWriter, parse_shard

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, 40)
    ids = rng.integers(5, 60000, int(lengths.sum())).astype(np.uint16)
    marks = (rng.random(len(ids)) < 0.5).astype(np.uint8)
    ends = np.cumsum(lengths)
    kw = dict(max_docs_per_shard=7, block_tokens=900)
    each = ShardWriter(tmp_path, np.uint16, 3000, **kw)
    for n, end in zip(lengths.tolist(), ends.tolist()):
        each.add(ids[end - n:end], marks[end - n:end])
    each.close_shard()
    many = ShardWriter(tmp_path / "b", np.uint16, 3000, **kw)
    (tmp_path / "b").mkdir()
    for lo, hi in ((0, 1), (1, 13), (13, 14), (14, 40)):                  # in parts of any size
        a, b = ends[lo] - lengths[lo], ends[hi - 1]
        many.add_docs(np.arange(lo, hi), ids[a:b], lengths[lo:hi], marks[a:b])
    many.close_shard()
    assert many.entries == each.entries and len(each.entries) > 5
    got, seen = [], 0
    for e in each.entries:
        buf = (tmp_path / e["name"]).read_bytes()
        sd = parse_shard(buf, e["name"], "uint16", e)
        got += [sd.tokens[s:s + n].tolist() for s, n in zip(sd.tok_start, sd.lengths)]
        assert [sd.marks[w:w + n].tolist() for w, n in zip(sd.wwm_start, sd.lengths)] == \
            [marks[a:a + n].tolist() for a, n in zip((ends - lengths)[seen:seen + sd.num_docs],
                                                       lengths[seen:seen + sd.num_docs])]
        seen += sd.num_docs
    assert got == [ids[end - n:end].tolist() for n, end in zip(lengths, ends)]
    samples = list(wds.WebDataset(str(tmp_path / "shard-000000.tar"), shardshuffle=False))  # a block is a sample
    first = samples[0]
    n0 = np.frombuffer(first["len"], "<u4")
    assert first["__key__"] == "0000000000" and len(n0) >= 1 and len(first["ids"]) == 2 * int(n0.sum())


def test_ids_and_marks_equal_the_format_1_builder(tmp_path, peoples_daily):
    """The token ids, lengths, word marks and shard cuts of plain text (odd characters included: full-width
    forms, controls, NFKC cases), People's Daily tagged text and JSON lines are those the format-1 builder
    (git 64ffe40) wrote for the same input and tokenizer (tests/fixtures/shards_ref: its digests)."""
    import hashlib

    from data_pipeline.shards import load_shard

    ref_dir = Path(__file__).parent / "fixtures" / "shards_ref"
    ref = json.loads((ref_dir / "reference.json").read_text())
    for kind, src in _reference_corpus(tmp_path, peoples_daily).items():
        out = tmp_path / kind
        m = build_shards(src, ref_dir / "tokenizer.model", out, max_docs_per_shard=37, shard_size_mb=0.002,
                         progress=False)
        docs = [load_shard(out, m, i) for i in range(len(m["shards"]))]
        ids = np.concatenate([sd.tokens[s:s + n] for sd in docs for s, n in zip(sd.tok_start, sd.lengths)])
        marks = np.concatenate([sd.marks[w:w + n] for sd in docs for w, n in zip(sd.wwm_start, sd.lengths)])
        lengths = np.concatenate([sd.lengths for sd in docs])
        got = {"docs_per_shard": [e["num_docs"] for e in m["shards"]], "num_tokens": m["num_tokens"],
               "ids": hashlib.sha256(ids.astype("<u2").tobytes()).hexdigest(),
               "lengths": hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest(),
               "marks": hashlib.sha256(marks.tobytes()).hexdigest()}
        assert got == ref[kind], kind


_ODD = ["ＡＢＣ１２３，ｘｙｚ。", "\u3000全角空格开头", "零宽\u200b字符", "tab\tsep  and   spaces  ", "café ﬁ ①② Ⅻ ㍿ ｶﾞ",
        "\u1100\u1161\u11a8 한국어", "😀 emoji 𠀀", "x", "a\u0301e\u0300", "\ufeffBOM开头", "   ", "ABC abc 123 4.5%"]


def _reference_corpus(root: Path, peoples_daily: Path) -> dict:
    """The corpus tests/fixtures/shards_ref was made from (plain, tagged, jsonl): 300 People's Daily lines, the
    plain text interleaved with odd lines."""
    from data_pipeline.corpus import _pd_words

    with open(peoples_daily, encoding="utf-8") as f:
        lines = [line for i, line in enumerate(f) if 2000 <= i < 2300]
    tagged = root / "ref_tagged.txt"
    tagged.write_text("".join(lines), encoding="utf-8")
    plain_lines = ["".join(_pd_words(line)) for line in lines if line.strip()]
    plain = root / "ref_plain.txt"
    mixed = [x for pair in zip(plain_lines, _ODD * 30) for x in pair]
    plain.write_text("\n".join(mixed) + "\n", encoding="utf-8")
    jsonl = root / "ref_docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in mixed[:120]),
                     encoding="utf-8")
    return {"plain": plain, "tagged": tagged, "jsonl": jsonl}


def test_format_1_sets_are_read_and_other_formats_refused(tmp_path):
    """A set written before blocks (tests/fixtures/format1_set: format 1, a member pair per document, by git
    64ffe40's write_shard_set) verifies, reads its documents and loads; an unknown format is refused
    naming the version found and the ones read."""
    from data_pipeline.shards import load_shard

    old = Path(__file__).parent / "fixtures" / "format1_set"
    m = read_manifest(old)
    assert m["format"] == 1 and verify_shard_set(old) == []
    docs = [sd.tokens[s:s + n].tolist() for i in range(2) for sd in [load_shard(old, m, i)]
            for s, n in zip(sd.tok_start, sd.lengths)]
    want = [((np.arange(3 + i * 5 % 11) * 37 + i * 11) % 990 + 5).tolist() for i in range(12)]
    assert docs == want
    kw = dict(seq_len=16, micro_batch_size=2, num_workers=0, seed=1, max_epochs=2)
    full = list(ShardLoader(old, **kw))
    ld = ShardLoader(old, **kw)
    it = iter(ld)
    for _ in range(3):
        next(it)
    resumed = ShardLoader(old, **kw)
    resumed.load_state_dict(ld.state_dict())
    rest = list(resumed)
    assert len(full) > 4 and len(rest) == len(full) - 3
    assert all(all((a[k] == b[k]).all() for k in a) for a, b in zip(rest, full[3:]))
    d = tmp_path / "future"
    shutil.copytree(old, d)
    (d / "manifest.json").write_text(json.dumps({**m, "format": 3}))
    with pytest.raises(DataError, match=r"field 'format': expected format version 2 \(or 1\), got 3"):
        read_manifest(d)
