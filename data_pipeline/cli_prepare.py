"""``roformer-data prepare``: the tokenizer and one shard set, or, with ``--source NAME=INPUT``, a corpus
mixture: one tokenizer trained on a sample of all sources (:func:`weighted_interleave`) and one shard set per
source, staged together; the ``data.sources`` block for the trainer's config is printed at the end.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional

from .cli_commands import build, given_tokenizer, run_cluster, train
from .errors import EXIT_OK, DataError, UsageError
from .mixture import SOURCE_NAME
from .options import DataOptions

__all__ = ["cmd_prepare", "weighted_interleave", "sources_yaml", "TOKENIZER_FILES"]


def cmd_prepare(o: DataOptions) -> int:
    """``prepare``: a tokenizer (trained, or the given ``--tokenizer``) and the shard set of ``--input``, here
    or over ``--tasks``; or a mixture (``--source``)."""
    from .corpus import check_inputs
    from .imported import SENTENCEPIECE
    from .shards import stage_output

    given = given_tokenizer(o)
    vocab_size = o.training.vocab_size
    if given is None and vocab_size is None:
        raise UsageError("prepare: --vocab-size is required to train the tokenizer (or give an existing one "
                         "with --tokenizer)")
    if given is not None and vocab_size is not None:
        raise UsageError(f"--vocab-size {vocab_size} with --tokenizer {o.tokenizer}: the vocabulary is "
                         "the given tokenizer's; leave --vocab-size out")
    sources = _sources(o)
    if sources is not None:
        return _prepare_mixture(o, sources, given)
    if o.tokenizer_weights is not None:
        raise UsageError(f"--tokenizer-weights {o.tokenizer_weights}: weights are for a mixture; give the "
                         "corpora as --source NAME=INPUT")
    tokenizer, kind = given or (None, SENTENCEPIECE)
    if o.cluster.tasks:
        return run_cluster(o, tokenizer, kind)
    with stage_output(o.out, o.force) as stage:   # fails now if --out exists or cannot be written
        check_inputs(o.corpus.inputs)             # and if an input cannot be read
        if tokenizer is None:
            build(o, train(o, stage.path / "tokenizer"), kind, stage.path, warn_corpus=False)
        else:
            build(o, tokenizer, kind, stage.path)
        stage.commit()
    return EXIT_OK


# --------------------------------------------------------------------------- prepare --source (a mixture)


def _sources(o: DataOptions) -> Optional[dict[str, list[str]]]:
    """The ``--source NAME=INPUT`` flags as {name: [inputs]} in the order first given (a name given again
    adds inputs); None with ``--input``. UsageError: both or neither given, a malformed value or bad name,
    a cluster option."""
    if o.sources and o.corpus.inputs:
        raise UsageError("--input and --source: give one or the other (--input: one shard set; --source "
                         "NAME=INPUT, repeated: a mixture of several sets sharing one tokenizer)")
    if not o.sources:
        if not o.corpus.inputs:
            raise UsageError("prepare: give the corpus as --input FILES (one shard set) or as --source NAME=INPUT, "
                             "repeated (a mixture)")
        return None
    sources: dict[str, list[str]] = {}
    for value in o.sources:
        name, sep, inputs = value.partition("=")
        if not sep or not inputs:
            raise UsageError(f"--source {value}: expected NAME=INPUT (a file, directory or glob)")
        if not SOURCE_NAME.fullmatch(name):
            raise UsageError(f"--source {value}: the name {name!r} may hold only letters, digits, '_' and '-' "
                             "(it becomes a directory name and a metric tag)")
        sources.setdefault(name, []).append(inputs)
    if o.cluster.tasks is not None or o.cluster.cluster is not None:
        raise UsageError("--source with --tasks/--cluster/--slurm: a mixture is not prepared over tasks; run "
                         "`roformer-data tokenizer` once (on a sample of all sources), then `roformer-data shards "
                         "--tokenizer MODEL` per source (each may use --tasks)")
    return sources


def _tokenizer_weights(text: Optional[str], names: Iterable[str]) -> Optional[dict[str, float]]:
    """``--tokenizer-weights NAME=W,...`` as {name: weight}, one positive number for every source; None
    when not given. UsageError naming the bad item."""
    if text is None:
        return None
    names = list(names)
    weights: dict[str, float] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise UsageError(f"--tokenizer-weights: expected NAME=WEIGHT, got {item!r}")
        if name not in names:
            raise UsageError(f"--tokenizer-weights: {name!r} is not a --source (the sources: {', '.join(names)})")
        if name in weights:
            raise UsageError(f"--tokenizer-weights: {name!r} is given twice")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise UsageError(f"--tokenizer-weights: {item!r}: the weight must be a positive number, got {value!r}")
        weights[name] = weight
    missing = [n for n in names if n not in weights]
    if missing:
        raise UsageError(f"--tokenizer-weights {text}: no weight for {', '.join(missing)}; give one for every "
                         "--source (or leave the flag out: shares by size)")
    return weights


def weighted_interleave(sources: Mapping[str, Iterable[str]], weights: Optional[Mapping[str, float]] = None,
                        counts: Optional[dict] = None) -> Iterator[str]:
    """The texts of several sources as one stream whose share of *characters* from each source follows
    ``weights`` (the tokenizer's training text of a mixture).

    ``weights`` None: the sources one after another, whole (each source's share is its size, as
    concatenating them would give). Otherwise smooth weighted round-robin by characters: the next text
    comes from the source furthest below its share (the smallest characters-taken / weight; the first
    given on a tie), and the stream ends as soon as a source runs out, so that every source's share of
    the characters holds to within one text; sources not read to their end contribute their first
    texts. Deterministic, no random numbers. ``counts`` (a dict) receives ``name -> [texts,
    characters]`` taken. DataError when a weighted source has no text at all. The sources' iterators
    are closed at the end.
    """
    counts = {} if counts is None else counts
    its = {name: iter(texts) for name, texts in sources.items()}
    for name in its:
        counts[name] = [0, 0]
    try:
        if weights is None:
            for name, it in its.items():
                for text in it:
                    counts[name][0] += 1
                    counts[name][1] += len(text)
                    yield text
            return
        while True:
            name = min(its, key=lambda n: counts[n][1] / weights[n])
            text = next(its[name], None)
            if text is None:
                if counts[name][0] == 0:
                    raise DataError(f"source {name!r}: no text (every document was empty or invalid)")
                return
            counts[name][0] += 1
            counts[name][1] += len(text)
            yield text
    finally:
        for it in its.values():
            close = getattr(it, "close", None)
            if close is not None:
                close()


def _mixture_texts(o: DataOptions, sources: Mapping[str, list[str]], weights, counts: dict):
    """(stats, texts): the tokenizer's training text of a mixture (:func:`weighted_interleave`)."""
    from .corpus import CorpusStats, read_documents

    stats, c = CorpusStats(), o.corpus
    streams = {name: (d.text for d in read_documents(inputs, c.fmt, c.read, stats)) for name, inputs in sources.items()}
    return stats, weighted_interleave(streams, weights, counts)


def _sample_line(counts: Mapping[str, list], weights) -> str:
    """One line on what the tokenizer was trained on, per source."""
    total = max(sum(c for _, c in counts.values()), 1)
    parts = [f"{name} {docs} documents, {chars:,} characters ({100 * chars / total:.1f}%)"
             for name, (docs, chars) in counts.items()]
    how = ("by size" if weights is None else
           "weights " + ", ".join(f"{n}={w:g}" for n, w in weights.items()))
    return f"tokenizer sample ({how}): {'; '.join(parts)}"


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.vocab", "tokenizer.json", "vocab.txt")
"""What a mixture holds besides its shard sets: a trained SentencePiece model (and its .vocab), or the given
tokenizer under its kind's name (:data:`.imported.KINDS`)."""


def _is_mixture(out: Path) -> bool:
    """Whether ``out`` holds a mixture as ``prepare --source`` writes it: the tokenizer files and shard-set
    directories, nothing else."""
    from .imported import KINDS
    from .shards import MANIFEST

    if not any((out / name).is_file() for name in KINDS.values()):
        return False
    entries = [e for e in out.iterdir() if e.name not in TOKENIZER_FILES]
    return bool(entries) and all(e.is_dir() and (e / MANIFEST).is_file() for e in entries)


def _yaml_scalar(text: str) -> str:
    """``text`` as a YAML flow scalar: plain where it reads back as that string, else double-quoted."""
    import json

    plain = re.fullmatch(r"[A-Za-z_./][A-Za-z0-9_./-]*", text) and text.lower() not in (
        "true", "false", "yes", "no", "on", "off", "null", "y", "n", "~")
    return text if plain else json.dumps(text, ensure_ascii=False)


def sources_yaml(out, names: Iterable[str]) -> str:
    """The ``data.sources`` block for the trainer's config naming the sets ``out/NAME``."""
    lines = ["data:", "  sources:"]
    lines += [f"    - {{name: {_yaml_scalar(n)}, shards: {_yaml_scalar(str(Path(out) / n))}}}" for n in names]
    return "\n".join(lines)


def _prepare_mixture(o: DataOptions, sources: dict[str, list[str]], given: Optional[tuple[Path, str]]) -> int:
    """``prepare --source``: one tokenizer trained on a sample of all sources (or ``given``: the file and kind
    of ``--tokenizer``, copied), then one shard set per source, all staged together and moved into ``--out``
    when every set is complete."""
    from .cluster import copy_tokenizer
    from .corpus import check_inputs
    from .imported import SENTENCEPIECE
    from .shards import stage_output

    if given is not None and o.tokenizer_weights is not None:
        raise UsageError(f"--tokenizer-weights {o.tokenizer_weights} with --tokenizer {o.tokenizer}: the "
                         "weights shape the sample a tokenizer is trained on, and the given one is not trained")
    weights = _tokenizer_weights(o.tokenizer_weights, sources)
    counts: dict = {}
    # fails now if --out holds anything but a shard set or a mixture, or cannot be written
    with stage_output(o.out, o.force, replaceable=(_is_mixture, "a mixture")) as stage:
        for inputs in sources.values():
            check_inputs(inputs)                            # and if an input cannot be read
        if given is None:
            stats, texts = _mixture_texts(o, sources, weights, counts)
            model, kind = train(o, stage.path / "tokenizer", texts, stats, warn=weights is None), SENTENCEPIECE
            print(_sample_line(counts, weights))
        else:
            model, kind = copy_tokenizer(given[0], stage.path, given[1]), given[1]
        for name, inputs in sources.items():
            (stage.path / name).mkdir()
            build(o, model, kind, stage.path / name, warn_corpus=weights is not None or given is not None,
                  inputs=inputs, out=Path(o.out) / name)
        stage.commit()
    print(f"mixture: {o.out}: {len(sources)} shard sets ({', '.join(sources)}) sharing {o.out}/{model.name}")
    print("for the trainer's config below; the training mixture is yours to weigh: add `weight: W` to each "
          "source for its share of the training tokens (--tokenizer-weights shaped only the tokenizer's sample)")
    print(sources_yaml(o.out, sources))
    return EXIT_OK
