"""The Hugging Face side of ``bench/e2e.py``: MLM pretraining of ``transformers.RoFormerForMaskedLM`` with
the HF ``Trainer``, written the way its users write it, and launched the way they launch it:

    torchrun --nproc_per_node 2 bench/hf_trainer_mlm.py --data DIR --model MODEL_DIR --seq 128 \
        --micro-batch 16 --steps 24 [--deepspeed ZERO2.json] --out times.json
    python bench/hf_trainer_mlm.py --tiny     # builds tiny inputs, runs the above on 2 ranks, prints --out

Nothing of roformer-dist is imported here (``--tiny`` aside: it builds its inputs with ``bench/e2e.py``'s
own code at e2e's tiny sizes, in a temporary directory, then starts this script under torchrun without
``--tiny``). Needs ``accelerate`` besides ``transformers`` (the Trainer's dependency; both in the ``bench``
extra). The inputs are
files that ``bench/e2e.py`` writes:

    DIR/packed_<seq>.npy      int64 [N, seq]: the shard set's documents packed by our loader into
                              ``[CLS] ... [SEP]`` sequences of ``seq`` tokens (unmasked; 0 = [PAD])
    DIR/tokenizer/            the same SentencePiece vocabulary as an HF fast tokenizer (its special
                              ids: [PAD] 0, [MASK] etc. as in the shards), for the collator
    MODEL_DIR/config.json     ``RoFormerConfig`` of the ``small`` preset (hidden 256, 4 layers, 4 heads,
                              FFN 1024, vocabulary 8000, dropout 0.1 / 0.1), eager attention (the only
                              one HF's RoFormer has); freshly initialised weights

The configuration (every value the comparison depends on):

- data: an in-memory dataset of the packed sequences (what ``datasets`` + ``group_texts`` give an HF
  user), shuffled by the Trainer's ``DistributedSampler``; ``DataCollatorForLanguageModeling(mlm=True,
  mlm_probability=0.15)`` with its 80 % [MASK] / 10 % random / 10 % kept; ``dataloader_num_workers=0``
  (the default).
- ``TrainingArguments``: ``use_cpu=True``, ``ddp_backend="gloo"`` (without ``--deepspeed``),
  ``per_device_train_batch_size`` = ``--micro-batch``, ``gradient_accumulation_steps`` =
  ``--accumulation``, ``max_steps`` = ``--steps``, ``learning_rate`` / ``warmup_steps`` /
  ``lr_scheduler_type="linear"``, ``weight_decay=0.01`` (HF leaves biases and LayerNorm out, as we do),
  ``adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6``, ``max_grad_norm=1.0``, ``optim`` left at its
  default (``adamw_torch_fused``: torch AdamW, fused kernel), ``save_strategy="no"``,
  ``eval_strategy="no"``, ``logging_steps=10`` (console), ``report_to="none"``, ``disable_tqdm=True``,
  ``seed`` = ``--seed`` (default 1234), ``dataloader_drop_last=True``; everything else at its default.
- seed: ``transformers.set_seed(--seed)`` before the model is built (as HF's ``run_mlm.py`` does), so that
  the seed decides the initial weights as well as the sampler's order, the collator's masks and dropout
  (the Trainer seeds every rank alike, so the ranks draw their masks and dropout from one random stream).
- ``--deepspeed FILE``: HF's DeepSpeed integration with that JSON (``bench/e2e.py`` writes ZeRO-2 with
  the knobs roformer-train uses: contiguous gradients, no overlap, reduce-scatter, default buckets; no
  optimizer or scheduler section, so the Trainer's AdamW and schedule are used; batch sizes and
  clipping ``"auto"``, filled from the arguments above); launched by ``torchrun`` as well, with
  ``DS_ACCELERATOR=cpu``.
- threads: torchrun sets ``OMP_NUM_THREADS=1`` per rank when it starts more than one (its default).
- ``--torch-compile``: ``TrainingArguments(torch_compile=True)``, the Trainer's own ``torch.compile`` of the
  model (inductor, its defaults), for ``bench/e2e.py --compile``.
- ``--device cuda`` (``bench/e2e.py --device cuda``): ``use_cpu=False``, each rank on its GPU, NCCL (the
  Trainer's default backend there); the step-time callback synchronizes the device before it notes the time,
  so that a step's end is the device's. ``--bf16``: ``TrainingArguments(bf16=True)`` (autocast to bf16, fp32
  weights and optimizer). HF's RoFormer has no SDPA or flash-attention implementation: its attention stays eager.

Profiling (``--profile-dir DIR --profile-start K --profile-steps N``, for ``bench/profile_e2e.py``): rank 0
runs ``torch.profiler`` (CPU activities, ``record_shapes=True``) over optimizer steps K..K+N-1, from the end of
step K-1 to the end of step K+N-1 (so that the window is N whole step-to-step intervals, data loading
included), each step inside ``record_function("optimizer_step_<k>")``, and writes
``DIR/trace_steps_K-L.pt.trace.json`` (Chrome trace) and ``DIR/key_averages_steps_K-L.txt`` (self CPU time),
as roformer-train's ``trainer.profile`` does. HF's rotary code (the sinusoidal table and
``apply_rotary_position_embeddings``) then runs inside ``record_function("rotary: ...")`` labels, so that the
summary can find it (a label costs microseconds; nothing else changes).

Timing: a ``TrainerCallback`` notes ``time.time()`` at the end of every optimizer step on every rank;
rank 0 writes ``--out`` (JSON: the process start, the Trainer's creation, the step end times, and
this rank's peak RSS) when training ends.

Losses (for ``bench/parity.py``): ``--out`` also holds ``logged_loss``, ``[[step, loss], ...]`` as the
Trainer logs it every ``logging_steps``; with ``--record-loss``, ``loss`` too: per optimizer step, the mean
over the ranks of the loss the model returned on each rank (the mean cross-entropy over the masked
positions of its micro-batch; the mean over the micro-batches with ``--accumulation``), noted by a
forward hook and gathered once when training ends. The two differ: with more than one rank the Trainer's
``average_tokens_across_devices`` (on by default) multiplies the loss by the world size, because
``RoFormerForMaskedLM.forward`` takes ``**kwargs`` (so the Trainer expects it to divide by the batch's
masked tokens on all ranks) yet averages over its own micro-batch; the gradient is scaled alike, before
clipping. ``--per-rank-loss`` sets ``average_tokens_across_devices=False``: loss and gradient are each
rank's own mean (then averaged over the ranks by DDP), as roformer-train's are, and the logged loss is the
model's. ``--save-model DIR``: ``trainer.save_model(DIR)`` after training (the final weights,
``from_pretrained`` format).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

START = time.time()

import _common as C  # noqa: E402  (bench helpers only: the --tiny flag)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (AutoTokenizer, DataCollatorForLanguageModeling, RoFormerConfig,  # noqa: E402
                          RoFormerForMaskedLM, Trainer, TrainerCallback, TrainingArguments, set_seed)


class PackedSequences(torch.utils.data.Dataset):
    """[N, seq] token ids (0 = padding) -> {input_ids, attention_mask} examples."""

    def __init__(self, ids: np.ndarray, pad_id: int):
        self.ids = torch.from_numpy(ids)
        self.mask = (self.ids != pad_id).long()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}


class StepProfile(TrainerCallback):
    """torch.profiler over optimizer steps [start, start + steps) on rank 0 (see the module docstring), each
    step inside ``record_function("optimizer_step_<k>")`` and the files named as roformer-train's
    (``roformer_dist/observe/profiling.py``)."""

    def __init__(self, out: Path, start: int, steps: int):
        self.out, self.start, self.steps = out, start, steps
        self.prof = self.marker = None

    def _mark(self, step: int) -> None:
        self.marker = torch.profiler.record_function(f"optimizer_step_{step}")
        self.marker.__enter__()

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        label_hf_rotary()
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.prof.__enter__()
        self._mark(self.start)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.start == 1 and state.is_world_process_zero:
            self._begin()

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        last = self.start + self.steps - 1
        if self.prof is None:
            if state.global_step == self.start - 1:
                self._begin()
            return
        self.marker.__exit__(None, None, None)
        if state.global_step < last:
            self._mark(state.global_step + 1)
            return
        self.prof.__exit__(None, None, None)
        span = f"steps_{self.start}-{last}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out / f"trace_{span}.pt.trace.json"))
        (self.out / f"key_averages_{span}.txt").write_text(
            self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        self.prof = None


def label_hf_rotary() -> None:
    """Run HF RoFormer's rotary code inside ``record_function`` labels (profiling only)."""
    import functools

    from transformers.models.roformer import modeling_roformer as m

    def labelled(fn, name):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    attn = m.RoFormerSelfAttention
    if not getattr(attn, "_bench_labelled", False):
        attn.apply_rotary_position_embeddings = staticmethod(labelled(attn.apply_rotary_position_embeddings,
                                                                      "rotary: apply_rotary_position_embeddings"))
        pos = m.RoFormerSinusoidalPositionalEmbedding
        pos.forward = labelled(pos.forward, "rotary: sinusoidal table")
        attn._bench_labelled = True


class AbortAtStep(TrainerCallback):
    """The bench's crash test (``--abort-at-step``): one rank aborts (SIGABRT) at the end of a step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == args.world_size - 1:
            print(f"hf_trainer_mlm: --abort-at-step {self.step}: rank {args.process_index} aborts", flush=True)
            os.abort()


class StepTimes(TrainerCallback):
    """Wall time at the end of every optimizer step; ``cuda``: once the device has finished it."""

    def __init__(self, cuda: bool = False):
        self.times: list[float] = []
        self.cuda = cuda

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.time())


class LossLog(TrainerCallback):
    """The Trainer's logged losses (``logged``: ``[step, loss]``) and, with ``model`` given, the model's own
    training loss of every optimizer step on this rank (``steps``: a forward hook notes each training forward's
    loss; one entry per step, the mean over its micro-batches)."""

    def __init__(self, model=None):
        self.logged: list[list[float]] = []
        self.steps: list[float] = []
        self.pending: list[torch.Tensor] = []
        if model is not None:
            model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if module.training and getattr(output, "loss", None) is not None:
            self.pending.append(output.loss.detach().clone())  # the Trainer may scale the loss in place

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending:
            self.steps.append(float(torch.stack(self.pending).float().mean()))
            self.pending.clear()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logged.append([state.global_step, float(logs["loss"])])

    def gathered_steps(self) -> list[float]:
        """Per step, the mean over the ranks (collective: every rank calls it)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return list(self.steps)
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, self.steps)
        return [sum(xs) / len(xs) for xs in zip(*per_rank)]


def parse_args(argv=None):
    p = C.parser(__doc__)
    need = not C.tiny_requested(argv)  # --tiny makes its own inputs
    p.add_argument("--data", type=Path, required=need, help="directory written by bench/e2e.py")
    p.add_argument("--model", type=Path, required=need, help="directory with the RoFormerConfig (config.json)")
    p.add_argument("--seq", type=int, required=need)
    p.add_argument("--micro-batch", type=int, required=need, help="sequences per rank per forward")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--steps", type=int, required=need, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (HF's integration)")
    p.add_argument("--out", type=Path, required=need, help="JSON with the step times (rank 0)")
    p.add_argument("--output-dir", type=Path, default=None, help="the Trainer's output_dir (default: next to --out)")
    p.add_argument("--torch-compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: use_cpu=False, one GPU per rank")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    p.add_argument("--profile-dir", type=Path, default=None, help="torch.profiler trace of rank 0 goes here")
    p.add_argument("--profile-start", type=int, default=5, help="first profiled optimizer step (1-based)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps")
    p.add_argument("--record-loss", action="store_true",
                   help="note the model's loss of every step (a forward hook) into --out as \"loss\"")
    p.add_argument("--per-rank-loss", action="store_true",
                   help="TrainingArguments(average_tokens_across_devices=False): the loss is each rank's own mean")
    p.add_argument("--save-model", type=Path, default=None, help="trainer.save_model(DIR) after training")
    p.add_argument("--abort-at-step", type=int, default=0, help=argparse.SUPPRESS)
    C.tiny_defaults(p, argv)
    return p.parse_args(argv)


def tiny() -> None:
    """--tiny: e2e's inputs at e2e's tiny sizes (its own functions), this script on 2 ranks under torchrun
    (as e2e starts it), then the JSON it wrote."""
    import e2e  # bench/, this script's directory, is on sys.path

    C.require("accelerate", "the HF Trainer")
    work = C.tiny_dir()
    ea = e2e.parse_args(["--tiny", "--part", "e2e", "--data", str(work / "data")])
    shards, hf_dir = e2e.prepare(ea)
    model_dir = e2e.hf_model_dir(ea, work, e2e.vocab_size(shards))
    seq, out = ea.seq[0], work / "times.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ea.ranks),
           str(Path(__file__).resolve()), "--data", str(hf_dir), "--model", str(model_dir), "--seq", str(seq),
           "--micro-batch", str(ea.batch[seq] // ea.ranks), "--steps", str(ea.steps), "--warmup", str(ea.warmup),
           "--out", str(out)]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=C.child_env())
    print(out.read_text().strip())


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.tiny:
        tiny()
        return
    tokenizer = AutoTokenizer.from_pretrained(str(a.data / "tokenizer"))
    dataset = PackedSequences(np.load(a.data / f"packed_{a.seq}.npy"), tokenizer.pad_token_id)
    config = RoFormerConfig.from_pretrained(str(a.model))
    set_seed(a.seed)  # before the model: the seed decides the initial weights too
    model = RoFormerForMaskedLM(config)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    args = TrainingArguments(
        output_dir=str(a.output_dir or a.out.parent / "hf_output"),
        use_cpu=a.device == "cpu", ddp_backend=None if a.deepspeed or a.device == "cuda" else "gloo",
        deepspeed=a.deepspeed, bf16=a.bf16,
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.accumulation,
        max_steps=a.steps, learning_rate=a.lr, warmup_steps=a.warmup, lr_scheduler_type="linear",
        weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-6, max_grad_norm=1.0,
        save_strategy="no", eval_strategy="no", logging_steps=10, report_to="none", disable_tqdm=True,
        seed=a.seed, dataloader_drop_last=True, torch_compile=a.torch_compile,
        **({"average_tokens_across_devices": False} if a.per_rank_loss else {}))
    timer, losses = StepTimes(cuda=a.device == "cuda"), LossLog(model if a.record_loss else None)
    callbacks = [timer, losses]
    if a.profile_dir is not None:
        if not 1 <= a.profile_start <= a.profile_start + a.profile_steps - 1 <= a.steps:
            sys.exit(f"hf_trainer_mlm: --profile-start {a.profile_start} --profile-steps {a.profile_steps}: "
                     f"outside the {a.steps} steps")
        callbacks.append(StepProfile(a.profile_dir, a.profile_start, a.profile_steps))
    if a.abort_at_step:
        callbacks.append(AbortAtStep(a.abort_at_step))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
    created = time.time()
    trainer.train()
    if a.save_model is not None:
        trainer.save_model(str(a.save_model))  # every rank calls it; the main process writes
    per_step = losses.gathered_steps() if a.record_loss else None
    if args.process_index == 0:
        out = {"start": START, "trainer_created": created, "step_end": timer.times,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "world_size": args.world_size, "optim": str(args.optim), "deepspeed": bool(a.deepspeed),
               "threads": torch.get_num_threads(), "pid": os.getpid(), "torch_compile": a.torch_compile,
               "device": a.device, "bf16": a.bf16, "seed": a.seed, "per_rank_loss": a.per_rank_loss,
               "logged_loss": losses.logged, **({"loss": per_step} if a.record_loss else {})}
        a.out.write_text(json.dumps(out) + "\n")
    # a rank that exits with its gloo group alive can abort at exit ("terminate called without an active
    # exception", SIGABRT: seen with --deepspeed), failing the launch after the work is done
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
