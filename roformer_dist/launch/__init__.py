"""A training launch: what it decides before the first step, and the processes that run it.

Owns: ``resolved.py`` (``ResolvedRun``: a launch resolved once by the command that starts it: manifests,
mixture, stage plans, resume decision; written to the run directory and handed to the ranks), ``entry.py``
(``run_rank``: process group, run lock, logging, the trainer), ``build.py`` (``build_trainer``: model, engine,
loader and callbacks from the resolved run, the checkpoint loaded), ``spawn.py`` (the ranks of a job on this
machine, started before the run is resolved so that they import meanwhile), ``preload.py`` (what a rank imports,
for a process that forks ranks), ``warm_start.py`` (a new run's first weights from a Hugging Face repository, a
run or a weights file: ``init.from``, forks), ``dry_run.py`` (``--dry-run``: a run resolved read-only, its plan
and memory per stage against a GPU), ``memory_estimate.py`` (the memory one rank needs per stage, from the config
alone), ``preflight.py`` (the worst stage's micro-batch tried on the GPU before DeepSpeed, as the run will run
it), ``logs.py`` (a rank's log file).

May import: ``loop``, ``observe``, ``plan``, ``hf`` (its weight conversion, for warm starts), ``checkpoint``,
``parallel``, ``nn``, ``runtime``, ``config``, ``errors``, ``data_pipeline``.

Start reading at ``resolved.py`` (what a launch decides before its first step), then ``entry.py`` and
``build.py``.
"""
