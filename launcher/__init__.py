"""The SLURM launcher: one config -> one submitit job that survives time limits and preemption.

- ``launcher.profiles``: config + cluster profile + command-line flags -> the resolved ``Config`` and
  the submitit executor parameters.
- ``launcher.job``: ``TrainJob``, the submitit ``Checkpointable`` that runs one trainer rank per task
  and requeues the job when the trainer stopped on a signal.
- ``launcher.slurm``: the small ``sacct`` / ``squeue`` / ``scancel`` helpers behind ``status``,
  ``cancel`` and ``--wait``.
- ``launcher.cli``: ``roformer-submit``.

The launcher knows the trainer only through ``roformer_dist.train.entry.run_rank`` and the config.
"""
