"""``model.rotary_backend: auto`` by measurement: time each candidate backend, keep the fastest.

Which rotary backend is fastest depends on the device, the shape, the dtype and on whether the model
is compiled: on one H200 at the base preset (B 64, S 512, H 12, D 64, bf16) a whole training step ran
461k tokens/s with triton, 545k with reference and 609k with compiled, while triton is the fastest in
isolation at B 8. A fixed preference cannot know; a short measurement of the step's own rotary work can.

What is measured (:func:`measure`), per candidate: forward and backward of rotating q and k (and v with
``rotary_value``) of shape (B, S, H, D) at positions 0..S-1 the way the attention layer does it: the
backend resolved once by ``rotary.model_kernel``, then ``rotary.run_kernel``; q, k, v are views of one
(B, S, 3, H, D) projection buffer that requires grad, v is rotated alone, q and k together; the
gradient flows back into the buffer. With ``compiled`` (the trainer compiles the model) the forward
is wrapped in ``torch.compile(fullgraph=True, dynamic=False)`` per candidate, so each candidate is
timed the way it will run.

Budget: each candidate is first called :data:`WARMUP_CALLS` times (compiles, Triton JIT, lazy
initialisation), which is not counted in the budget but reported (``warmup_s``); then the candidates
are called in turn, round after round, until the next round would overrun ``budget_s`` (1 s by
default: the timing part costs at most ~1 s per key) or :data:`MAX_REPEATS` rounds are done. At least
one round always runs; three or more when they fit. The median of a candidate's repeats is its time.
On CUDA each repeat is timed with CUDA events and synchronized. Random inputs come from a private
generator: the global RNG (and so a seeded run's data order and dropout) is not touched.

Candidates (:func:`candidates`):
    CUDA  reference, compiled, triton (if installed), flash_attn (if installed). apex is never a
          candidate: the model permutes its projection weights for it (``rotary.HALF_LAYOUT``) when it
          is built, before anything is measured; it stays explicit-only (``measure(["apex"], ...)``
          times its kernel all the same).
    CPU   reference; compiled too when the model is compiled (then every candidate is compiled and the
          compile cost is paid anyway). In an eager CPU run the compiled backend costs a ~10 s compile
          per process and sequence length while rotary is ~2 % of a CPU step, so it is no candidate
          there (choose ``compiled`` explicitly for long CPU runs). Triton on CPU runs only under its
          interpreter (``TRITON_INTERPRET=1``), a test device, never a candidate.
A candidate that raises (not installed, fails to compile, a CUDA error) is dropped with its reason in
the table; if none works, ``reference`` is chosen and the reasons are logged.

:class:`RotaryChoices` remembers the choice per key (device name, shape, dtype, rotary_value, compiled,
torch version) and saves it as a small JSON file, so a resumed run reuses it instead of measuring
again. An explicitly named backend is never measured or overridden.

Several ranks measure independently and may choose differently by noise; a caller that needs one
choice for all ranks measures on one and hands the name to the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch

from data_pipeline.atomic import atomic_write_text
from roformer_dist.nn import rotary

log = logging.getLogger(__name__)

WARMUP_CALLS = 2
"""Untimed calls per candidate before timing: the first compiles, the second finishes lazy set-up."""
MAX_REPEATS = 50
"""Timed rounds at most: enough for a stable median; tiny shapes stop here long before the budget."""
STATE_FORMAT = 1
"""Version of :meth:`RotaryChoices.state_dict`; a file of another version is ignored (measured again)."""

Shape = tuple[int, int, int, int]
"""(B, S, H, D): batch, sequence, heads, head_dim of q (and k, v)."""


# --------------------------------------------------------------------------- candidates


def candidates(device_type: str, *, compiled: bool) -> list[str]:
    """The backends that ``auto`` measures on a device of type ``device_type`` ("cuda", "cpu", ...).

    ``compiled``: the model is compiled (``trainer.compile``). Availability comes from
    ``rotary.triton_available`` / ``rotary.flash_attn_available``, so the CUDA list can be computed
    (and tested) on a machine without a GPU. See the module docstring for why apex and, in eager CPU
    runs, compiled are left out."""
    if device_type == "cuda":
        names = ["reference", "compiled"]
        if rotary.triton_available():
            names.append("triton")
        if rotary.flash_attn_available():
            names.append("flash_attn")
        return names
    return ["reference", "compiled"] if compiled else ["reference"]


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Timing:
    """One row of a measurement: ``median_ms`` of ``repeats`` timed calls (forward + backward), after
    ``warmup_s`` seconds of warm-up; or ``error`` (why the candidate was dropped) and no median."""

    backend: str
    median_ms: Optional[float]
    repeats: int
    warmup_s: float
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Timing":
        row = cls(backend=str(data["backend"]),
                  median_ms=None if data["median_ms"] is None else float(data["median_ms"]),
                  repeats=int(data["repeats"]), warmup_s=float(data["warmup_s"]),
                  error=None if data.get("error") is None else str(data["error"]))
        if (row.median_ms is None) == row.ok:
            raise ValueError(f"rotary timing row {data!r}: exactly one of median_ms and error must be set")
        return row


def timings_to_json(rows: Sequence[Timing]) -> list[dict[str, Any]]:
    """The rows as JSON-able data (for a metrics file or the run's log)."""
    return [row.to_json() for row in rows]


def format_table(rows: Sequence[Timing]) -> str:
    """The rows as an aligned text table for the log, with each one's time relative to the fastest."""
    fastest = min((r.median_ms for r in rows if r.ok), default=None)
    lines = [("backend", "fwd+bwd ms", "vs fastest", "repeats", "warm-up s", "note")]
    for r in rows:
        if r.ok:
            lines.append((r.backend, f"{r.median_ms:.3f}", f"{r.median_ms / fastest:.2f}x", str(r.repeats),
                          f"{r.warmup_s:.2f}", ""))
        else:
            lines.append((r.backend, "-", "-", str(r.repeats), f"{r.warmup_s:.2f}", f"dropped: {r.error}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in lines).rstrip()


def _reason(e: BaseException) -> str:
    """A one-line reason for the table: the type and the first line of the message, shortened."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _fresh_function(fn: Callable) -> Callable:
    """``fn`` with its own code object. Dynamo keeps its compiled graphs (and counts recompiles against
    ``recompile_limit``, a hard error under ``fullgraph``) per code object; the closures built for every
    candidate and key share one, so after a few keys compiling a candidate would fail. A fresh code
    object gives each compile its own cache."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def _rotation(kernel: str, rotary_value: bool) -> Callable:
    """(qkv (B, S, 3, H, D), cos, sin) -> the rotated tensors, as the attention layer rotates them: v
    alone (with ``rotary_value``), then q and k together, through ``rotary.run_kernel``."""
    def rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = qkv.unbind(2)  # (B, S, H, D) views of one buffer
        rotated = (rotary.run_kernel(kernel, v, None, cos, sin)[0],) if rotary_value else ()
        return rotated + rotary.run_kernel(kernel, q, k, cos, sin)
    return rotate


class _Clock:
    """Seconds one call takes on ``device``: CUDA events on a GPU (synchronized after each call, so
    the budget's wall clock stays honest), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _check_shape(shape: Sequence[int]) -> Shape:
    shape = tuple(int(n) for n in shape)
    if len(shape) != 4 or min(shape) < 1 or shape[3] % 2:
        raise ValueError(f"rotary tuning: shape must be (B, S, H, D) with positive sizes and D even, got {shape}")
    return shape  # type: ignore[return-value]


def measure(backends: Sequence[str], shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, *,
            rotary_value: bool, compiled: bool, budget_s: float = 1.0) -> list[Timing]:
    """Time forward + backward of each backend in ``backends`` at ``shape`` (B, S, H, D) and ``dtype`` on
    ``device``; one :class:`Timing` per backend, in the order given (see the module docstring for what is
    timed and how ``budget_s`` is shared). A backend that raises gets a row with its ``error``."""
    B, S, H, D = _check_shape(shape)
    device = torch.device(device)
    clock = _Clock(device)
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, S, 3, H, D, generator=generator).to(device=device, dtype=dtype).requires_grad_(True)
    cos, sin = rotary.RotaryCache(D, S).get(S, device)
    num_out = 3 if rotary_value else 2
    grads = tuple(torch.randn(B, S, H, D, generator=generator).to(device=device, dtype=dtype)
                  for _ in range(num_out))

    def step_for(backend: str) -> Callable[[], Any]:
        # resolved once, outside the timed (and compiled) call, as the model does
        rotate = _rotation(rotary.model_kernel(backend, device), rotary_value)
        if compiled:
            rotate = torch.compile(_fresh_function(rotate), fullgraph=True, dynamic=False)

        def step():
            return torch.autograd.grad(rotate(qkv, cos, sin), (qkv,), grads)
        return step

    steps: dict[str, Callable[[], Any]] = {}
    warmup: dict[str, float] = {}
    errors: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device, torch.enable_grad():
        for backend in backends:
            start = time.perf_counter()
            try:
                steps[backend] = step_for(backend)
                for _ in range(WARMUP_CALLS):
                    steps[backend]()
                clock.sync()
            except Exception as e:  # noqa: BLE001  any failure drops the candidate, with its reason
                steps.pop(backend, None)
                errors[backend] = _reason(e)
            warmup[backend] = time.perf_counter() - start
            times[backend] = []

        start = time.perf_counter()
        for rounds in range(MAX_REPEATS):
            if not steps:
                break
            if rounds:  # the next round, estimated from the medians so far, must fit in the budget
                estimate = sum(statistics.median(times[b]) for b in steps)
                if time.perf_counter() - start + estimate > budget_s:
                    break
            for backend in list(steps):
                try:
                    times[backend].append(clock.time(steps[backend]))
                except Exception as e:  # noqa: BLE001  (as in the warm-up)
                    del steps[backend]
                    errors[backend] = _reason(e)

    rows = []
    for backend in backends:
        if backend in errors:
            rows.append(Timing(backend, None, 0, warmup[backend], errors[backend]))
        else:
            rows.append(Timing(backend, statistics.median(times[backend]) * 1e3, len(times[backend]),
                               warmup[backend]))
    return rows


class MeasureFn(Protocol):
    """What :meth:`RotaryChoices.choose` calls to time candidates; :func:`measure`, or a stand-in in tests."""

    def __call__(self, backends: Sequence[str], shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, *, rotary_value: bool, compiled: bool) -> list[Timing]: ...


# --------------------------------------------------------------------------- choices and their cache


class ChoiceKey(NamedTuple):
    """What a measurement depends on; JSON-serialisable (``json.dumps`` gives a list, :meth:`to_json` a
    dict)."""

    device: str
    """``torch.cuda.get_device_name`` on CUDA, else the device type ("cpu")."""
    shape: Shape
    """(B, S, H, D)."""
    dtype: str
    """e.g. "bfloat16"."""
    rotary_value: bool
    compiled: bool
    torch: str
    """``torch.__version__``: a new torch (and its inductor, its triton) measures again."""

    @classmethod
    def of(cls, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, *, rotary_value: bool,
           compiled: bool) -> "ChoiceKey":
        device = torch.device(device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return cls(name, _check_shape(shape), str(dtype).removeprefix("torch."), bool(rotary_value),
                   bool(compiled), str(torch.__version__))

    def to_json(self) -> dict[str, Any]:
        return {**self._asdict(), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ChoiceKey":
        if set(data) != set(cls._fields):
            raise ValueError(f"rotary choice key: expected the fields {', '.join(cls._fields)}, got {sorted(data)}")
        flags = (data["rotary_value"], data["compiled"])
        if not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"rotary choice key: rotary_value and compiled must be booleans, got {flags}")
        return cls(str(data["device"]), _check_shape(data["shape"]), str(data["dtype"]), *flags, str(data["torch"]))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend to use for ``key``; ``rows``: the measurement it came from (empty for an explicit
    backend or a single candidate); ``measured``: measured by this call (False when explicit or reused)."""

    backend: str
    rows: tuple[Timing, ...]
    key: ChoiceKey
    measured: bool


def _fastest(rows: Sequence[Timing]) -> Optional[str]:
    working = [r for r in rows if r.ok]
    return min(working, key=lambda r: r.median_ms).backend if working else None


class RotaryChoices:
    """Rotary backend choices per :class:`ChoiceKey`: measured at a key's first use, reused after, and
    saved to / loaded from a small JSON file (the trainer keeps it as ``run_dir/rotary_backend.json``)
    so a resumed run does not measure again."""

    def __init__(self) -> None:
        self._choices: dict[ChoiceKey, tuple[str, tuple[Timing, ...]]] = {}

    def __len__(self) -> int:
        return len(self._choices)

    def choose(self, backend_setting: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
               *, rotary_value: bool, compiled: bool, measure_fn: MeasureFn = measure) -> Choice:
        """The backend for ``model.rotary_backend = backend_setting`` at this shape, dtype and device.

        Any setting but "auto" is validated (``rotary.resolve_backend``: the same errors as before) and
        returned as is, never measured. "auto": the cached choice for the key, or the fastest of
        :func:`candidates` by ``measure_fn`` (a single candidate is taken without measuring)."""
        rotary.resolve_backend(backend_setting, device)  # first: a bad setting fails as it always did
        key = ChoiceKey.of(shape, dtype, device, rotary_value=rotary_value, compiled=compiled)
        if backend_setting != "auto":
            return Choice(backend_setting, (), key, measured=False)
        names = candidates(torch.device(device).type, compiled=compiled)
        cached = self._choices.get(key)
        if cached is not None and cached[0] in names:  # a backend uninstalled since is measured again
            return Choice(cached[0], cached[1], key, measured=False)
        if len(names) == 1:
            self._choices[key] = (names[0], ())
            return Choice(names[0], (), key, measured=False)
        rows = tuple(measure_fn(names, key.shape, dtype, device, rotary_value=rotary_value, compiled=compiled))
        backend = _fastest(rows)
        if backend is None:
            backend = "reference"
            log.warning("rotary_backend auto: no candidate ran at %s; using reference. Reasons:\n%s",
                        key.to_json(), format_table(rows))
        else:
            log.info("rotary_backend auto at %s: %s\n%s", key.to_json(), backend, format_table(rows))
        self._choices[key] = (backend, rows)
        return Choice(backend, rows, key, measured=True)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"format": 1, "choices": [{"key": {...}, "backend": ..., "rows": [...]}, ...]}``."""
        return {"format": STATE_FORMAT,
                "choices": [{"key": key.to_json(), "backend": backend, "rows": timings_to_json(rows)}
                            for key, (backend, rows) in self._choices.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the choices with ``state`` (from :meth:`state_dict`); ValueError if it is not one."""
        try:
            if state["format"] != STATE_FORMAT:
                raise ValueError(f"format {state['format']!r}, expected {STATE_FORMAT}")
            choices = {}
            for entry in state["choices"]:
                rows = tuple(Timing.from_json(r) for r in entry["rows"])
                backend = entry["backend"]
                if not isinstance(backend, str):
                    raise ValueError(f"backend {backend!r} is not a name")
                choices[ChoiceKey.from_json(entry["key"])] = (backend, rows)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a rotary backend state: {_reason(e)}") from e
        self._choices = choices

    def save(self, path: str | Path) -> None:
        """Write the choices to ``path`` atomically (a reader sees the old file or the new one)."""
        atomic_write_text(path, json.dumps(self.state_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RotaryChoices":
        """The choices saved at ``path``; empty when there is no file, and when the file cannot be read
        or parsed (logged as a warning: the keys are measured again, which is never fatal)."""
        choices = cls()
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return choices
        except (OSError, UnicodeDecodeError) as e:
            log.warning("rotary backend choices %s unreadable (%s); measuring again", path, _reason(e))
            return choices
        try:
            choices.load_state_dict(json.loads(text))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            log.warning("rotary backend choices %s damaged (%s); measuring again", path, _reason(e))
        return choices


__all__ = [
    "WARMUP_CALLS", "MAX_REPEATS", "candidates", "measure", "Timing", "timings_to_json", "format_table",
    "MeasureFn", "ChoiceKey", "Choice", "RotaryChoices",
]
