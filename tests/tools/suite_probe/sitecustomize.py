"""The suite profiler's probe in every Python process of a test run (``tests/tools/suite_profile.py``).

Imported at interpreter start-up as ``sitecustomize`` when this folder is first on PYTHONPATH and
ROFORMER_PROBE_LOG names a file. It appends one JSON line per process at exit: the pytest test that was
running (PYTEST_CURRENT_TEST, inherited by every child), the process's command, when the kernel started it
and the seconds from then to the moments a rank passes on its way to its first step: torch imported,
deepspeed imported, the process group up, the DeepSpeed engine built, the first training step begun. A
process that never reaches one leaves it out. Nothing is written where ROFORMER_PROBE_LOG is unset.
"""

import os

_LOG = os.environ.get("ROFORMER_PROBE_LOG")


def _install() -> None:
    import atexit
    import importlib.abc
    import importlib.machinery
    import json
    import sys
    import time

    def process_start() -> float:
        """The Unix time the kernel started this process (/proc), else now."""
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
            return boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, StopIteration):
            return time.time()

    start = process_start()
    marks: dict = {}
    record = {"pid": os.getpid(), "ppid": os.getppid(), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
              "start": start, "marks": marks}

    def mark(name: str) -> None:
        marks.setdefault(name, round(time.time() - record["start"], 3))

    def wrap(owner, attr: str, before=None, after=None) -> None:
        real = getattr(owner, attr, None)
        if real is None or getattr(real, "_probed", False):
            return

        def probed(*args, **kwargs):
            if before:
                mark(before)
            out = real(*args, **kwargs)
            if after:
                mark(after)
            return out
        probed._probed = True
        setattr(owner, attr, probed)

    def torch_loaded(module) -> None:
        mark("torch")
        import torch.distributed as dist
        wrap(dist, "init_process_group", after="process_group")

    def deepspeed_loaded(module) -> None:
        mark("deepspeed")
        wrap(module, "initialize", after="engine")

    def trainer_loaded(module) -> None:
        wrap(module.Trainer, "train_step", before="first_step")

    hooks = {"torch": torch_loaded, "deepspeed": deepspeed_loaded, "roformer_dist.loop.trainer": trainer_loaded}

    class After(importlib.abc.MetaPathFinder):
        """Runs a hook once a watched module has been executed."""

        def find_spec(self, name, path=None, target=None):
            if name not in hooks:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return None
            real_exec = spec.loader.exec_module
            hook = hooks.pop(name)

            def exec_module(module):
                real_exec(module)
                try:
                    hook(module)
                except Exception:  # noqa: BLE001 - a probe never breaks the process it watches
                    pass
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, After())

    def forked() -> None:
        """A forked child (a DataLoader worker, a fork server's rank) is a process of its own from its fork on."""
        marks.clear()
        record.update(pid=os.getpid(), ppid=os.getppid(), test=os.environ.get("PYTEST_CURRENT_TEST", ""),
                      start=time.time(), forked=True, end=None)

    os.register_at_fork(after_in_child=forked)

    def write() -> None:
        if record.get("end") is not None:
            return  # written already
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        record["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
        record["argv"] = " ".join(sys.argv)[:300]
        record["end"] = round(time.time() - record["start"], 3)
        try:
            with open(_LOG, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass

    atexit.register(write)
    # ranks often leave through os._exit (no atexit): write then too
    real_exit = os._exit

    def _exit(code):
        write()
        real_exit(code)
    os._exit = _exit


if _LOG:
    try:
        _install()
    except Exception:  # noqa: BLE001
        pass
