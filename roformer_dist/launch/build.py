"""One rank's trainer, built from the resolved run: the model (from ``init.from``'s weights when the run resolved a
warm start), the GPU preflight, the engine and runner, the loader, the callbacks, and the checkpoint the run
resolved loaded into it.

The run's record (config.yaml, metrics.jsonl, TensorBoard) is not touched before the checkpoint loaded:
config.yaml is written last.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from data_pipeline.loader import LoaderSettings, ShardLoader
from roformer_dist.checkpoint import store as ckpt
from roformer_dist.checkpoint.lineage import write_parent
from roformer_dist.checkpoint.safe_load import weights_only_loads
from roformer_dist.checkpoint.universal import to_universal
from roformer_dist.config import dump_yaml, save_config
from roformer_dist.errors import StorageError
from roformer_dist.launch.preflight import preflight
from roformer_dist.launch.resolved import ResolvedRun
from roformer_dist.launch.warm_start import optimizer_checkpoint, warm_start
from roformer_dist.loop.callbacks import BuildContext, build_callbacks
from roformer_dist.loop.restore import restore
from roformer_dist.loop.trainer import Trainer
from roformer_dist.nn.model import RoFormerForMaskedLM, batch_plan
from roformer_dist.parallel.runner import build_parallel_engine
from roformer_dist.plan.curriculum import stage_at, total_steps
from roformer_dist.runtime.faults import NO_FAULTS, Faults
from roformer_dist.runtime.process_group import DistEnv, TorchComm
from roformer_dist.runtime.stop import StopFlag

__all__ = ["build_trainer", "build_loader"]

log = logging.getLogger("roformer_dist.trainer")


def build_loader(run: ResolvedRun, stage_index: int, dp_rank: int, dp_size: int, device_type: str) -> ShardLoader:
    """The loader of ``run``'s training data (the manifests it resolved), set for stage ``stage_index`` on
    data-parallel rank ``dp_rank``."""
    cfg, plan, d = run.cfg, run.stages[stage_index], run.cfg.data
    settings = LoaderSettings(plan.seq_len, plan.micro_batch_size, num_workers=d.num_workers, seed=cfg.trainer.seed,
                              mlm_probability=plan.mlm_probability, whole_word_mask=d.whole_word_mask,
                              skip_bad_shards=d.skip_bad_shards, pin_memory=torch.cuda.is_available(),
                              packing=d.packing, mask_replace=d.mask_replace)
    return settings.build(run.mixture.loader_sources(run.manifests), dp_rank, dp_size,
                          weights=run.mixture.stage_weights(stage_index),
                          prepare=None if cfg.parallel.pipeline > 1 else batch_plan(cfg.model, device_type))


def build_trainer(run: ResolvedRun, env: DistEnv, stop: Optional[StopFlag] = None, faults: Faults = NO_FAULTS,
                  on_hang: Callable[[], None] = lambda: None) -> Trainer:
    """The trainer of this rank (collective: every rank of the job calls it), loaded from the checkpoint the run
    resolved. ``faults``: the tests' fault injection; ``on_hang``: what the hang watch calls before it ends
    this process."""
    if run.world_size != env.world_size:
        raise ValueError(f"build_trainer: the run was resolved for {run.world_size} rank(s), this rank is one of "
                         f"{env.world_size}")
    cfg, comm = run.cfg, TorchComm()
    found = run.resume.checkpoint
    resumed = ckpt.read_trainer_state(found.dir, 0) if found else None
    if env.rank == 0:
        log.info("resolved config:\n%s", dump_yaml(cfg))
        run.log_notes()
        log.info("%s", run.summary())
        log.info("%s", run.mixture.table())
        for warning in run.mixture.warnings():
            log.warning("%s", warning)
    if run.elastic and cfg.deepspeed.zero_stage > 0:
        if env.rank == 0:
            to_universal(found.dir, cfg.deepspeed.zero_stage)
        comm.barrier()

    torch.manual_seed(cfg.trainer.seed)  # identical initial weights on every rank
    model = RoFormerForMaskedLM(cfg.model)
    if found and cfg.init.from_ and not cfg.init.decay_steps and env.rank == 0:
        log.info("init.from %s not read: resuming this run's own checkpoint", cfg.init.from_)
    parent = None
    if run.resume.warm_start is not None:
        parent, weights = warm_start(cfg, run.manifest["tokenizer"]["sha256"])
        model.load_state_dict(weights)
        if env.rank == 0:
            log.info("warm start from %s %s%s", parent.kind, parent.path,
                     f" (step {parent.step})" if parent.step is not None else "")
    if cfg.parallel.tensor == cfg.parallel.pipeline == 1:
        preflight(model, cfg, run.stages, run.manifests, run.world_size, env.local_rank)
    first = stage_at(cfg.curriculum.stages,
                     found.step if found and found.step < total_steps(cfg.curriculum.stages) else 0).index
    _, runner = build_parallel_engine(cfg, model, run.stages[first], env.world_size,
                                      load_universal=run.elastic and cfg.deepspeed.zero_stage > 0)
    loader = build_loader(run, first, runner.dp_rank, runner.dp_size, runner.engine.device.type)
    # dropout: one stream per replica and pipeline stage, shared by the tensor ranks of a stage
    torch.manual_seed(cfg.trainer.seed + 1 + runner.seed_offset)
    ctx = BuildContext(run, env, comm, model.flops_per_token, faults, on_hang)
    tr = Trainer(run, env, runner, loader, build_callbacks(ctx), stop=stop, stage_index=first)
    if found:
        restore(tr, found, resumed)
    elif parent is not None and cfg.init.load_optimizer:
        with weights_only_loads():
            runner.load_checkpoint(*optimizer_checkpoint(parent))
        log.info("optimizer state taken from %s", parent.path)
    if env.rank == 0:
        try:
            if parent is not None:
                write_parent(run.run_dir.root, parent)
            save_config(cfg, run.run_dir.config)
        except OSError as e:
            raise StorageError.from_os_error(e, "writing config.yaml") from None
    return tr
