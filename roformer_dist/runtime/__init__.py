"""The process around a run: stop signals, the run lock, the process group, fault injection.

Owns: ``stop.py`` (SIGTERM / SIGINT / USR2 as a stop request; a second Ctrl-C aborts; ranks die with
their launcher), ``runlock.py`` (one writer per run directory; stale locks detected), ``rundir.py``
(run directories created with a safe mode; foreign, group-writable or symlinked ones refused),
``process_group.py`` (the one torch.distributed bootstrap of training and fine-tuning, ``DistEnv``, gloo's
interface from NCCL's, the checkpoint layer's collectives), ``ports.py`` (``free_port``, without torch: a
launcher picks the port before it imports torch), ``faults.py`` (the fault hooks tests and the fault campaign set
through the environment), ``heartbeat.py`` (each rank's progress and the watchdog that ends a hung launch), ``events.py`` (a run's TensorBoard scalars read back), ``jit_builds.py``
(torch's JIT extension builds before DeepSpeed loads its ops: a directory per Python environment, locks
left by killed builds removed, live builds waited for), ``cuda_arch.py`` (``TORCH_CUDA_ARCH_LIST`` as
DeepSpeed's op builder reads it, set only while a DeepSpeed op builds), ``deepspeed_import.py``
(``import deepspeed`` without the mlflow import of its autotuner, and with stand-ins for its Muon modules,
whose import compiles: seconds per process), ``host_reads.py`` (what a piece of code reads back
from the device, and its explicit synchronizations: the syncs of a GPU step, found on any device), ``phases.py`` (a step's phases marked for the
profiler, and the table of where a step goes from a trace).

May import: ``roformer_dist.errors``, ``roformer_dist.config`` (the run directory mode), ``data_pipeline.atomic``
(the lock record's atomic write), the standard library, torch.distributed and tensorboard (lazily).

Start reading at ``stop.py``.
"""
