"""How often a reader following a run's configuration from ``roformer-train`` to the first step comes back to
a module it had left.

The walk is taken, not imagined: ``roformer-train`` runs in this process as the only rank of a torchrun-style
launch (RANK=0, WORLD_SIZE=1) for one step, and every call of a function of ``roformer_dist`` or
``data_pipeline`` that is handed a config (the ``Config`` tree, one of its sections, or a stage's plan) is
recorded until the runner's first ``train_step``. Consecutive calls in one module are one visit; a *return* is
a visit to a module the walk had already left. The config package counts as one room, as ``config.py`` was
before it became a package (its validator calling its derived values is not a reader changing rooms), so the
figure compares with the same walk on an older checkout (``--root``). Prints the returns, the modules by visits, and the path.

    python bench/studies/config_walk.py --shards DIR --eval-shards DIR
    CONFIG_WALK_ROOT=../old-checkout python bench/studies/config_walk.py ...   # the same walk on another tree

It answers one question, asked twice (issues "Resolve a run once" and "The loop and its listeners"): it is quoted
in those issues' closing notes only.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(os.environ.get("CONFIG_WALK_ROOT", Path(__file__).resolve().parents[2])).resolve()
sys.path.insert(0, str(ROOT))


def _is_config(value) -> bool:
    return type(value).__module__.startswith("roformer_dist.config") and dataclasses.is_dataclass(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True)
    p.add_argument("--eval-shards", required=True)
    p.add_argument("--config", default=str(ROOT / "configs" / "experiments" / "debug.yaml"))
    p.add_argument("--without-config-package", action="store_true",
                   help="leave calls into the config package out of the walk (a reader looking a value up there)")
    a = p.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000), OMP_NUM_THREADS="2")
    rooms: list[str] = []
    done = []

    def profile(frame, event, arg):
        if done or event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if code.co_name == "train_step" and path.endswith("parallel/runner.py"):
            done.append(True)
            return
        if not path.startswith((str(ROOT / "roformer_dist"), str(ROOT / "data_pipeline"))):
            return
        values = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(_is_config(v) for v in values):
            room = str(Path(path).relative_to(ROOT))
            if room.startswith("roformer_dist/config"):
                if a.without_config_package:
                    return
                room = "roformer_dist/config"
            if not rooms or rooms[-1] != room:
                rooms.append(room)

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--config", a.config, f"data.shards={a.shards}", f"data.eval_shards={a.eval_shards}",
                f"run_dir={tmp}/run", "dist.world_size=1", "trainer.stop_at_step=1", "trainer.save_every=0",
                "trainer.eval_every=0", "data.num_workers=0"]
        command = runpy.run_module("roformer_dist.cli.train")["main"]  # the command as its console script runs it
        sys.setprofile(profile)
        try:
            command(argv)
        finally:
            sys.setprofile(None)
    seen, returns = set(), 0
    for r in rooms:
        returns += r in seen
        seen.add(r)
    visits = collections.Counter(rooms)
    print(f"config walk: {len(rooms)} visits to {len(visits)} modules, {returns} returns to a module already left")
    for room, n in visits.most_common():
        print(f"  {n:3d}  {room}")
    print("path: " + " -> ".join(Path(r).stem for r in rooms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
