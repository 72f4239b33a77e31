import gzip
import json

import numpy as np
import pytest

from data_pipeline.corpus import CorpusStats, normalize, read_documents
from data_pipeline.errors import DataError
from data_pipeline.formats import ReadOptions


def test_normalize_nfkc_fullwidth_controls_whitespace():
    assert normalize("Ａ１，ｂ\u3000ｃ") == "A1,b c"             # full-width -> half-width, ideographic space
    assert normalize("中\u200b文\x07\ufeff") == "中文"           # zero-width, BEL, BOM removed
    assert normalize("  a \t\n b  ") == "a b"                   # whitespace collapsed and stripped
    assert normalize("\x00\x01 \u3000 ") == ""


def test_peoples_daily_tags_stripped_words_kept(tmp_path):
    f = tmp_path / "pd.txt"
    f.write_text("19980101-01-001-002/m  [中国/ns  政府/n]nt  发表/v  声明/n  ，/w  １９９８年/t\n"
                 "迈向/v  充满/v  希望/n\n", encoding="utf-8")
    stats = CorpusStats()
    docs = list(read_documents(f, stats=stats))
    assert [d.text for d in docs] == ["中国政府发表声明,1998年", "迈向充满希望"]
    assert docs[0].words == ["中国", "政府", "发表", "声明", ",", "1998年"]
    assert "".join(docs[1].words) == docs[1].text


def test_real_peoples_daily_has_gold_words(peoples_daily):
    docs = list(read_documents(peoples_daily, limit=50))
    assert len(docs) == 50 and all(d.words and "".join(d.words) == d.text for d in docs)
    assert not any("/" in d.text and d.text.count("/") > 3 for d in docs)  # tags gone
    assert docs[0].text.startswith("迈向充满希望的新世纪")


def test_invalid_utf8_and_empty_lines_skipped_and_counted(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes("第一行\n".encode() + b"\xff\xfe bad \xc3\n" + b"\n   \n" + "第二行\n".encode())
    stats = CorpusStats()
    assert [d.text for d in read_documents(f, stats=stats)] == ["第一行", "第二行"]
    assert stats.invalid_utf8_lines == 1 and stats.empty_docs == 2 and stats.docs == 2
    assert "1 invalid UTF-8 lines" in stats.summary() and "2 empty documents" in stats.summary()


def test_invalid_utf8_strict_names_file_and_line(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(b"ok\n\xff\n")
    with pytest.raises(ValueError, match=r"c\.txt:2: invalid UTF-8"):
        list(read_documents(f, options=ReadOptions(strict=True)))


def test_jsonl_gz_blank_boundary_dir_and_glob(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as g:
        g.write(json.dumps({"content": "你好 世界"}) + "\n\n" + json.dumps({"content": "再见"}) + "\n")
    assert [d.text for d in read_documents(tmp_path / "a.jsonl.gz", options=ReadOptions(text_field="content"))] == ["你好 世界", "再见"]
    with pytest.raises(ValueError, match=r"a\.jsonl\.gz:1: expected a JSON object with a string field 'text'"):
        list(read_documents(tmp_path / "a.jsonl.gz"))
    d = tmp_path / "txt"
    d.mkdir()
    (d / "b.txt").write_text("第一段\n第一段续\n\n第二段\n", encoding="utf-8")
    assert [x.text for x in read_documents(d, options=ReadOptions(doc_boundary="blank"))] == ["第一段 第一段续", "第二段"]
    assert [x.text for x in read_documents(str(d / "*.txt"))] == ["第一段", "第一段续", "第二段"]


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        list(read_documents(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="matches no file"):
        list(read_documents(str(tmp_path / "*.zzz")))


def test_batch_normalisation_equals_the_one_by_one_rules(peoples_daily):
    """The hot path (normalize_batch / normalize_words_batch) gives exactly normalize / normalize_words."""
    from data_pipeline.corpus import (_pd_words, normalize_batch, normalize_words, normalize_words_batch,
                                      pd_documents_batch)

    lines = open(peoples_daily, encoding="utf-8").readlines()[:1500]
    texts = ["".join(_pd_words(x)) for x in lines] + lines[:50] + [
        "Ａ\u0301 ｂ", "a\u200bb\tc", "  x  y ", "\u3000全角\uff01", "①②℃…", "\ud800x", "", "\x00\x01",
        "Ａ１，ｂ\u3000ｃ", "e\u0301", "ｶﾞ", "\ufeff开头", "a\u00a0b", "x\u2028y"]
    assert normalize_batch(texts) == [normalize(t) for t in texts]
    words = [_pd_words(x) for x in lines] + [["Ａ", "\u0301b"], ["a b", "  ", "c\ue000d"], ["x\u200b", "ｙ"],
                                             ["\u3000"], ["①", "ｶﾞ"]]
    assert normalize_words_batch(words) == [normalize_words(w) for w in words]
    # raw People's Daily lines: the vectorised parser (pd_documents_batch) against _pd_words + normalize_words
    odd = ["[中央/n  人民/n  广播/vn  电台/n]nt  [a/b/c  x/n]", "  /w  [/w  ]/w  ［/w  ／/w  ｘ/n  a]b/n  [[x/n",
           "19980101-01-001-001/m  迈向/v", "19980101-01-001-001/m", "notag  [ /n [x]/n [y]z/n \u3000全角/n\u2028分/n",
           "a/n\tb/n\x85c/n", "Ａ/n\u0301/n e/n\u0301x/n", "/n /nn /n]x [/n", "[", "abc/", "a/1 b/n1 c/N", "a/n]b]c/n",
           "\x00ctl/n \u200bzw/n", "a/n]", "", "  "]
    raw = lines + odd
    assert not any(chr(cp).isspace() for cp in range(0x3001, 0x110000))    # the parser's class table ends there
    for batch in (raw, ["x\ue000y/n"] + odd, ["\ud800/n"] + odd):               # the last two: the slow path
        got = [(t, w.tolist() if isinstance(w, np.ndarray) else [len(x) for x in w])
               for t, w in pd_documents_batch(batch)]
        assert got == [("".join(w), [len(x) for x in w]) for w in (normalize_words(_pd_words(r)) for r in batch)]


def test_joined_normalisation_equals_the_one_by_one_rules(peoples_daily):
    """A chunk normalised as one joined text (the shard builder's hot path) gives exactly normalize of each text;
    a chunk holding anything the joined checks do not take goes the general way, with the same result."""
    import random

    from data_pipeline.corpus import _normalize_joined, _pd_words, normalize_batch

    lines = open(peoples_daily, encoding="utf-8").readlines()[:3000]
    clean = ["".join(_pd_words(x)) for x in lines if x.strip()]           # full-width forms, "…", ①, ℃: NFKC's work
    edges = ["", "   ", " 前后空格\r", "Ａ１，ｂ\u3000ｃ", "…", "ｶﾞ", "a\u00a0b", "e\u0301", "\u3000全角\uff01 "]
    tricky = ["a\nb", "a\u200bb", "x\ty", "a  b", "x\u2028y", "\x00", "\ud800x", "\u0301开头", "ｂ\u3000\u3000ｃ",
              "\ue000", "\u00a8"]
    rng = random.Random(0)
    taken = 0
    for i in range(300):
        batch = rng.sample(clean, rng.randint(1, 40)) + rng.sample(edges, rng.randint(0, 3))
        if i % 3 == 0:
            batch.append(rng.choice(tricky))
        rng.shuffle(batch)
        want = [normalize(t) for t in batch]
        assert normalize_batch(batch) == want, batch
        fast = _normalize_joined(batch)
        taken += fast is not None
        assert fast is None or fast == want, batch
    assert taken >= 150                                   # the joined path did the work, not the fallback
    for t in tricky:                                      # each of these alone is refused by the joined checks
        assert _normalize_joined(["好", t]) is None or normalize(t) == t.strip(), t
    assert _normalize_joined(["", " ", "\r"]) == ["", "", ""]


def test_block_reader_equals_reading_line_by_line(tmp_path, monkeypatch):
    """Lines read in blocks (any block size: lines across blocks, CRLF, a last line without newline, and the
    blocks that go line by line: invalid UTF-8, NUL, over-long lines) and in byte ranges give exactly the
    records and counts of reading one line at a time."""
    import data_pipeline.corpus as corpus
    from data_pipeline.corpus import InputRange, iter_records

    lines = [b"first line\n", "中文一行，全角\n".encode(), b"crlf\r\n", b"\xff\xfe bad utf-8\n", b"nul \0 here\n",
             b"L" * 70 + b"\n", b"\n", b"after the long one\n", b"y" * 45 + b"\n", b"no newline at the end"]
    f = tmp_path / "mixed.txt"
    everything = lines[:-1] * 3 + lines[-1:]
    f.write_bytes(b"".join(everything))

    def by_line(limit):       # the rules one line at a time: valid UTF-8 lines of at most `limit` bytes, as
        out = []              # records without their newline
        for raw in everything:
            try:
                out += [raw.decode("utf-8").removesuffix("\n")] if len(raw.rstrip(b"\n")) <= limit else []
            except UnicodeDecodeError:
                pass
        return out

    size = f.stat().st_size
    for block in (5, 64, 1 << 20):
        monkeypatch.setattr(corpus, "_BLOCK_BYTES", block)
        st = CorpusStats()
        got = [t for _, t in iter_records(f, fmt="txt", stats=st, options=ReadOptions(max_line_bytes=50))]
        assert got == by_line(50), block
        assert (st.lines, st.invalid_utf8_lines, st.long_lines) == (28, 3, 3)
        cuts = [0, 7, 100, 101, 230, size]
        ranged = [t for a, b in zip(cuts, cuts[1:])
                  for _, t in iter_records(InputRange(f, a, b), fmt="txt", options=ReadOptions(max_line_bytes=50))]
        assert ranged == got, block
    with pytest.raises(DataError, match=r"mixed\.txt:4: invalid UTF-8"):
        list(iter_records(f, fmt="txt", options=ReadOptions(strict=True)))
    with pytest.raises(DataError, match=r"mixed\.txt: the line at byte 63: a line of 71 bytes"):
        list(iter_records(InputRange(f, 60, size), fmt="txt", options=ReadOptions(strict=True, max_line_bytes=50)))


def test_record_chunks_equal_the_records_one_file_at_a_time(tmp_path, peoples_daily):
    """iter_record_chunks: the records of iter_records, in order, numbered by their index in the whole input,
    in chunks of at most `size` that never span two files (one kind per chunk)."""
    from data_pipeline.corpus import iter_record_chunks, iter_records

    d = tmp_path / "in"
    d.mkdir()
    lines = open(peoples_daily, encoding="utf-8").readlines()[:700]
    (d / "a_pd.txt").write_text("".join(lines[:300]), encoding="utf-8")                  # tagged: kind pd
    (d / "b_plain.txt").write_text("一\n\n二\r\n  \n三", encoding="utf-8")               # blank lines are records
    (d / "c.jsonl").write_text("".join(json.dumps({"text": f"第{i}行"}) + "\n" for i in range(250)), encoding="utf-8")
    want = list(iter_records(d))
    for size in (1, 7, 100, 1024):
        st = CorpusStats()
        chunks = list(iter_record_chunks(d, stats=st, size=size))
        assert [(k, r) for _, k, recs in chunks for r in recs] == want
        assert [first for first, _, _ in chunks] == list(np.cumsum([0] + [len(c) for _, _, c in chunks])[:-1])
        assert all(0 < len(recs) <= size for _, _, recs in chunks)
        kinds = [k for _, k, _ in chunks]
        assert kinds == sorted(kinds, key=["pd", "text"].index) and {"pd", "text"} == set(kinds)
        assert st.files == 3 and st.lines == 300 + 5 + 250
    assert want[300:305] == [("text", "一"), ("text", ""), ("text", "二\r"), ("text", "  "), ("text", "三")]


def test_records_normalised_as_utf8_bytes_equal_the_str_texts(peoples_daily):
    """normalize_records(utf8=True) (what the shard builder hands SentencePiece) gives the str texts' UTF-8 bytes
    and the same counts; a chunk with a lone surrogate (from JSON escapes) stays str."""
    from data_pipeline.corpus import _pd_words, normalize_records

    lines = open(peoples_daily, encoding="utf-8").read().split("\n")[:800]
    for kind, records in (("pd", lines), ("text", ["".join(_pd_words(x)) for x in lines] + ["", " a  b ", "x\u3000y"])):
        s1, s2 = CorpusStats(), CorpusStats()
        keep, texts, words = normalize_records(kind, records, s1)
        keep8, data, words8 = normalize_records(kind, records, s2, utf8=True)
        assert list(keep8) == list(keep) and all(isinstance(b, bytes) for b in data)
        assert data == [t.encode("utf-8") for t in texts] and s1 == s2 and s1.bytes == sum(map(len, data))
        assert s1.chars == sum(map(len, texts)) and s1.docs == len(texts) == len(keep)
        assert (words is None) == (words8 is None) == (kind == "text")
    keep, texts, _ = normalize_records("text", ["ok", "bad \ud800"], utf8=True)
    assert texts == ["ok", "bad \ud800"]


def test_a_new_format_is_one_reader_and_one_line_in_the_table(tmp_path, peoples_daily, monkeypatch):
    """A format is a Reader registered in data_pipeline.formats.FORMATS: with nothing else, auto mode finds it
    by its suffix (also .gz), --format offers it, and roformer-data prepares a shard set of it."""
    from data_pipeline import cli
    from data_pipeline.corpus import _pd_words, detect_format
    from data_pipeline.formats import FORMATS, TEXT
    from data_pipeline.manifest import read_manifest

    class TabSeparated:                                  # what a new module's READER would be
        help = "tab-separated lines, the text in the last column; auto: .tsv files"
        suffixes = (".tsv",)
        kind = TEXT

        def looks_like(self, line):
            return False

        def splittable(self, options):
            return True

        def records(self, lines, options):
            for batch in lines.batches():
                yield [line.rsplit("\t", 1)[-1] for line in batch]

    monkeypatch.setitem(FORMATS, "tsv", TabSeparated())          # the one line in the table
    texts = ["".join(_pd_words(x)) for x in open(peoples_daily, encoding="utf-8").readlines()[:400] if x.strip()]
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.tsv").write_text("".join(f"{i}\tpos\t{t}\n" for i, t in enumerate(texts[:300])), encoding="utf-8")
    with gzip.open(d / "b.tsv.gz", "wt", encoding="utf-8") as g:
        g.write("".join(f"{i}\t{t}\n" for i, t in enumerate(texts[300:])))
    assert detect_format(d / "a.tsv") == detect_format(d / "b.tsv.gz") == "tsv"
    stats = CorpusStats()
    assert [x.text for x in read_documents(d, stats=stats)] == [normalize(t) for t in texts]
    assert stats.files == 2 and stats.docs == len(texts)
    out = tmp_path / "set"
    assert cli.main(["prepare", "--input", str(d), "--format", "tsv", "--vocab-size", "3000", "--num-threads", "2",
                     "--workers", "1", "--no-progress", "--out", str(out)]) == 0
    assert read_manifest(out)["num_docs"] == len(texts)
