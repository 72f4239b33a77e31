import json
import shutil
import tarfile

import numpy as np
import pytest

from data_pipeline import cli
from data_pipeline.corpus import read_documents
from data_pipeline.errors import DataError, UsageError
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
    assert m["format"] == 1 and m["dtype"] == "uint16" and m["vocab_size"] == small_shards.vocab_size
    assert m["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert m["tokenizer"]["path"] == "tokenizer.model" and len(m["tokenizer"]["sha256"]) == 64
    assert len(m["shards"]) == 8
    docs = tokens = 0
    for e in m["shards"]:  # counted with the standard library's tar reader, not ours
        with tarfile.open(small_shards.dir / e["name"]) as tf:
            members = tf.getmembers()
            ids = [x for x in members if x.name.endswith(".ids")]
            wwm = [x for x in members if x.name.endswith(".wwm")]
            assert len(ids) == len(wwm) == e["num_docs"]
            assert sum(x.size for x in ids) == 2 * e["num_tokens"] == 2 * sum(x.size for x in wwm)
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
        build_shards(bad, small_shards.tokenizer, out, max_docs_per_shard=100, progress=False, strict=True,
                     force=True)
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
    assert [s for n, s, _ in members if n.endswith(".ids")] == fast[0].tolist()
    assert [z for n, _, z in members if n.endswith(".wwm")] == fast[3].tolist()
    assert _index_members_fast(buf[:len(buf) // 2]) is None   # truncated: the general path reports it


def test_documents_blob_is_byte_for_byte_what_the_writer_adds(tmp_path):
    from data_pipeline.tario import ShardWriter, documents_blob

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, 40)
    ids = rng.integers(5, 60000, int(lengths.sum())).astype(np.uint16)
    marks = (rng.random(len(ids)) < 0.5).astype(np.uint8)
    keys = np.cumsum(rng.integers(1, 5, 40))
    one = ShardWriter(tmp_path / "a", np.uint16, 10 ** 9)
    (tmp_path / "a").mkdir()
    pos = 0
    for k, n in zip(keys.tolist(), lengths.tolist()):
        one.num_docs_total = k
        one.add(ids[pos:pos + n], marks[pos:pos + n])
        pos += n
    one.close_shard()
    blob, sizes = documents_blob(keys, ids, lengths, marks)
    data = (tmp_path / "a" / "shard-000000.tar").read_bytes()
    assert data[:len(blob)] == blob.tobytes() and sizes.sum() == len(blob)
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tf:              # the standard reader agrees
        assert [m.name for m in tf.getmembers()][:2] == [f"{keys[0]:010d}.ids", f"{keys[0]:010d}.wwm"]
    # cut into the same shards as add() one by one (keys 0, 1, ...: add()'s own numbering)
    blob, sizes = documents_blob(np.arange(40), ids, lengths, marks)
    many = ShardWriter(tmp_path / "b", np.uint16, 3000, max_docs_per_shard=7)
    (tmp_path / "b").mkdir()
    many.add_blob(blob[:sizes[:13].sum()], sizes[:13], lengths[:13] * 2, lengths[:13])   # in two parts
    many.add_blob(blob[sizes[:13].sum():], sizes[13:], lengths[13:] * 2, lengths[13:])
    many.close_shard()
    each = ShardWriter(tmp_path / "c", np.uint16, 3000, max_docs_per_shard=7)
    (tmp_path / "c").mkdir()
    pos = 0
    for n in lengths.tolist():
        each.add(ids[pos:pos + n], marks[pos:pos + n])
        pos += n
    each.close_shard()
    assert many.entries == each.entries and len(each.entries) > 5
