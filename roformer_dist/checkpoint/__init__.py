"""Checkpoints: the files a run leaves behind and everything that reads them.

Owns: ``store.py`` (the layout of ``run_dir/checkpoints/``, saving with ``COMPLETE`` and ``latest``,
checking files, marking ``BAD``, pruning, and :func:`~roformer_dist.checkpoint.store.resolve`: the one
answer to "which checkpoint does this path name" for training, ``to-hf``, ``roformer-eval`` and
fine-tuning), ``safe_load.py`` (loading checkpoint files without running code stored in them),
``trainer_state.py`` (the ``trainer_state_rank<r>.pt`` payload), ``compat.py`` (may this
run resume from that checkpoint), ``weights.py`` (the weights file format, and consolidated fp32
weights out of any ZeRO stage or layout), ``universal.py`` (DeepSpeed's universal format for a resume
at another world size), ``lineage.py`` (``parent.json``: what a warm-started run came from), ``write_errors.py`` (why a write failed),
``async_save.py`` (``checkpoint.async``: the same save protocol with the writing in a background thread),
``checksums.py`` (the files' content hashes that ``COMPLETE`` records and every reader checks).

May import: ``roformer_dist.parallel``, ``nn``, ``runtime``, ``config``, ``errors``, ``data_pipeline``;
deepspeed lazily.

Start reading at ``store.py``.
"""
