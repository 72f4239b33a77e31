"""Corpus mixtures (data_pipeline/mixture.py, roformer_dist/plan/mixture.py): token shares over every
window, exact and elastic resume per source, changed weights, the repetition cap, the plan, and the
errors. Loader tests use shard sets whose token ids are unique and disjoint per source, so a row's
source and every document's reading are read off the tokens themselves, independently of the
loader's own provenance."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.errors import DataError
from data_pipeline.loader import ShardLoader
from data_pipeline.masking import IGNORE_INDEX
from data_pipeline.mixture import WINDOW_TOLERANCE_ROWS, Mixer, as_sources, shares
from data_pipeline.shards import write_shard_set

SPAN = 15000          # source k's ids lie in [5 + k * SPAN, 5 + (k + 1) * SPAN)
NAMES = ("a", "b", "c")


def _set(path, k: int, num_docs: int, seed: int):
    rng = np.random.default_rng(seed)
    docs, nxt = [], 5 + k * SPAN
    for _ in range(num_docs):
        n = int(rng.integers(5, 60))
        docs.append(np.arange(nxt, nxt + n))
        nxt += n
    assert nxt < 5 + (k + 1) * SPAN
    write_shard_set(docs, path, vocab_size=60000, max_docs_per_shard=40)
    return np.concatenate(docs)


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for k, (name, docs) in enumerate(zip(NAMES, (300, 200, 120))):
        out[name] = (root / name, _set(root / name, k, docs, seed=k))
    return out


def _sources(sets, names=NAMES, **caps):
    return [(n, str(sets[n][0]), caps.get(n)) for n in names]


def _original(batch) -> np.ndarray:
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    return np.where(labels != IGNORE_INDEX, labels, ids)


def _row_source(row: np.ndarray) -> int:
    content = row[row > 4]
    ks = set(((content - 5) // SPAN).tolist())
    assert len(ks) == 1, f"a row mixes sources {ks}"
    return ks.pop()


def _take(loader, n):
    out, infos = [], []
    for batch in loader:
        out.append(batch)
        infos.append(loader.last)
        if len(out) == n:
            break
    return out, infos


def _same(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x[k].numpy(), y[k].numpy()) for k in x) for x, y in zip(a, b))


KW = dict(seq_len=64, micro_batch_size=4, seed=3)
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def test_token_shares_hold_over_every_window_and_rows_interleave(sets):
    """(a) 0.5/0.3/0.2 of the tokens in every window of 200 rows, measured from the tokens; the
    loader's provenance says the same; sources share micro-batches; a source's epoch ends and it
    starts the next one (each is read about twice) without disturbing the others."""
    ld = ShardLoader(_sources(sets), num_workers=0, weights=WEIGHTS, **KW)
    batches, infos = _take(ld, 160)
    rows, toks = [], []
    for batch, info in zip(batches, infos):
        ids = _original(batch)
        ks = [_row_source(r) for r in ids]
        assert tuple(NAMES[k] for k in ks) == info.sources
        rows += ks
        toks += np.count_nonzero(batch["attention_mask"].numpy(), axis=1).tolist()
    rows, toks = np.array(rows), np.array(toks, np.float64)
    assert sum(len(set(i.sources)) > 1 for i in infos) > len(infos) // 2       # interleaved, not concatenated
    window = 200
    tol = WINDOW_TOLERANCE_ROWS * len(NAMES) / window
    worst = 0.0
    for start in range(0, len(rows) - window + 1):
        t, r = toks[start:start + window], rows[start:start + window]
        for k, name in enumerate(NAMES):
            worst = max(worst, abs(t[r == k].sum() / t.sum() - WEIGHTS[name]))
    assert worst <= tol, (worst, tol)
    epochs = {n: ld.state_dict()["sources"][n]["slots"]["0"]["epoch"] for n in NAMES}
    assert min(epochs.values()) >= 1, epochs                                   # every source began a new epoch
    per = ld.stats["sources"]
    assert sum(p["tokens"] for p in per.values()) == ld.stats["tokens"] == int(toks.sum())


def test_exact_resume_gives_the_same_batches(sets):
    """(b) at the same layout (2 workers), from a state taken mid-stream."""
    kw = dict(num_workers=2, weights=WEIGHTS, **KW)
    full, _ = _take(ShardLoader(_sources(sets), **kw), 40)
    ld = ShardLoader(_sources(sets), **kw)
    _take(ld, 17)
    resumed = ShardLoader(_sources(sets), **kw)
    resumed.load_state_dict(ld.state_dict())
    rest, _ = _take(resumed, 23)
    assert _same(rest, full[17:])


def test_elastic_resume_reads_every_document_of_each_source_once_per_epoch(sets):
    """(c) 2 ranks stopped mid-epoch, resumed on 3: each source's tokens are read exactly once (one
    epoch each; a source that ends leaves the others to share its part)."""
    kw = dict(num_workers=0, weights=WEIGHTS, max_epochs=1, **KW)
    old = [ShardLoader(_sources(sets), dp_rank=r, dp_size=2, **kw) for r in range(2)]
    seen = [b for ld in old for b in _take(ld, 12)[0]]
    states = [ld.state_dict() for ld in old]
    for r in range(3):
        ld = ShardLoader(_sources(sets), dp_rank=r, dp_size=3, **kw)
        ld.load_state_dict(states)
        seen += list(ld)
    ids = np.concatenate([_original(b).ravel() for b in seen])
    ids = ids[ids > 4]
    for k, name in enumerate(NAMES):
        mine = np.sort(ids[(ids - 5) // SPAN == k])
        assert np.array_equal(mine, sets[name][1]), name


def test_changed_weights_hold_from_the_change_on(sets):
    """(d) set_stage(weights=...) (a curriculum stage, or a resumed run with other weights): the new
    shares hold from the next batch, each source continuing where it was."""
    ld = ShardLoader(_sources(sets), num_workers=0, weights=WEIGHTS, **KW)
    _take(ld, 10)
    before = {n: s["slots"]["0"] for n, s in ld.state_dict()["sources"].items()}
    ld.set_stage(64, 4, weights={"a": 0, "b": 1, "c": 1})
    batches, infos = _take(ld, 50)
    tokens = {n: sum(i.source_tokens[n] for i in infos) for n in NAMES}
    assert tokens["a"] == 0
    assert abs(tokens["b"] / (tokens["b"] + tokens["c"]) - 0.5) < WINDOW_TOLERANCE_ROWS * 3 / 200
    after = {n: s["slots"]["0"] for n, s in ld.state_dict()["sources"].items()}
    assert after["a"] == before["a"]                                          # paused, not lost
    # a resumed loader given the new weights continues exactly the same
    again = ShardLoader(_sources(sets), num_workers=0, weights=WEIGHTS, **KW)
    _take(again, 10)
    state = again.state_dict()
    resumed = ShardLoader(_sources(sets), num_workers=0, weights={"a": 0, "b": 1, "c": 1}, **KW)
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 50)[0], batches)


def test_a_source_at_its_cap_stops_and_the_others_go_on(sets):
    """(e) the loader's hard stop: source c (max_epochs 1) is read once, then a and b share the rows."""
    ld = ShardLoader(_sources(sets, c=1), num_workers=0, weights=WEIGHTS, **KW)
    batches, infos = _take(ld, 200)
    ids = np.concatenate([_original(b).ravel() for b in batches])
    c_ids = ids[(ids > 4) & ((ids - 5) // SPAN == 2)]
    assert np.array_equal(np.sort(c_ids), sets["c"][1])                     # exactly one epoch of c
    late = infos[-30:]
    assert all(i.source_tokens["c"] == 0 for i in late)
    a, b = (sum(i.source_tokens[n] for i in late) for n in "ab")
    assert abs(a / (a + b) - 0.5 / 0.8) < 0.05


def test_plan_caps_a_source_and_renormalises_the_others(sets):
    from roformer_dist.config import load_config
    from roformer_dist.errors import ConfigError
    from roformer_dist.plan.data import source_manifests
    from roformer_dist.plan.mixture import plan_mixture
    from trainer_runs import DEBUG

    def plan(*over, cap=True):
        srcs = ", ".join(f"{{name: {n}, shards: '{sets[n][0]}', weight: {w}{', max_epochs: 1' if cap and n == 'c' else ''}}}"
                         for n, w in WEIGHTS.items())
        cfg = load_config(DEBUG, ["data.shards=", f"data.sources=[{srcs}]", "data.eval_shards=", *over])
        return plan_mixture(cfg, source_manifests(cfg))

    p = plan()   # 18 steps: 30.7 k tokens; c (4.1 k tokens) would draw about 1.5 epochs
    by = {s.name: s for s in p.sources}
    assert by["c"].capped and abs(by["c"].epochs - 1.0) < 1e-6
    for i in range(3):
        sh = p.stage_weights(i)
        assert abs(sum(sh.values()) - 1) < 1e-9
        assert abs(sh["a"] / sh["b"] - 0.5 / 0.3) < 1e-9                        # the others keep their ratio
    assert not by["a"].capped and by["a"].shares[0] > 0.5
    assert "capped at max_epochs 1" in p.warnings()[0] and "capped (max_epochs 1)" in p.table()
    assert abs(sum(s.draws for s in p.sources) - sum(p.budgets)) < 1e-6 * sum(p.budgets)
    # size smoothing: each weight times tokens^alpha
    p = plan("data.size_alpha=0.5", cap=False)
    raw = {s.name: WEIGHTS[s.name] * s.tokens ** 0.5 for s in p.sources}
    assert all(abs(p.stage_weights(0)[n] - raw[n] / sum(raw.values())) < 1e-9 for n in NAMES)
    with pytest.raises(ConfigError, match="more than the max_epochs caps"):
        plan_mixture(*(lambda c: (c, source_manifests(c)))(load_config(DEBUG, [
            "data.shards=", "data.eval_shards=",
            f"data.sources=[{{name: c, shards: '{sets['c'][0]}', weight: 1, max_epochs: 1}}]"])))


def test_mixer_and_shares_units():
    assert shares({"x": 2, "y": 6}, ["x", "y"]) == {"x": 0.25, "y": 0.75}
    assert shares(None, ["x", "y"], default={"x": 1, "y": 3}) == {"x": 0.25, "y": 0.75}
    m = Mixer([0.0, 0.0], [0.75, 0.25])
    picks = []
    for _ in range(8):
        k = m.pick()
        m.charge(k, 10)
        picks.append(k)
    assert picks.count(0) == 6 and abs(sum(m.credits)) < 1e-9
    m.deactivate(0)
    assert m.pick() == 1
    m.deactivate(1)
    assert m.pick() == -1
    for bad, msg in (({"x": -1}, "x: expected a finite number >= 0"), ({"x": 0, "y": 0}, "positive sum"),
                     ({"z": 1}, "unknown source 'z'"), ({"x": "many"}, "x: expected a number")):
        with pytest.raises(ValueError, match=msg):
            shares(bad, ["x", "y"])
    for bad, msg in (([("a b", "/d")], "name 'a b'"), ([("a", "/d"), ("a", "/e")], "given twice"), ([], "at least one")):
        with pytest.raises(ValueError, match=msg):
            as_sources(bad)


def test_state_of_a_plain_set_resumes_as_its_source_in_a_mixture(sets):
    """A format-2 state (one shard set) is read as the source with that shard set; a saved source the
    mixture lacks is refused, naming it."""
    one = ShardLoader(str(sets["a"][0]), num_workers=0, **KW)
    _take(one, 5)
    state = one.state_dict()
    old = {"format": 2, "seed": state["seed"], "shard_set": state["sources"]["main"]["shard_set"],
           "dp_size": 1, "slots_per_rank": 1, "slots": state["sources"]["main"]["slots"], "next_local": {"0": 0},
           "stats": {k: v for k, v in state["stats"].items() if k != "sources"}}
    mixed = ShardLoader(_sources(sets, ("a", "b")), num_workers=0, weights={"a": 1, "b": 0}, seed=3, seq_len=64,
                        micro_batch_size=4)
    mixed.load_state_dict(old)
    assert mixed.state_dict()["sources"]["a"]["slots"] == state["sources"]["main"]["slots"]
    with pytest.raises(DataError, match="reads source 'b', which this loader lacks"):
        ShardLoader(_sources(sets, ("a",)), num_workers=0, **KW).load_state_dict(mixed.state_dict())
    with pytest.raises(DataError, match="field 'shard_set': source 'a'"):
        ShardLoader([("a", str(sets["b"][0]))], num_workers=0, **KW).load_state_dict(
            {**mixed.state_dict(), "sources": {"a": mixed.state_dict()["sources"]["a"]}})


# --------------------------------------------------------------------------- the trainer on a mixture


@pytest.fixture(scope="module")
def reviews_sets(tmp_path_factory, small_shards, reviews):
    """Two review sets (train, held out) made with the People's Daily tokenizer of ``small_shards``."""
    from data_pipeline.shards import build_shards

    root = tmp_path_factory.mktemp("reviews")
    lines = reviews[0].read_text(encoding="utf-8").splitlines()
    (root / "train.txt").write_text("\n".join(lines[:800]) + "\n", encoding="utf-8")
    (root / "eval.txt").write_text("\n".join(lines[800:1000]) + "\n", encoding="utf-8")
    for part in ("train", "eval"):
        build_shards(root / f"{part}.txt", small_shards.tokenizer, root / part, workers=1, max_docs_per_shard=200,
                     progress=False)
    return root / "train", root / "eval"


def _mixture_cfg(small_shards, reviews_sets, run_dir, news=0.7, rev=0.3, *over):
    from trainer_runs import make_cfg

    sources = (f"[{{name: news, shards: '{small_shards.dir}', weight: {news}}}, "
               f"{{name: reviews, shards: '{reviews_sets[0]}', weight: {rev}}}]")
    evals = f"[{{name: news, shards: '{small_shards.eval_dir}'}}, {{name: reviews, shards: '{reviews_sets[1]}'}}]"
    return make_cfg(small_shards, run_dir, "data.shards=", f"data.sources={sources}", f"data.eval_sources={evals}",
                    "trainer.log_every=1", *over)


def _source_tokens(run_dir, step):
    from trainer_runs import records

    return next(r["sources"] for r in records(run_dir) if r["step"] == step)


def test_trainer_on_a_mixture_resumes_exactly_logs_shares_and_evaluates_per_source(small_shards, reviews_sets,
                                                                                  tmp_path, capsys):
    """(b) stop at step 4 and resume = the uninterrupted loss trace; the plan table, per-source shares
    (metrics.jsonl, TensorBoard) and per-source eval; (d) a resume with other weights logs the change and
    draws the new shares from the resume step on."""
    import shutil

    from roformer_dist.runtime.events import read_scalars
    from roformer_dist.runtime.stop import EXIT_DONE
    from trainer_runs import assert_traces_equal, trace, train

    ref = tmp_path / "ref"
    assert train(_mixture_cfg(small_shards, reviews_sets, ref, 0.7, 0.3, "trainer.stop_at_step=8")) == [EXIT_DONE] * 2
    part = tmp_path / "part"
    assert train(_mixture_cfg(small_shards, reviews_sets, part, 0.7, 0.3, "trainer.stop_at_step=4")) == [EXIT_DONE] * 2
    changed = shutil.copytree(part, tmp_path / "changed")
    assert train(_mixture_cfg(small_shards, reviews_sets, part, 0.7, 0.3, "trainer.stop_at_step=8")) == [EXIT_DONE] * 2
    assert_traces_equal(trace(part), trace(ref), tol=1e-6)

    log = (ref / "logs" / "rank0.log").read_text()
    assert "corpus mixture: 2 sources" in log and "news" in log and "reviews" in log
    tb = read_scalars(ref / "tb")
    for name in ("news", "reviews"):
        assert f"data/{name}/share" in tb and f"data/{name}/tokens" in tb
        assert f"eval_{name}/loss_128" in tb and f"eval_{name}/unigram_loss_128" in tb
    assert tb["eval_news/loss_128"][-1][1] != tb["eval_reviews/loss_128"][-1][1]
    total = _source_tokens(ref, 8)
    news = total["news"]["tokens"] / (total["news"]["tokens"] + total["reviews"]["tokens"])
    assert abs(news - 0.7) < 0.05, total

    # the checkpoint reads two sources: a config without one of them is refused before any rank starts
    from roformer_dist.cli.train import main
    from trainer_runs import DEBUG

    code = main(["--config", str(DEBUG), "data.shards=", f"data.eval_shards={small_shards.eval_dir}", f"run_dir={changed}",
                 f"data.sources=[{{name: news, shards: '{small_shards.dir}', weight: 1}}]", "dist.world_size=2"])
    assert code != 0 and "reads source 'reviews', which this config lacks" in capsys.readouterr().err
    assert train(_mixture_cfg(small_shards, reviews_sets, changed, 0.2, 0.8, "trainer.stop_at_step=8")) == [EXIT_DONE] * 2
    log = (changed / "logs" / "rank0.log").read_text()
    assert "resuming with a changed setting: data.sources.news.weight: 0.7 in the checkpoint, 0.2 now" in log
    a, b = _source_tokens(changed, 4), _source_tokens(changed, 8)
    drawn = {n: b[n]["tokens"] - a[n]["tokens"] for n in ("news", "reviews")}
    assert abs(drawn["reviews"] / sum(drawn.values()) - 0.8) < 0.1, drawn


def test_bad_mixtures_exit_with_a_message_naming_the_key(small_shards, reviews_sets, sets, tmp_path, capsys):
    """(f) each bad input: one message naming the key, and its exit status (2 config, 4 data)."""
    from roformer_dist.cli.train import main
    from trainer_runs import DEBUG

    def run(sources, *over):
        code = main(["--config", str(DEBUG), "data.shards=", "data.eval_shards=", f"run_dir={tmp_path / 'run'}",
                     f"data.sources={sources}", *over])
        return code, capsys.readouterr().err

    news = f"{{name: news, shards: '{small_shards.dir}', weight: 1}}"
    cases = [
        (f"[{news}, {{name: rev, shards: '{reviews_sets[0]}', weight: -1}}]", 2, "data.sources[1].weight: expected a finite number >= 0"),
        (f"[{{name: news, shards: '{small_shards.dir}', weight: 0}}, {{name: rev, shards: '{reviews_sets[0]}', weight: 0}}]",
         2, "data.sources: the weights sum to 0"),
        (f"[{news}, {{name: rev, shards: '{reviews_sets[0]}'}}]", 2, "data.sources[1].weight: source 'rev' has no weight"),
        (f"[{news}, {{name: rev, shards: '{tmp_path / 'missing'}', weight: 1}}]", 4, "data.sources[1] (rev)"),
        (f"[{news}, {{name: other, shards: '{sets['a'][0]}', weight: 1}}]", 4,
         "data.sources[1] (other): "),
        (f"[{news}, {{name: news, shards: '{reviews_sets[0]}', weight: 1}}]", 2, "data.sources[1].name: 'news' is given twice"),
        (f"[{{name: 'a b', shards: '{small_shards.dir}', weight: 1}}]", 2, "data.sources[0].name: expected letters"),
    ]
    for sources, status, message in cases:
        code, err = run(sources)
        assert code == status and message in err and "Traceback" not in err, (sources, code, err)
    code, err = run(f"[{{name: news, shards: '{small_shards.dir}', weight: 1, max_epochs: 0.01}}]")
    assert code == 2 and "more than the max_epochs caps of its sources allow" in err, err
    (tmp_path / "empty").mkdir()
    code, err = run(f"[{news}, {{name: empty, shards: '{tmp_path / 'empty'}', weight: 1}}]")
    assert code == 4 and "data.sources[1] (empty)" in err and "manifest.json" in err, err
    # both forms at once; a stage naming an unknown source
    code = main(["--config", str(DEBUG), f"data.shards={small_shards.dir}", f"data.sources=[{news}]",
                 f"run_dir={tmp_path / 'run'}"])
    assert code == 2 and "give data.shards (one shard set) or data.sources" in capsys.readouterr().err
    stages = tmp_path / "stages.yaml"
    stages.write_text("stages:\n  - {name: s, seq_len: 128, global_batch_size: 8, steps: 2, weights: {books: 1}}\n")
    code, err = run(f"[{news}]", f"curriculum={stages}")
    assert code == 2 and "curriculum.stages[0].weights.books: no source 'books' (the sources are news)" in err, err


def test_the_launcher_makes_every_source_path_absolute_and_checks_each(small_shards, reviews_sets, tmp_path,
                                                                       monkeypatch):
    from launcher.profiles import JobFlags, check_data, resolve
    from roformer_dist.errors import ConfigError
    from trainer_runs import DEBUG

    monkeypatch.chdir(small_shards.dir.parent)
    rel = small_shards.dir.name
    over = ["data.shards=", "data.eval_shards=", f"data.sources=[{{name: news, shards: {rel}, weight: 1}}, "
            f"{{name: reviews, shards: '{reviews_sets[0]}', weight: 1}}]",
            f"data.eval_sources=[{{name: news, shards: {small_shards.eval_dir.name}}}]"]
    cfg = resolve(str(DEBUG), over, JobFlags())
    assert cfg.data.sources[0].shards == str(small_shards.dir) and cfg.data.sources[1].shards == str(reviews_sets[0])
    assert cfg.data.eval_sources[0].shards == str(small_shards.eval_dir)
    check_data(cfg)
    bad = resolve(str(DEBUG), over[:2] + [f"data.sources=[{{name: news, shards: {rel}, weight: 1}}, "
                                          f"{{name: gone, shards: '{tmp_path}', weight: 1}}]"], JobFlags())
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(gone\): .* is not a shard set"):
        check_data(bad)
