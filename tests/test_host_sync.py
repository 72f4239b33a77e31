"""No training step waits on the device, except at log, eval and save steps.

Two ways to wait: reading a value back (below), and synchronizing the device explicitly
(``runtime.host_reads.DeviceSyncRecorder``: torch's and DeepSpeed's ``synchronize`` calls, counted on CPU
too, where DeepSpeed's accelerator makes them no-ops). A plain step makes neither: DeepSpeed's throughput
timer, on by default, synchronized twice a step until ``parallel/engine.py`` turned it off. DeepSpeed's own
synchronizations that cannot be turned off are listed in :data:`DEEPSPEED_SYNCS`: none in a plain step with
the defaults. (With ``deepspeed.overlap_comm`` ZeRO-1/2 synchronizes the device before each gradient
bucket's reduction on a GPU, where its accelerator does not resolve data dependencies; not on CPU, so not
seen here.)

On a GPU the host queues a step's kernels and runs ahead; an op whose result the host must see (a value,
a data-dependent shape) waits for every kernel queued before it. ``runtime.host_reads.HostReadRecorder``
finds such ops on any device: it follows what is computed from the device's tensors (the parameters, the
batch after its copy to the device) and records the reads, with the caller. Here it watches real trainer
runs (2 gloo ranks, DeepSpeed ZeRO-2) during their steps that are neither log, eval nor save steps, for
every packing form (whole rows / key padding, document blocks, the dense block-diagonal mask), softmax
and linear attention, with and without tensor parallelism: this project's code reads nothing back.
DeepSpeed's own reads (its optimizer step) are listed, not failed.

The varlen layout is not watched: its CPU stand-in for flash-attn's kernel (``documents.varlen_reference``,
one SDPA call per document) reads the document bounds on purpose; on a GPU flash-attn's kernel takes them
on the device.
"""

from __future__ import annotations

import pytest
import torch

from roformer_dist.runtime.host_reads import DeviceSyncRecorder, HostReadRecorder
from roformer_dist.testing import run_distributed
from trainer_runs import make_cfg

WATCHED_STEPS = (2, 3, 4, 5)
"""Steps 1-6 of the debug curriculum's first stage run; with log_every 100, no save or eval before the
stage ends at step 6, these are plain steps (step 1 is left out: it builds the loader's workers)."""

FORMS = {  # name -> (data.packing, documents.BLOCKS_BELOW)
    "rows": ("cross_document", None),
    "blocks": ("document", 1e9),
    "dense_mask": ("document", 0.0),
}
DEEPSPEED_SYNCS: frozenset = frozenset()
"""(what, DeepSpeed's file) of the device synchronizations DeepSpeed makes in a plain step that no setting
turns off: none."""
CASES = [(form, attention, tensor) for tensor in (1, 2) for attention in ("softmax", "linear")
         for form in FORMS if not (attention == "linear" and form == "dense_mask")]  # linear: blocks only


def _watch(rank, world_size, cases, shards, root):
    from roformer_dist.launch.entry import run_rank
    from roformer_dist.loop import trainer as trainer_module
    from roformer_dist.nn import documents
    from roformer_dist.parallel import runner as runner_module

    found = {}
    real_step, real_on = trainer_module.Trainer.train_step, runner_module._on
    for form, attention, tensor in cases:
        packing, blocks_below = FORMS[form]
        if blocks_below is not None:
            documents.BLOCKS_BELOW = blocks_below
        name = f"{form}-{attention}-tp{tensor}"
        cfg = make_cfg(shards, root / name, f"data.packing={packing}", f"model.attention={attention}",
                       f"parallel.tensor={tensor}", "trainer.log_every=100", "trainer.stop_at_step=6")
        recorders, syncs = [], []

        def watched_step(self, batches, lr):
            if self.state.step + 1 not in WATCHED_STEPS:
                return real_step(self, batches, lr)
            rec = HostReadRecorder()
            rec.taint(*self.engine.module.parameters())
            recorders.append(rec)
            with rec, DeviceSyncRecorder() as waits:
                try:
                    return real_step(self, batches, lr)
                finally:
                    syncs.extend(waits.calls)

        def tainting_on(batch, device):
            moved = real_on(batch, device)
            if recorders and recorders[-1]._saved:  # inside a watched step: the batch is now the device's
                recorders[-1].taint_all(moved)
            return moved

        trainer_module.Trainer.train_step, runner_module._on = watched_step, tainting_on
        try:
            assert run_rank(cfg) == 0
        finally:
            trainer_module.Trainer.train_step, runner_module._on = real_step, real_on
        assert len(recorders) == len(WATCHED_STEPS), name
        found[name] = ([r for rec in recorders for r in rec.ours], sorted({r for rec in recorders for r in rec.others}),
                       syncs)
    return found


@pytest.mark.slow
def test_plain_training_steps_read_nothing_back_from_the_device(small_shards, tmp_path):
    results = run_distributed(_watch, world_size=2, args=(CASES, small_shards, tmp_path), timeout=600)
    for rank, found in enumerate(results):
        assert set(found) == {f"{f}-{a}-tp{t}" for f, a, t in CASES}
        for name, (ours, others, syncs) in found.items():
            assert not ours, f"rank {rank}, {name}: the step waits on the device at\n" + \
                "\n".join(f"  {op} <- {where}" for op, where in ours)
            unexpected = [(what, where) for what, where in syncs
                          if (what, where.split("site-packages/")[-1].split(":")[0]) not in DEEPSPEED_SYNCS]
            assert not unexpected, f"rank {rank}, {name}: {len(unexpected)} device synchronizations in " \
                f"{len(WATCHED_STEPS)} plain steps:\n" + "\n".join(f"  {w} <- {where}" for w, where in unexpected[:8])
            if rank == 0 and others:
                print(f"{name}: DeepSpeed's own reads: " + "; ".join(f"{op} <- {w}" for op, w in others))


def test_the_recorder_sees_reads_of_the_devices_tensors_only():
    """The recorder itself: reads of a tensor computed from a tainted one are reported with their caller
    (a boolean mask, .item(), .numpy()); reads of the host's own tensors are not."""
    x = torch.arange(6.0)
    host = torch.arange(3)
    with HostReadRecorder() as rec:
        rec.taint(x)
        y = (x * 2)[x > 2]           # indexing by a mask computed from x: a nonzero inside
        float(y.sum())               # .item()
        host.tolist(), int(host[0]), host[host > 0]  # the host's own: no wait
        y.numpy()
        x.add_(1)                    # no read
    ops = [op for op, _ in rec.reads]
    assert len(ops) == 3, rec.reads
    assert ops[0].startswith("aten.index") and "_local_scalar_dense" in ops[1] and ops[2] == "Tensor.numpy"
    assert all("test_host_sync.py" in where for _, where in rec.reads)
    assert rec.ours == [] and len(rec.others) == 3  # the caller is this test, not the project's code
    assert "wrapper" not in torch.Tensor.numpy.__qualname__  # unwrapped after


def test_the_sync_recorder_counts_torchs_and_deepspeeds_waits_and_puts_them_back():
    """Each patched wait is recorded with its caller and still made; leaving restores every one."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    reals = (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize)
    with DeviceSyncRecorder() as rec:
        accelerator.synchronize()
        accelerator.synchronize()
        assert torch.cuda.synchronize is not reals[0]
    assert [what for what, _ in rec.calls] == ["deepspeed get_accelerator().synchronize"] * 2
    assert all("test_host_sync.py" in where for _, where in rec.calls)
    assert (torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize) == reals
    assert "synchronize" not in vars(accelerator)
