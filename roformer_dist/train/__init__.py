"""Pretraining: the rank entry point, the loop and what it decides, measures and evaluates.

Owns: ``resolved.py`` (``ResolvedRun``: a launch resolved once by the command that starts it: manifests,
mixture, stage plans, resume decision; written to the run directory and handed to the ranks), ``dry_run.py``
(``--dry-run``: a run resolved read-only, its plan and memory per stage against a GPU), ``memory_estimate.py``
(the memory one rank needs per stage, from the config alone), ``entry.py``
(``run_rank``: process group, run lock, logging, the trainer), ``spawn.py`` (the ranks of a job on this
machine, started before the run is resolved so that they import meanwhile), ``preload.py`` (what a rank
imports, for a process that forks ranks), ``trainer.py`` (``Trainer``: load -> step -> log -> save -> eval ->
stop), ``eval_steps.py`` (the trainer's eval calls), ``policies.py`` (when to log, save, evaluate and stop: pure), ``curriculum.py`` (stage and
learning rate at a step: pure), ``data.py`` (manifests checked against the config, loader errors),
``mixture.py`` (the corpus mixture's plan: shares per stage, draws, epochs, repetition caps),
``stragglers.py`` (each rank's own times gathered at log steps: the slowest named), ``rotary_choice.py``
(a stage's rotary backend, chosen on rank 0), ``spikes.py`` (``trainer.spike``: a loss far above the recent ones drops its update), ``rollback.py``
(``trainer.spike: rollback``: back to the checkpoint before a spike, past its batches), ``warm_start.py`` (a
new run's first weights from a Hugging Face repository, a run or a weights file:
``init.from``, forks), ``decay_branch.py`` (``init.decay_steps``: a run that resumes a stable checkpoint
and decays), ``metrics.py`` (rank 0's sinks, MFU), ``sinks/`` (where metrics go: the ``Sink``
protocol and its table; ``jsonl``, ``tensorboard``), ``preflight.py`` (the worst stage's micro-batch tried on the
GPU before DeepSpeed, as the run will run it), ``profiling.py``
(the ``torch.profiler`` window of ``trainer.profile``), ``evaluation.py`` (eval at each length beside the
baselines), ``baselines.py`` (unigram and most-frequent-token baselines), ``length_report.py`` (a
checkpoint's loss at any length: ``roformer-eval``'s work), ``logs.py`` (a rank's log file), ``plots.py``
(line charts as PNG: the demo's curves, the benches' figures; matplotlib lazily).

May import: ``roformer_dist.hf`` (its weight conversion, for warm starts), ``checkpoint``, ``parallel``, ``nn``, ``runtime``, ``config``, ``errors``,
``data_pipeline``.

Start reading at ``resolved.py`` (what a launch decides before its first step), then ``trainer.py`` (the
loop), then ``entry.py``.
"""
