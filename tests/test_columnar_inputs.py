"""Corpus inputs beyond text files: Parquet (pyarrow), Hugging Face ``datasets``' ``save_to_disk`` directories
(Arrow IPC streams) and zstandard-compressed text (``.jsonl.zst``, ``.txt.zst``).

Each is written by the library its users write it with (pyarrow, ``datasets``, zstandard) and must give the
shard set of the same texts given as JSON lines: the same documents, token ids and word marks, the same counts.
Damaged inputs give one error naming the file and the row; Parquet is read a row group at a time and cut at
row groups for ``--tasks``."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

from data_pipeline.corpus import CorpusStats, _pd_words, read_documents
from data_pipeline.errors import EXIT_DATA, DataError
from data_pipeline.formats import ReadOptions
from data_pipeline.manifest import read_manifest
from data_pipeline.shards import build_shards
from test_prepare_cluster import documents

pa = pytest.importorskip("pyarrow", reason="pyarrow (Parquet, Arrow inputs) is not installed: pip install pyarrow")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow.parquet is missing from this pyarrow build")
zstandard = pytest.importorskip("zstandard", reason="zstandard (.zst inputs) is not installed: pip install zstandard")

NUM_TEXTS = 600


@pytest.fixture(scope="module")
def texts(peoples_daily) -> list[str]:
    """People's Daily lines without their tags (full-width forms: normalisation has work), and a few that
    normalise to nothing or to something else."""
    with open(peoples_daily, encoding="utf-8") as f:
        lines = [line for _, line in zip(range(NUM_TEXTS), f) if line.strip()]
    out = ["".join(_pd_words(line)) for line in lines]
    out[3:3] = ["", "  \u3000 ", "Ｆｕｌｌ\u3000ｗｉｄｔｈ\u200b ｔｅｘｔ\x07"]
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, texts) -> Path:
    from data_pipeline.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("columnar_tok")
    return train_tokenizer((d.text for d in read_documents(_write_jsonl(d / "t.jsonl", texts))), d / "sp",
                           vocab_size=3000, num_threads=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, texts, tokenizer):
    """The shard set of the texts as JSON lines: (its documents, its manifest, the corpus stats)."""
    d = tmp_path_factory.mktemp("columnar_ref")
    return _build(_write_jsonl(d / "corpus.jsonl", texts), tokenizer, d / "set")


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)),
                    encoding="utf-8")
    return path


def _build(inputs, tokenizer: Path, out: Path, max_docs_per_shard: int = 128):
    stats = CorpusStats()
    m = build_shards(inputs, tokenizer, out, workers=1, progress=False, max_docs_per_shard=max_docs_per_shard,
                     stats=stats)
    return documents(out), m, stats


def _zst(path: Path, data: bytes, frames: int = 3) -> Path:
    """``data`` zstandard-compressed in ``frames`` frames (as pzstd and zstd -T write large files), each with its
    checksum (as the zstd command writes them)."""
    step = -(-len(data) // frames)
    path.write_bytes(b"".join(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data[i:i + step])
                              for i in range(0, len(data), step)))
    return path


def _parquet(path: Path, texts: list, row_group_size: int = 64, field: str = "text") -> Path:
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path


def _saved_dataset(path: Path, columns: dict, num_shards: int = 2) -> Path:
    datasets = pytest.importorskip("datasets", reason="datasets (writes the save_to_disk test input) is not "
                                                      "installed: pip install datasets")
    datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=num_shards)
    return path


WRITERS = {        # name -> (write the texts into a directory, the number of files read)
    "parquet": (lambda d, texts: _parquet(d / "corpus.parquet", texts), 1),
    "save_to_disk": (lambda d, texts: _saved_dataset(d / "hf", {"id": list(range(len(texts))), "text": texts}), 2),
    "jsonl.zst": (lambda d, texts: _zst(d / "corpus.jsonl.zst", _write_jsonl(d / "plain.jsonl", texts).read_bytes()),
                  1),
    "txt.zst": (lambda d, texts: _zst(d / "corpus.txt.zst", "".join(t + "\n" for t in texts).encode("utf-8")), 1),
}


@pytest.mark.parametrize("kind", WRITERS)
def test_each_input_builds_the_shard_set_of_the_same_json_lines(kind, texts, tokenizer, reference, tmp_path):
    write, num_files = WRITERS[kind]
    src = write(tmp_path, texts)
    docs, m, stats = _build(src, tokenizer, tmp_path / "set")
    ref_docs, ref_m, ref_stats = reference
    assert len(ref_docs) == len(texts) - 2                 # the two blank ones are not documents
    assert docs == ref_docs
    same = ("num_docs", "num_tokens", "text_bytes", "shards", "vocab_size", "dtype", "special_ids", "word_marks")
    assert {k: m[k] for k in same} == {k: ref_m[k] for k in same}          # the shards' sha256 too
    assert (stats.docs, stats.empty_docs, stats.chars, stats.bytes, stats.files) == \
        (ref_stats.docs, ref_stats.empty_docs, ref_stats.chars, ref_stats.bytes, num_files)


def test_roformer_data_reads_a_save_to_disk_directory_among_other_inputs(texts, tokenizer, reference, tmp_path,
                                                                         capsys):
    """`roformer-data shards --input DIR` in auto mode: the saved dataset below DIR is its data files in
    state.json's order (its json files are not read as JSON lines), beside a Parquet file and text."""
    from data_pipeline import cli

    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(t + "\n" for t in texts[:100])
                                                                      .encode("utf-8")))
    _saved_dataset(d / "b_hf", {"text": texts[100:400], "n": list(range(300))}, num_shards=3)
    _parquet(d / "c.parquet", texts[400:], row_group_size=50)
    out = tmp_path / "set"
    assert cli.main(["shards", "--input", str(d), "--tokenizer", str(tokenizer), "--out", str(out), "--workers",
                     "1", "--no-progress", "--max-docs-per-shard", "128"]) == 0
    assert documents(out) == reference[0]
    assert read_manifest(out)["num_tokens"] == reference[1]["num_tokens"]
    assert "corpus: 5 files, " in capsys.readouterr().out                # the .zst, 3 data files, the .parquet


def test_the_text_column_is_the_text_field(texts, tmp_path):
    src = _parquet(tmp_path / "c.parquet", texts, field="content")
    content = ReadOptions(text_field="content")
    assert [d.text for d in read_documents(src, options=content)] == \
        [d.text for d in read_documents(_write_jsonl(tmp_path / "c.jsonl", texts, "content"), options=content)]
    with pytest.raises(DataError, match=re.escape(f"{src}: no column 'text' (set --text-field") + ".*'id', 'content'"):
        list(read_documents(src))


def test_one_text_field_flag_for_every_format_and_its_old_name_still_works(texts, tokenizer, reference, tmp_path):
    """`--text-field content` names the column of Parquet and the field of JSON lines in one command; the flag's
    old name `--jsonl-field` gives the same set."""
    from data_pipeline import cli

    d = tmp_path / "in"
    d.mkdir()
    _write_jsonl(d / "a.jsonl", texts[:300], "content")
    _parquet(d / "b.parquet", texts[300:], field="content")
    for flag in ("--text-field", "--jsonl-field"):
        out = tmp_path / flag.strip("-")
        assert cli.main(["shards", "--input", str(d), "--tokenizer", str(tokenizer), "--out", str(out), "--workers",
                         "1", "--no-progress", "--max-docs-per-shard", "128", flag, "content"]) == 0
        assert documents(out) == reference[0]


def test_over_long_texts_are_skipped_and_counted_as_over_long_json_lines_are(tmp_path):
    rows = ["短", "长" * 30, "也短", "长" * 40]              # 90 and 120 bytes of UTF-8: over the limit of 80
    src = _parquet(tmp_path / "c.parquet", rows, row_group_size=2)
    ref = _write_jsonl(tmp_path / "c.jsonl", rows)
    got, want = CorpusStats(), CorpusStats()
    assert [d.text for d in read_documents(src, stats=got, options=ReadOptions(max_line_bytes=80))] == \
        [d.text for d in read_documents(ref, stats=want, options=ReadOptions(max_line_bytes=80))] == ["短", "也短"]
    assert got.long_lines == want.long_lines == 2 and "longer than 80 bytes were skipped" in got.warnings()[0]
    with pytest.raises(DataError, match=r"c\.parquet: row 3: a text of 120 bytes in column 'text', longer than the "
                                        r"limit of 100 bytes"):
        list(read_documents(src, options=ReadOptions(strict=True, max_line_bytes=100)))


def _bad_inputs(d: Path, texts: list[str]) -> dict:
    """name -> (the input, what its one error line must say)."""
    rows = list(texts[:300])
    with_null = rows[:130] + [None] + rows[131:]
    parquet_ok = _parquet(d / "ok.parquet", rows)
    raw = parquet_ok.read_bytes()
    (d / "truncated.parquet").write_bytes(raw[:len(raw) // 2])
    meta = pq.ParquetFile(parquet_ok).metadata.row_group(2).column(1)      # the text column of row group 2
    at = meta.data_page_offset
    (d / "damaged.parquet").write_bytes(raw[:at] + b"\xff" * 64 + raw[at + 64:])
    hf_null = _saved_dataset(d / "hf_null", {"text": with_null}, num_shards=1)
    hf_number = _saved_dataset(d / "hf_number", {"text": list(range(300))}, num_shards=1)
    with pa.ipc.new_stream(d / "ok.arrow", pa.schema([("text", pa.string())])) as w:   # batches of 50 rows
        for i in range(0, len(rows), 50):
            w.write_batch(pa.record_batch([pa.array(rows[i:i + 50])], names=["text"]))
    data = (d / "ok.arrow").read_bytes()
    (d / "truncated.arrow").write_bytes(data[:int(len(data) * 0.6)])
    noise = random.Random(0)                       # text that does not compress away: several blocks of 128 KiB
    jsonl = _write_jsonl(d / "t.jsonl", [f"{noise.randbytes(48).hex()} {t}" for t in texts * 4]).read_bytes()
    z = _zst(d / "ok.jsonl.zst", jsonl, frames=1).read_bytes()
    (d / "truncated.jsonl.zst").write_bytes(z[:len(z) * 3 // 4])
    (d / "damaged.jsonl.zst").write_bytes(z[:40] + bytes(b ^ 0x5A for b in z[40:200]) + z[200:])
    (d / "not_zstd.txt.zst").write_bytes(b"plain text, not compressed\n")
    return {
        "parquet: missing column": (_parquet(d / "content.parquet", rows, field="content"),
                                    r"content\.parquet: no column 'text' \(set --text-field"),
        "parquet: null": (_parquet(d / "null.parquet", with_null),
                          r"null\.parquet: row 130: column 'text' is null, expected a string"),
        "parquet: number": (_parquet(d / "number.parquet", list(range(300))),
                            r"number\.parquet: row 0: column 'text' holds int64 values, expected strings"),
        "parquet: truncated": (d / "truncated.parquet", r"truncated\.parquet: cannot be read as Parquet \("),
        "parquet: damaged page": (d / "damaged.parquet",
                                  r"damaged\.parquet: cannot be read in row group 2 \(rows 128-191\)"),
        "save_to_disk: null": (hf_null, r"hf_null/data-00000-of-00001\.arrow: row 130: column 'text' is null"),
        "save_to_disk: number": (hf_number, r"hf_number/data-00000-of-00001\.arrow: row 0: column 'text' holds "
                                            r"int64 values"),
        "arrow: truncated": (d / "truncated.arrow", r"truncated\.arrow: cannot be read after row \d+ \("),
        "jsonl.zst: truncated": (d / "truncated.jsonl.zst", r"truncated\.jsonl\.zst: cannot be read after line \d+ "
                                                            r"\(the compressed file ends inside a zstd frame: "
                                                            r"truncated \.zst\?\)"),
        "jsonl.zst: damaged": (d / "damaged.jsonl.zst", r"damaged\.jsonl\.zst: cannot be read .*damaged \.zst data"),
        "txt.zst: not zstd": (d / "not_zstd.txt.zst", r"not_zstd\.txt\.zst: cannot be read \(damaged \.zst data"),
    }


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory, texts):
    return _bad_inputs(tmp_path_factory.mktemp("bad_inputs"), texts)


BAD = ["parquet: missing column", "parquet: null", "parquet: number", "parquet: truncated", "parquet: damaged page",
       "save_to_disk: null", "save_to_disk: number", "arrow: truncated", "jsonl.zst: truncated",
       "jsonl.zst: damaged", "txt.zst: not zstd"]


@pytest.mark.parametrize("name", BAD)
def test_a_bad_input_is_one_error_line_naming_the_file_and_row(name, bad_inputs, tokenizer, tmp_path, capsys):
    from data_pipeline import cli

    src, says = bad_inputs[name]
    out = tmp_path / "set"
    assert cli.main(["shards", "--input", str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--workers",
                     "1", "--no-progress"]) == EXIT_DATA
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("roformer-data shards: error: "), err
    assert "Traceback" not in err and re.search(says, lines[0]), lines[0]
    assert not out.exists()


def test_save_to_disk_layout_problems_are_named(texts, tmp_path):
    hf = _saved_dataset(tmp_path / "hf", {"text": texts[:50]}, num_shards=2)
    state = json.loads((hf / "state.json").read_text())
    state["_data_files"].append({"filename": "../escape.arrow"})
    (hf / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match=r"hf/state\.json: lists '\.\./escape\.arrow', which is not a file of"):
        list(read_documents(hf))
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:5]}),
                          "test": datasets.Dataset.from_dict({"text": texts[5:8]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict saved by datasets \(splits \['train', 'test'\]\): give "
                                        r"one split's directory as the input, e\.g\. .*dd/train"):
        list(read_documents(tmp_path / "dd"))
    assert [d.text for d in read_documents(tmp_path / "dd" / "test")] == [d.text for d in read_documents(
        _write_jsonl(tmp_path / "t.jsonl", texts[5:8]))]


def test_parquet_is_read_one_row_group_at_a_time(texts, tmp_path):
    """The Arrow memory the reader holds while it yields stays within what one row group of the text column
    takes (its strings, their offsets, the page they were decoded from: about 3x their bytes), where reading
    the file whole, or two groups at once, or the other column too, holds more."""
    import gc

    from data_pipeline.formats import FORMATS, ReadOptions
    from data_pipeline.lines import Lines

    docs = [t * 8 for t in texts if t.strip()][:480]              # ~ 0.9 MB of text in 16 groups of 30 rows
    src = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": docs, "other": [t[::-1] for t in docs]}), src, row_group_size=30,
                   compression="none")
    sizes = [len(t.encode("utf-8")) for t in docs]
    group_bytes = max(sum(sizes[i:i + 30]) for i in range(0, len(sizes), 30))
    assert pq.ParquetFile(src).metadata.num_row_groups == 16
    gc.collect()
    base = pa.total_allocated_bytes()
    whole = pq.read_table(src, columns=["text"])
    held_whole = pa.total_allocated_bytes() - base
    del whole
    assert held_whole > 8 * group_bytes                           # the meter sees a whole file
    gc.collect()
    base, peak, got = pa.total_allocated_bytes(), 0, []
    for batch in FORMATS["parquet"].records(Lines(src, CorpusStats()), ReadOptions()):
        peak = max(peak, pa.total_allocated_bytes() - base)
        got += batch
    assert got == docs
    assert 0 < peak < 4 * group_bytes, (peak, group_bytes, held_whole)


def test_parquet_is_cut_at_row_groups_for_tasks(texts, tokenizer, tmp_path):
    """--tasks: a large Parquet file is cut into byte ranges that hold whole row groups, each once and in order;
    the tasks' shards merge into the single-process set."""
    from data_pipeline import cluster
    from data_pipeline.corpus import InputRange
    from data_pipeline.formats.parquet import row_groups

    src = _parquet(tmp_path / "c.parquet", texts, row_group_size=40)
    spec = cluster.Spec((str(src),), max_docs_per_shard=100)
    tasks = cluster.plan(spec, 3)
    units = [u for t in tasks for u in t.units]
    assert len(tasks) == 3 and all(isinstance(u, InputRange) for u in units)
    meta = pq.ParquetFile(src).metadata
    groups = [g for u in units for g, _ in row_groups(meta, u.start, u.end)]
    assert groups == list(range(meta.num_row_groups)) and all(row_groups(meta, u.start, u.end) for u in units)
    assert [d.text for d in read_documents(units)] == [d.text for d in read_documents(src)]
    staging = tmp_path / "staging"
    staging.mkdir()
    cluster.copy_tokenizer(tokenizer, staging)
    for t in tasks:
        cluster.run_task(spec, t, str(staging))
    m = cluster.merge(staging, tasks)
    single, single_m, _ = _build(src, tokenizer, tmp_path / "single", max_docs_per_shard=100)
    assert documents(staging) == single and m["num_tokens"] == single_m["num_tokens"] and m["tasks"] == 3


@pytest.mark.parametrize("missing, name, says", [
    ("pyarrow", "c.parquet", r"c\.parquet: reading Parquet files needs the pyarrow package: pip install pyarrow"),
    ("pyarrow", "c.arrow", r"c\.arrow: reading Arrow files needs the pyarrow package: pip install pyarrow"),
    ("zstandard", "c.jsonl.zst", r"c\.jsonl\.zst: reading \.zst .* needs the zstandard package: pip install "
                                 r"zstandard"),
])
def test_a_missing_optional_package_is_a_usage_error_with_the_install_line(missing, name, says, tmp_path,
                                                                           monkeypatch):
    from data_pipeline.errors import UsageError

    src = tmp_path / name
    src.write_bytes(b"whatever is there is never read")
    monkeypatch.setitem(sys.modules, missing, None)                          # `import missing` fails
    with pytest.raises(UsageError, match=says + r".*roformer-dist\[data\]"):
        list(read_documents(src))
