"""What a run and its checkpoints are observed with: metrics and where they go, evaluation against baselines,
profiles, length reports, plots.

Owns: ``metrics.py`` (rank 0's sinks, MFU), ``sinks/`` (where metrics go: the ``Sink`` protocol and its table;
``jsonl``, ``tensorboard``, ``mlflow``, ``wandb``), ``evaluation.py`` (eval at each length beside the
baselines), ``baselines.py`` (unigram and most-frequent-token baselines), ``stragglers.py`` (each rank's own
times compared: the slowest named), ``profiling.py`` (the ``torch.profiler`` window of ``trainer.profile``),
``length_report.py`` (a checkpoint's loss at any length: ``roformer-eval``'s work), ``plots.py`` (line charts
as PNG: the demo's curves, the benches' figures; matplotlib lazily).

May import: ``plan``, ``checkpoint``, ``parallel``, ``nn``, ``runtime``, ``config``, ``errors``,
``data_pipeline``.

Start reading at ``metrics.py``, then ``evaluation.py``.
"""
