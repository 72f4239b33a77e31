"""Distribution around the model: DeepSpeed ZeRO and tensor x pipeline x data parallelism, applied
from outside ``roformer_dist.nn``.

Owns: ``topology.py`` (``Layout``: degrees, rank -> (pp, dp, tp); ``ParallelDims``: the process groups,
DeepSpeed's mpu; ``check_layout``), ``tensor.py`` (Megatron-style sharded modules, ``parallelize``,
vocab-parallel loss), ``pipeline.py`` (the model as a DeepSpeed ``PipelineModule``, tied embedding and
decoder), ``engine.py`` (the DeepSpeed config, the optimizer's choice, DeepSpeed's op builds and ``build_engine``:
the one place DeepSpeed is wired up), ``runner.py`` (``build_parallel_engine`` -> ``ParallelRunner``: one optimizer step, eval steps,
checkpoint files through the engine), ``snapshot.py`` (a DeepSpeed save into host memory, for
asynchronous checkpoints), ``compiled.py`` (``trainer.compile``: the model compiled once per stage, its
cache directory), ``consolidate.py`` (merging tensor-parallel shards).

May import: ``roformer_dist.nn``, ``runtime`` (the op builds' environment, the collectives), ``config``,
``errors``; deepspeed lazily.

Start reading at ``runner.py``.
"""
