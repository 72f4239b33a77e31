"""A run's schedule and data, as pure decisions: the curriculum, the corpus mixture, the data's checks.

Owns: ``curriculum.py`` (stage and learning rate at a step: pure), ``decay_branch.py`` (``init.decay_steps``: a
run that resumes a stable checkpoint and decays), ``mixture.py`` (the corpus mixture's plan: shares per stage,
draws, epochs, repetition caps), ``data.py`` (manifests checked against the config, loader errors).

May import: ``checkpoint``, ``parallel``, ``nn``, ``runtime``, ``config``, ``errors``, ``data_pipeline``.

Start reading at ``curriculum.py``.
"""
