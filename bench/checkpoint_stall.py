"""How long a checkpoint holds the step loop: ``checkpoint.async: true`` against the synchronous save.

Both are the same ``roformer-train`` job on 2 ranks (--ranks; ZeRO-2, fp32, People's Daily shards, seq 128, global
batch 16), run alternately (--rounds, sync first in odd rounds, async first in even ones), saving every
--save-every steps into a run directory on this machine's disk. Per save (the saves of the last step,
which the end of the run waits for, are left out):

    held       ``perf/checkpoint_stall_s`` (TensorBoard): the seconds the loop spent in the save call,
               i.e. the whole save (sync) or the wait for the previous save plus the snapshot (async)
    excess     the interval from the save step's end to the next step's end, minus the median interval
               between steps that had no save: what the save cost the job, including (async) the
               background writer competing with the next steps for the cores

Each mode runs twice, with content hashes (``checkpoint.checksums``, the default) and without them, to
measure what hashing costs a save.

Medians over every save of every round. The model (--model-args) is bigger than the demo's so that a
checkpoint weighs something: hidden 512, 8 layers, vocabulary 8000 (~29 M parameters: ~350 MB of model,
fp32 master weights and Adam moments per checkpoint).

    python bench/checkpoint_stall.py              # ~4 min on 2 cores
    python bench/checkpoint_stall.py --tiny       # the tiny model on tiny shards: 1 rank, 4 steps: the whole path in ~25 s

Ends with one JSON line {"bench": "checkpoint_stall", "ours": held s (async), "baseline": held s (sync),
"ratio": sync / async, "excess": {...}, "hash_cost": {"sync": held with / without hashes - 1, "async": ...},
"checkpoint_mb": ...}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import _common as C

REPO = C.REPO


def parse(argv=None) -> argparse.Namespace:
    p = C.parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model-args", default="model=small,model.hidden_size=512,model.num_hidden_layers=8,"
                                           "model.num_attention_heads=8,model.intermediate_size=2048")
    p.add_argument("--dir", type=Path, default=REPO / "data" / "bench" / "checkpoint_stall",
                   help="run directories (on the disk whose saves are measured) and the shard set")
    C.tiny_defaults(p, argv, rounds=1, steps=4, save_every=2, ranks=1, model_args="model=tiny", dir=C.tiny_dir)
    return p.parse_args(argv)


def shards(a) -> Path:
    if a.tiny:
        return C.tiny_shards(a.dir / "shards")[0]
    return C.peoples_daily_shards(REPO / "data" / "bench" / "pd_8000")


def run(a, mode: str, data: Path, round_: int) -> dict:
    run_dir = a.dir / f"run_{mode}_{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    over = [*a.model_args.split(","), f"data.shards={data}", "data.eval_shards=", f"run_dir={run_dir}", f"dist.world_size={a.ranks}",
            "data.packing=cross_document", "optim.warmup_steps=0", f"trainer.save_every={a.save_every}",
            "trainer.eval_every=0", "trainer.log_every=1", "checkpoint.keep_last=2",
            f"checkpoint.async={mode.startswith('async')}", f"checkpoint.checksums={not mode.endswith(NO_HASH)}",
            f"curriculum.stages=[{{name: s, seq_len: 128, global_batch_size: 16, steps: {a.steps}}}]"]
    C.train_quietly(C.DEBUG_CONFIG, over, mode)
    from roformer_dist.runtime.events import read_scalars

    held = {s: v for s, v in read_scalars(run_dir / "tb")["perf/checkpoint_stall_s"]}
    times = [json.loads(x)["time"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [s for s in sorted(held) if s < a.steps]  # the last step's save is waited for by the end
    intervals = {s + 1: times[s] - times[s - 1] for s in range(1, len(times))}  # step -> its interval
    plain = statistics.median(v for s, v in intervals.items() if s - 1 not in held and s > 2)
    ckpt = run_dir / "checkpoints" / f"step_{a.steps:08d}"
    mb = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file()) / 2**20
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"held": [held[s] for s in saves], "excess": [intervals[s + 1] - plain for s in saves],
            "step_s": plain, "checkpoint_mb": mb}


NO_HASH = ", no hashes"
MODES = ("sync", "async", "sync" + NO_HASH, "async" + NO_HASH)


def main(argv=None) -> None:
    a = parse(argv)
    data = shards(a)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # each round starts with another mode
            print(f"round {r + 1}/{a.rounds}: {mode}", flush=True)
            results[mode].append(run(a, mode, data, r))
    med = {m: {k: statistics.median(x for res in rs for x in res[k]) for k in ("held", "excess")}
           | {"step_s": statistics.median(res["step_s"] for res in rs)} for m, rs in results.items()}
    mb = results["sync"][0]["checkpoint_mb"]
    print(f"\ncheckpoint: {mb:.0f} MB; {a.rounds} rounds, saves every {a.save_every} steps of {a.steps} "
          f"(load average {C.load_average()})")
    C.print_table(["save", "held s (median)", "excess s (median)", "step s without a save"],
                  [[m, f"{med[m]['held']:.3f}", f"{med[m]['excess']:.3f}", f"{med[m]['step_s']:.3f}"]
                   for m in MODES])
    ratio = med["sync"]["held"] / med["async"]["held"] if med["async"]["held"] > 0 else float("inf")
    print(f"the loop is held {ratio:.1f}x less with checkpoint.async")
    cost = {m: med[m]["held"] / med[m + NO_HASH]["held"] - 1 for m in ("sync", "async")}
    print(f"content hashes add {cost['sync']:+.1%} to a synchronous save's hold and {cost['async']:+.1%} to an "
          f"asynchronous one's (excess per save: {med['async']['excess'] - med['async' + NO_HASH]['excess']:+.3f} s)")
    C.emit("checkpoint_stall", med["async"]["held"], med["sync"]["held"], "s", ratio,
           excess={m: round(med[m]["excess"], 4) for m in med}, hash_cost={m: round(c, 4) for m, c in cost.items()},
           checkpoint_mb=round(mb, 1))


if __name__ == "__main__":
    main()
