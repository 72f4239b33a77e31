"""roformer-dist: RoFormer masked-language-model pretraining on SLURM clusters.

The names a user imports (loaded on first use, so that ``import roformer_dist`` stays cheap)::

    from roformer_dist import load_config, Config, RoFormerForMaskedLM, run_rank
    cfg = load_config("configs/experiments/debug.yaml", ["trainer.stop_at_step=10"])

The package, by concern (each subpackage's docstring says what it owns, what it may import and where
to start reading; the import direction is checked by ``lint-imports``, see pyproject.toml)::

    cli/         every command's main             (top: may import everything below)
    finetune/    sequence classification on a pretrained encoder
    hf/          Hugging Face transformers in and out
    train/       the rank entry point, the loop, curriculum, metrics, evaluation
    checkpoint/  the checkpoint store, trainer state, resume checks, weights files
    parallel/    DeepSpeed engine, tensor x pipeline x data parallelism
    nn/          the model on one device          runtime/  signals, run lock, process group
    config/      the one config tree: schema, loading, validation, derived values
    errors.py    error classes and exit statuses
    testing.py   multi-process helpers for tests and benches

Below the package: ``data_pipeline`` (corpus -> tokenizer -> shards -> loader), which imports
nothing of it; above it: ``launcher`` (``roformer-submit``, SLURM).
"""

__all__ = ["Config", "load_config", "RoFormerForMaskedLM", "run_rank"]


def __getattr__(name: str):
    if name in ("Config", "load_config"):
        from roformer_dist import config

        return getattr(config, name)
    if name == "RoFormerForMaskedLM":
        from roformer_dist.nn.model import RoFormerForMaskedLM

        return RoFormerForMaskedLM
    if name == "run_rank":
        from roformer_dist.launch.entry import run_rank

        return run_rank
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
