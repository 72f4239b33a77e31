"""The SLURM launcher: one config -> one submitit job that survives time limits and preemption.

- ``launcher.profiles``: config + cluster profile + command-line flags -> the resolved ``Config`` and
  the submitit executor parameters.
- ``launcher.job``: ``TrainJob``, the submitit ``Checkpointable`` that runs one trainer rank per task
  and requeues the job when the trainer stopped on a signal.
- ``launcher.slurm``: the small ``sacct`` / ``squeue`` / ``scancel`` helpers behind ``status``,
  ``cancel`` and ``--wait``.
- ``launcher.slurm_settings``: what may be written into a batch script (names, constraints, environment
  values) and how it is quoted.
- ``launcher.cli``: ``roformer-submit``.

The launcher knows the trainer only through ``roformer_dist.launch.entry.run_rank`` and the config.

Untrusted inputs (docs/guides/security.md): what reaches the batch script is validated and quoted
(``launcher.slurm_settings``, applied by ``launcher.profiles``); secrets are given by reference (``slurm.env_from``: only the names are written
anywhere); what the launcher and its job write is closed to others (umask 027, ``SLURM_UMASK``); job ids
and pids read back from ``logs/jobs.jsonl`` are checked before they reach ``scancel`` or a signal
(``launcher.cli``, ``launcher.slurm``).
"""
