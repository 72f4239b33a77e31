"""The process around a run: stop signals, the run lock, the process group, fault injection.

Owns: ``stop.py`` (SIGTERM / SIGINT / USR2 as a stop request; a second Ctrl-C aborts; ranks die with
their launcher), ``runlock.py`` (one writer per run directory; stale locks detected), ``rundir.py``
(run directories created with a safe mode; foreign, group-writable or symlinked ones refused),
``process_group.py`` (the one torch.distributed bootstrap of training and fine-tuning, ``DistEnv``,
``free_port``, the checkpoint layer's collectives), ``faults.py`` (the fault hooks tests and the fault campaign set
through the environment), ``heartbeat.py`` (each rank's progress and the watchdog that ends a hung launch), ``events.py`` (a run's TensorBoard scalars read back), ``jit_builds.py``
(torch's JIT extension builds before DeepSpeed loads its ops: a directory per Python environment, locks
left by killed builds removed, live builds waited for), ``cuda_arch.py`` (``TORCH_CUDA_ARCH_LIST`` as
DeepSpeed's op builder reads it, set only while a DeepSpeed op builds), ``deepspeed_import.py``
(``import deepspeed`` without the mlflow import of its autotuner: a second per process), ``host_reads.py`` (what a piece of code reads back
from the device: the syncs of a GPU step, found on any device), ``phases.py`` (a step's phases marked for the
profiler, and the table of where a step goes from a trace).

May import: ``roformer_dist.errors``, ``roformer_dist.config`` (the run directory mode), ``data_pipeline.atomic``
(the lock record's atomic write), the standard library, torch.distributed and tensorboard (lazily).

Start reading at ``stop.py``.
"""
