"""``model.rotary_backend: auto`` by measurement: candidates, timing within the budget, the choice, its cache."""

from __future__ import annotations

import functools
import json
import logging
import time

import pytest
import torch

from roformer_dist.nn import rotary as R
from roformer_dist.nn import rotary_tune as T

TINY = (2, 16, 2, 8)  # (B, S, H, D)
LOGGER = "roformer_dist.nn.rotary_tune"


def row(backend, ms, error=None):
    return T.Timing(backend, None if error else ms, 0 if error else 5, 0.1, error)


def table_measure(table, calls=None):
    """A measure_fn stand-in returning fixed rows (ms per backend, or an error string) for the names asked."""
    def fn(backends, shape, dtype, device, *, rotary_value, compiled):
        if calls is not None:
            calls.append((tuple(backends), tuple(shape), dtype, rotary_value, compiled))
        return [row(b, table[b], None) if isinstance(table[b], float) else row(b, None, table[b]) for b in backends]
    return fn


def never_measure(*args, **kwargs):
    raise AssertionError("measured, but should not have been")


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# --------------------------------------------------------------------------- candidates


def test_cpu_candidates(monkeypatch):
    assert T.candidates("cpu", compiled=False) == ["reference"]
    assert T.candidates("cpu", compiled=True) == ["reference", "compiled"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a test device, never a candidate
    monkeypatch.setattr(R, "triton_available", lambda: True)
    assert "triton" not in T.candidates("cpu", compiled=True)


def test_cuda_candidates_follow_availability(monkeypatch):
    names = T.candidates("cuda", compiled=False)
    assert names[:2] == ["reference", "compiled"]
    assert ("triton" in names) == R.triton_available()
    assert ("flash_attn" in names) == R.flash_attn_available()
    assert "apex" not in names
    for triton in (False, True):
        for flash in (False, True):
            monkeypatch.setattr(R, "triton_available", lambda t=triton: t)
            monkeypatch.setattr(R, "flash_attn_available", lambda f=flash: f)
            monkeypatch.setattr(R, "apex_available", lambda: True)
            expected = ["reference", "compiled"] + ["triton"] * triton + ["flash_attn"] * flash
            assert T.candidates("cuda", compiled=True) == expected


# --------------------------------------------------------------------------- measure


def test_measure_rotates_views_of_one_projection_buffer(monkeypatch):
    """q, k (and v alone) are (B, S, H, D) views of one (B, S, 3, H, D) buffer that requires grad, the
    way attention rotates them; backward runs; the global RNG is not touched."""
    seen = []

    def recording(x1, x2, cos, sin):
        seen.append((x1, x2, cos))
        return R._reference_pair(x1, x2, cos, sin)

    monkeypatch.setitem(R._KERNELS, "reference", recording)
    B, S, H, D = TINY
    rng = torch.get_rng_state()
    rows = T.measure(["reference"], TINY, torch.bfloat16, "cpu", rotary_value=True, compiled=False, budget_s=0.05)
    assert torch.equal(torch.get_rng_state(), rng)
    assert rows[0].ok and rows[0].repeats >= 1
    v, _, _ = seen[0]
    q, k, cos = seen[1]
    assert seen[0][1] is None  # v alone, then q and k together, as attention does
    for x in (q, k, v):
        assert x.shape == (B, S, H, D) and x.dtype == torch.bfloat16 and x.requires_grad
        assert x.stride() == (S * 3 * H * D, 3 * H * D, D, 1)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    torch.testing.assert_close(cos, R.rotary_tables(S, D)[0])
    assert len(seen) == 2 * (T.WARMUP_CALLS + rows[0].repeats)


def test_measure_shares_the_budget(monkeypatch):
    """Timed rounds stop before the budget runs out (warm-up aside), with at least 3 repeats each."""
    def slow(x1, x2, cos, sin):
        time.sleep(0.01)
        return R._reference_pair(x1, x2, cos, sin)

    monkeypatch.setitem(R._KERNELS, "compiled", slow)
    budget = 0.25
    start = time.perf_counter()
    rows = T.measure(["reference", "compiled"], TINY, torch.float32, "cpu", rotary_value=False, compiled=False,
                     budget_s=budget)
    timed = time.perf_counter() - start - sum(r.warmup_s for r in rows)
    assert [r.backend for r in rows] == ["reference", "compiled"]
    assert all(r.ok and r.median_ms > 0 for r in rows)
    assert rows[1].median_ms >= 10
    assert 3 <= rows[1].repeats < T.MAX_REPEATS and rows[0].repeats == rows[1].repeats
    assert rows[1].warmup_s >= T.WARMUP_CALLS * 0.01
    assert timed <= budget + 0.1


def test_failing_candidates_are_dropped_with_their_reason(monkeypatch, no_interpreter):
    calls = {"n": 0}

    def broken(x1, x2, cos, sin):
        raise RuntimeError("kernel exploded\nsecond line")

    def fails_later(x1, x2, cos, sin):  # survives the warm-up, fails while timed
        calls["n"] += 1
        if calls["n"] > T.WARMUP_CALLS + 1:
            raise RuntimeError("out of luck")
        return R._reference_pair(x1, x2, cos, sin)

    monkeypatch.setitem(R._KERNELS, "compiled", broken)
    monkeypatch.setitem(R._KERNELS, "flash_attn", fails_later)
    monkeypatch.setattr(R, "triton_available", lambda: True)
    monkeypatch.setattr(R, "flash_attn_available", lambda: True)
    R._resolve.cache_clear()
    try:
        rows = T.measure(["reference", "compiled", "triton", "flash_attn"], TINY, torch.float32, "cpu",
                         rotary_value=False, compiled=False, budget_s=0.1)
    finally:
        R._resolve.cache_clear()
    by = {r.backend: r for r in rows}
    assert by["reference"].ok and by["reference"].median_ms > 0
    assert by["compiled"].error == "RuntimeError: kernel exploded" and by["compiled"].median_ms is None
    assert "triton runs on CUDA devices" in by["triton"].error
    assert by["flash_attn"].error == "RuntimeError: out of luck" and by["flash_attn"].median_ms is None
    table = T.format_table(rows)
    assert "dropped: RuntimeError: kernel exploded" in table and "second line" not in table

    monkeypatch.setattr(T, "candidates", lambda device_type, compiled: ["reference", "compiled"])
    choice = T.RotaryChoices().choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=False,
                                      measure_fn=functools.partial(T.measure, budget_s=0.05))
    assert choice.backend == "reference" and choice.measured
    assert [r.ok for r in choice.rows] == [True, False]


def test_no_working_candidate_falls_back_to_reference(caplog):
    measure_fn = table_measure({"reference": "RuntimeError: no", "compiled": "RuntimeError: nor this"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        choice = T.RotaryChoices().choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                                          measure_fn=measure_fn)
    assert choice.backend == "reference" and choice.measured
    assert "no candidate ran" in caplog.text and "nor this" in caplog.text


def test_table_and_json():
    rows = [row("reference", 2.0), row("compiled", 1.0), row("triton", None, "ImportError: no triton")]
    table = T.format_table(rows).splitlines()
    assert table[0].split()[:2] == ["backend", "fwd+bwd"]
    assert "2.00x" in table[1] and "1.00x" in table[2] and "dropped: ImportError: no triton" in table[3]
    data = json.loads(json.dumps(T.timings_to_json(rows)))
    assert [T.Timing.from_json(d) for d in data] == rows
    assert T.format_table([row("triton", None, "E: x")]).splitlines()[1].startswith("triton")


def test_each_compile_has_its_own_dynamo_cache():
    """The closure measured for every candidate and key shares one code object; compiled as is, the
    ninth variant would hit dynamo's recompile limit, a hard error under fullgraph."""
    def closure(scale):
        def f(x):
            return x * scale
        return f

    x = torch.ones(2)
    for scale in range(torch._dynamo.config.recompile_limit + 2):
        f = torch.compile(T._fresh_function(closure(float(scale))), fullgraph=True, dynamic=False, backend="eager")
        assert f(x).tolist() == [scale, scale]


# --------------------------------------------------------------------------- choose


@pytest.mark.parametrize("table,expected", [
    ({"reference": 3.0, "compiled": 1.0, "triton": 2.0, "flash_attn": 4.0}, "compiled"),
    ({"reference": 1.5, "compiled": 2.0, "triton": 1.0, "flash_attn": 4.0}, "triton"),
    ({"reference": 2.0, "compiled": "RuntimeError: compile", "triton": 3.0, "flash_attn": 1.9}, "flash_attn"),
])
def test_choose_picks_the_fastest_of_the_table(monkeypatch, table, expected):
    monkeypatch.setattr(T, "candidates", lambda device_type, compiled: list(table))
    calls = []
    choice = T.RotaryChoices().choose("auto", TINY, torch.bfloat16, "cpu", rotary_value=True, compiled=True,
                                      measure_fn=table_measure(table, calls))
    assert choice.backend == expected and choice.measured
    assert [r.backend for r in choice.rows] == list(table)
    assert calls == [(tuple(table), TINY, torch.bfloat16, True, True)]
    assert choice.key == T.ChoiceKey("cpu", TINY, "bfloat16", True, True, str(torch.__version__))
    json.dumps(choice.key)


@pytest.mark.filterwarnings("ignore:Dynamo detected")
def test_choose_by_a_real_measurement_of_compiled_candidates():
    """The one test that compiles: each CPU candidate wrapped in torch.compile (2 tiny compiles)."""
    spans = []

    def timed_measure(*args, **kwargs):
        start = time.perf_counter()
        rows = T.measure(*args, **kwargs, budget_s=0.2)
        spans.append(time.perf_counter() - start - sum(r.warmup_s for r in rows))
        return rows

    choice = T.RotaryChoices().choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                                      measure_fn=timed_measure)
    assert choice.measured and [r.backend for r in choice.rows] == ["reference", "compiled"]
    assert all(r.ok and r.median_ms > 0 and r.repeats >= 3 and r.warmup_s > 0 for r in choice.rows), \
        T.format_table(choice.rows)
    assert choice.backend == min(choice.rows, key=lambda r: r.median_ms).backend
    assert spans[0] <= 0.2 + 0.1


def test_eager_cpu_auto_takes_reference_without_measuring():
    choice = T.RotaryChoices().choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=False,
                                      measure_fn=never_measure)
    assert choice.backend == "reference" and choice.rows == () and not choice.measured


def test_explicit_backends_are_never_measured(monkeypatch, no_interpreter):
    choices = T.RotaryChoices()
    for backend in ("reference", "compiled", "apex", "flash_attn"):
        monkeypatch.setattr(R, "apex_available", lambda: True)
        monkeypatch.setattr(R, "flash_attn_available", lambda: True)
        R._resolve.cache_clear()
        choice = choices.choose(backend, TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                                measure_fn=never_measure)
        assert choice.backend == backend and not choice.measured and choice.rows == ()
    R._resolve.cache_clear()
    assert len(choices) == 0
    monkeypatch.setattr(R, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="triton runs on CUDA devices"):  # rotary's own errors
        choices.choose("triton", TINY, torch.float32, "cpu", rotary_value=False, compiled=False,
                       measure_fn=never_measure)
    with pytest.raises(ValueError, match="expected one of"):
        choices.choose("fastest", TINY, torch.float32, "cpu", rotary_value=False, compiled=False,
                       measure_fn=never_measure)


# --------------------------------------------------------------------------- the cache


def test_a_key_is_measured_once_and_any_change_measures_again():
    calls = []
    measure_fn = table_measure({"reference": 2.0, "compiled": 1.0}, calls)
    choices = T.RotaryChoices()

    def choose(shape=TINY, dtype=torch.float32, rotary_value=False, compiled=True):
        return choices.choose("auto", shape, dtype, "cpu", rotary_value=rotary_value, compiled=compiled,
                              measure_fn=measure_fn)

    first = choose()
    again = choose()
    assert first.measured and not again.measured and len(calls) == 1
    assert (again.backend, again.rows, again.key) == (first.backend, first.rows, first.key)
    assert choose(shape=(2, 32, 2, 8)).measured
    assert choose(dtype=torch.bfloat16).measured
    assert choose(rotary_value=True).measured
    assert len(calls) == 4 and len(choices) == 4
    assert not choose(compiled=False).measured  # eager CPU: reference, nothing to measure
    assert len(calls) == 4


def test_choices_survive_a_save_and_load(tmp_path):
    path = tmp_path / "rotary_backend.json"
    choices = T.RotaryChoices()
    measure_fn = table_measure({"reference": 2.0, "compiled": 1.0})
    made = [choices.choose("auto", shape, torch.bfloat16, "cpu", rotary_value=False, compiled=True,
                           measure_fn=measure_fn) for shape in (TINY, (4, 64, 2, 8))]
    choices.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["rotary_backend.json"]  # no temporary left behind
    loaded = T.RotaryChoices.load(path)
    assert loaded.state_dict() == choices.state_dict()
    for choice in made:
        again = loaded.choose("auto", choice.key.shape, torch.bfloat16, "cpu", rotary_value=False, compiled=True,
                              measure_fn=never_measure)
        assert (again.backend, again.rows, again.key, again.measured) == (
            choice.backend, choice.rows, choice.key, False)
    assert len(T.RotaryChoices.load(tmp_path / "missing.json")) == 0


@pytest.mark.parametrize("text", [
    "{not json", "", "[]", '{"format": 99, "choices": []}', '{"format": 1, "choices": [{"key": {}}]}',
    '{"format": 1, "choices": [{"key": {"device": "cpu", "shape": [2, 16, 2], "dtype": "float32", '
    '"rotary_value": false, "compiled": true, "torch": "x"}, "backend": "compiled", "rows": []}]}',
])
def test_a_damaged_file_is_ignored_with_a_warning(tmp_path, caplog, text):
    path = tmp_path / "rotary_backend.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        choices = T.RotaryChoices.load(path)
    assert len(choices) == 0 and "damaged" in caplog.text and str(path) in caplog.text
    calls = []
    choice = choices.choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                            measure_fn=table_measure({"reference": 1.0, "compiled": 2.0}, calls))
    assert choice.measured and choice.backend == "reference" and len(calls) == 1


def test_a_cached_backend_no_longer_a_candidate_is_measured_again(monkeypatch):
    monkeypatch.setattr(T, "candidates", lambda device_type, compiled: ["reference", "compiled", "flash_attn"])
    choices = T.RotaryChoices()
    table = {"reference": 2.0, "compiled": 3.0, "flash_attn": 1.0}
    assert choices.choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                          measure_fn=table_measure(table)).backend == "flash_attn"
    monkeypatch.setattr(T, "candidates", lambda device_type, compiled: ["reference", "compiled"])
    choice = choices.choose("auto", TINY, torch.float32, "cpu", rotary_value=False, compiled=True,
                            measure_fn=table_measure(table))
    assert choice.measured and choice.backend == "reference"


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:Dynamo detected")
def test_cuda_candidates_at_the_base_shape():
    """Every CUDA candidate runs eagerly at the base preset's shape in bf16; the choice is the fastest."""
    names = T.candidates("cuda", compiled=False)
    rows = T.measure(names, (64, 512, 12, 64), torch.bfloat16, "cuda", rotary_value=False, compiled=False)
    print("\n" + T.format_table(rows))
    assert [r.backend for r in rows] == names
    assert all(r.ok and r.median_ms > 0 and r.repeats >= 3 for r in rows), T.format_table(rows)
    choice = T.RotaryChoices().choose("auto", (64, 512, 12, 64), torch.bfloat16, "cuda", rotary_value=False,
                                      compiled=False, measure_fn=lambda *a, **k: rows)
    assert choice.backend == min(rows, key=lambda r: r.median_ms).backend
    assert choice.key.device == torch.cuda.get_device_name()
