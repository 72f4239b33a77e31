"""Tensor x pipeline x data parallelism for RoFormer, applied from outside the model.

    topology.py     Layout (degrees, rank -> (pp, dp, tp)), ParallelDims (groups; DeepSpeed's mpu),
                    check_layout (config checks naming the key)
    tensor.py       Megatron-style sharded modules, parallelize(model, dims), vocab-parallel loss
    pipeline.py     the model as a DeepSpeed PipelineModule (tied embedding / decoder)
    runner.py       build_parallel_engine(cfg, model, stage, world_size) -> (engine, ParallelRunner)
    consolidate.py  merge_model_shards(shards) -> the plain model's state dict

``consolidate_state_dict(ckpt_dir)`` (reads a checkpoint's shard files, then merges them) belongs to the
checkpoint layer, ``roformer_dist.checkpoint``; it is importable from here too.
"""

from roformer_dist.parallel.runner import ParallelRunner, build_parallel_engine
from roformer_dist.parallel.tensor import TensorParallelMLM, parallelize
from roformer_dist.parallel.topology import Coord, Layout, ParallelDims, check_layout

__all__ = ["Coord", "Layout", "ParallelDims", "check_layout", "parallelize", "TensorParallelMLM",
           "build_parallel_engine", "ParallelRunner", "consolidate_state_dict"]


def __getattr__(name: str):
    if name == "consolidate_state_dict":  # lazily: the checkpoint layer imports this package's modules
        from roformer_dist.checkpoint import consolidate_state_dict

        return consolidate_state_dict
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
