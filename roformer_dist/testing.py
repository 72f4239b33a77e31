"""Helpers for tests and benches: run a function in N processes joined by a gloo process group; list
the live processes of a process group (``live_group_members``: what a launch left behind); give a fresh
extensions directory this environment's build of a DeepSpeed op (``copy_built_op``).

    run_distributed(fn, world_size=2, args=(tmp_path,))

``fn(rank, world_size, *args)`` runs in each process (forked from a server that imported torch, DeepSpeed and
the trainer once: ``roformer_dist.launch.preload``) after
``torch.distributed.init_process_group("gloo")`` on a free localhost port. Its
return values come back as a list indexed by rank. Any rank's exception fails
the call with that rank's traceback; a rank that does not finish within
``timeout`` seconds fails it too (all ranks are killed, nothing hangs). Every
rank ends with ``barrier`` + ``destroy_process_group`` so that gloo does not
abort at exit.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from roformer_dist.runtime.jit_builds import use_environment_extensions_dir
from roformer_dist.runtime.process_group import free_port

__all__ = ["run_distributed", "free_port", "DistributedTestError", "live_group_members", "copy_built_op",
           "rank_processes"]

# DeepSpeed JIT-builds ops (shm comm, CPU Adam) into TORCH_EXTENSIONS_DIR: the ranks' directory, set here
# for the ranks of in-process tests and inherited by every child
use_environment_extensions_dir()
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def copy_built_op(name: str, extensions: Path) -> None:
    """This environment's build of DeepSpeed's op ``name`` (``use_environment_extensions_dir``, with the compiler
    `c++`), when a launch made one, copied into ``extensions`` with ninja's records, over what is there (a lock
    there stays): a launch there loads the op without compiling it (ninja finds it up to date)."""
    if os.environ.get("CXX"):
        return
    built = use_environment_extensions_dir() / name
    if (built / f"{name}.so").exists() and not (built / "lock").exists():
        shutil.copytree(built, Path(extensions) / name, ignore=shutil.ignore_patterns("lock"), dirs_exist_ok=True)


def rank_processes(launcher_pid: int) -> list[int]:
    """The ranks ``roformer-train`` (pid ``launcher_pid``) forked, in rank order: its children named
    ``roformer-rank<r>`` (Linux ``/proc``; [] before they are forked)."""
    from roformer_dist.launch.spawn import RANK_NAME
    from roformer_dist.runtime.stop import children

    found = {}
    for pid in children(launcher_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(RANK_NAME):
            found[int(name[len(RANK_NAME):])] = pid
    return [found[r] for r in sorted(found)]


def live_group_members(pgid: int) -> list[str]:
    """Processes of process group ``pgid`` that are not zombies, as 'pid cmdline' (Linux ``/proc``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{stat.parent.name} {cmd[:120]}")
        except (OSError, ValueError):
            continue
    return out


class DistributedTestError(AssertionError):
    """A rank failed or timed out; the message holds its traceback."""


def _context():
    """A fork server that imported what a rank imports (``roformer_dist.launch.preload``), started once per
    process: each rank is a fork of it instead of a new interpreter that imports torch and DeepSpeed again
    (seconds a rank). With CUDA, fresh interpreters: the server must not touch CUDA, and a test on a GPU is rare."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["roformer_dist.launch.preload"])
    return ctx


def _output_of(caller: int) -> None:
    """Write stdout and stderr where the calling process writes them now (pytest's capture of the current test):
    a fork server's child would otherwise inherit the server's, from the test that started it."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # not Linux, or not a file this process may open: the server's then
        os.dup2(target, fd)
        os.close(target)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result_dir: str,
            env: dict, caller: int) -> None:
    import torch.distributed as dist

    if os.getppid() != caller:  # forked by the fork server
        _output_of(caller)
    os.environ.clear()  # the caller's environment as it is now (a fork server's is from when it started)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    out = Path(result_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        payload = ("ok", value)
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        payload = ("error", traceback.format_exc())
    try:
        out.write_bytes(pickle.dumps(payload))
    except Exception:  # the value could not be pickled: say so instead
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
    if payload[0] == "ok" and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    # A failed rank exits at once, without waiting for the others in a collective.
    os._exit(0 if payload[0] == "ok" else 1)


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout: float = 300.0,
                    env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result. ``env``: set in
    the ranks on top of this process's environment."""
    ctx = _context()
    port = free_port()
    environ = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="rdist-") as result_dir:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, result_dir, environ, os.getpid()),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed: list[str] = []
        while True:
            alive = [p for p in procs if p.is_alive()]
            for r in range(world_size):
                f = Path(result_dir) / f"rank{r}.pkl"
                if f.exists() and not procs[r].is_alive():
                    status, value = pickle.loads(f.read_bytes())
                    if status == "error" and f"rank {r}" not in " ".join(failed):
                        failed.append(f"rank {r} raised:\n{value}")
            if failed or not alive:
                break
            if time.monotonic() > deadline:
                failed.append(f"timed out after {timeout:.0f} s; ranks still running: "
                              f"{[procs.index(p) for p in alive]}")
                break
            time.sleep(0.05)
        if failed:
            time.sleep(0.5)  # let a rank that is about to report its own error do so
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            raise DistributedTestError("\n".join(failed))
        results = []
        for r, p in enumerate(procs):
            p.join()
            f = Path(result_dir) / f"rank{r}.pkl"
            if not f.exists():
                raise DistributedTestError(f"rank {r} exited with code {p.exitcode} without a result")
            status, value = pickle.loads(f.read_bytes())
            results.append(value)
        return results
