"""A run is resolved once, by the command that starts it, and its ranks run from what it resolved.

- The resolved run survives ``<run_dir>/resolved_run.json`` unchanged, and names what it decided.
- Two ranks started from a ResolvedRun (as ``roformer-train``'s spawner starts them) resume the checkpoint it
  chose and use its stage plans, with every function that would re-derive them replaced by one that fails.
- Under torchrun (every rank a ``roformer-train`` of its own), a rank whose config file differs from the one
  rank 0 resolved is refused on every rank, with one message, before anything is trained.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roformer_dist.config import dump_yaml, load_config, stage_plans
from roformer_dist.errors import EXIT_CONFIG, EXIT_DONE, ConfigError
from roformer_dist.runtime.process_group import free_port
from roformer_dist.testing import run_distributed
from trainer_runs import DEBUG, ROOT, make_cfg, records, train

def test_a_resolved_run_round_trips_through_the_run_directory(small_shards, tmp_path):
    from roformer_dist.launch.resolved import ResolvedRun, config_sha256, resolve_run

    cfg = make_cfg(small_shards, tmp_path / "run", "model.vocab_size=auto")
    run = resolve_run(cfg)
    assert run.cfg.model.vocab_size == run.manifest["vocab_size"] != "auto"  # the data filled it in
    assert run.config_sha256 == config_sha256(cfg) != config_sha256(run.cfg)
    assert run.resume.checkpoint is None and run.resume.warm_start is None and run.world_size == 2
    # the debug curriculum at 2 ranks: 2048 tokens per micro-batch, global batches 8, 8, 4
    assert [(s.seq_len, s.micro_batch_size, s.accumulation) for s in run.stages] == [(128, 4, 1), (256, 4, 1),
                                                                                      (512, 2, 1)]
    path = run.write()
    assert path == tmp_path / "run" / "resolved_run.json"
    back = ResolvedRun.read(run.run_dir)
    assert back == run
    on_disk = json.loads(path.read_text())
    assert on_disk["stages"][2]["micro_batch_size"] == 2 and on_disk["resume"] == {"checkpoint": None,
                                                                                  "warm_start": None, "branch": None}


def test_a_damaged_resolved_run_is_one_error_naming_the_file(small_shards, tmp_path):
    from roformer_dist.launch.resolved import FORMAT, ResolvedRun, resolve_run
    from roformer_dist.runtime.rundir import RunDir

    run = resolve_run(make_cfg(small_shards, tmp_path / "run"))
    run.write()
    data = run.to_json()
    del data["stages"][0]["accumulation"]
    run.run_dir.resolved_run.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"resolved_run.json: damaged resolved run \(KeyError"):
        ResolvedRun.read(run.run_dir)
    run.run_dir.resolved_run.write_text(json.dumps({**data, "format": 99}))
    with pytest.raises(ConfigError, match=f"not a resolved run of format {FORMAT}"):
        ResolvedRun.read(run.run_dir)
    with pytest.raises(ConfigError, match="missing: rank 0 writes it"):
        ResolvedRun.read(RunDir(tmp_path / "elsewhere"))


RE_DERIVERS = ("resolve_data", "plan_mixture", "choose_resume", "source_manifests", "resolve_run", "micro_batch_size",
               "stage_plans", "check_compatible", "validate")
"""What a rank must not call: everything it is handed, derived again."""


def _run_with_spies(rank, world_size, run):
    """A rank as the spawner starts it, with every re-deriving function replaced (under every name a module
    of ours holds it by) by one that fails loudly."""
    import importlib

    from roformer_dist.launch.entry import run_rank

    homes = [importlib.import_module(m) for m in (
        "roformer_dist.checkpoint.compat", "roformer_dist.checkpoint.store", "roformer_dist.config.derived",
        "roformer_dist.config.validate", "roformer_dist.plan.data", "roformer_dist.plan.mixture",
        "roformer_dist.launch.resolved")]
    originals = {id(getattr(m, n)) for m in homes for n in RE_DERIVERS if callable(getattr(m, n, None))}
    assert len(originals) == len(RE_DERIVERS)

    def spy(name):
        def called(*args, **kwargs):
            raise AssertionError(f"rank {rank} called {name}: it must read the resolved run")
        return called

    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("roformer_dist"):
            for attr, value in list(vars(module).items()):
                if id(value) in originals:
                    setattr(module, attr, spy(attr))
                    patched += 1
    assert patched >= len(RE_DERIVERS)
    return run_rank(run)


def test_ranks_run_from_the_resolved_run_not_the_config(small_shards, tmp_path):
    from roformer_dist.launch.resolved import resolve_run

    run_dir = tmp_path / "run"
    cfg = make_cfg(small_shards, run_dir, "trainer.save_every=3", "trainer.log_every=1", "trainer.stop_at_step=3")
    assert train(cfg) == [EXIT_DONE] * 2
    run = resolve_run(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, stop_at_step=8)))
    assert run.resume.checkpoint is not None and run.resume.checkpoint.step == 3
    # a plan the config would not give: the ranks must take the resolved run's word for it
    s256 = dataclasses.replace(run.stages[1], micro_batch_size=2, accumulation=2)
    assert stage_plans(run.cfg, 2)[1].micro_batch_size == 4
    run = dataclasses.replace(run, stages=(run.stages[0], s256, run.stages[2]))
    assert run_distributed(_run_with_spies, world_size=2, args=(run,), timeout=300) == [EXIT_DONE] * 2
    assert [r["step"] for r in records(run_dir)] == list(range(1, 9))  # into the second stage
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "resuming from" in log and "step 3" in log
    assert "stage 2/3 's256': seq_len 256, global batch 8, micro-batch 2, accumulation 2" in log


def _rank_cli(config: Path, run_dir: Path, rank: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "roformer_dist.cli.train", "--config", str(config)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_config_changed_between_resolve_and_start_is_refused_on_every_rank(small_shards, tmp_path):
    """torchrun starts each rank as its own roformer-train: rank 0 resolves its config; rank 1 read the file
    after someone edited it."""
    from roformer_dist.launch.resolved import config_sha256

    run_dir = tmp_path / "run"
    cfg = make_cfg(small_shards, run_dir)
    original, edited = tmp_path / "original.yaml", tmp_path / "edited.yaml"
    original.write_text(dump_yaml(cfg))
    edited.write_text(dump_yaml(cfg).replace("lr: 0.001", "lr: 0.002"))
    assert load_config(edited).optim.lr == 0.002
    port = free_port()
    procs = [_rank_cli(original, run_dir, 0, port), _rank_cli(edited, run_dir, 1, port)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == EXIT_CONFIG, out
        assert "rank 1: its config differs from the one rank 0 resolved" in out, out
        assert "changed between resolve and start" in out and "Traceback" not in out
    written = json.loads((run_dir / "resolved_run.json").read_text())
    assert written["config_sha256"] == config_sha256(load_config(original))
    assert not (run_dir / "metrics.jsonl").exists() and not list((run_dir / "checkpoints").glob("step_*"))
