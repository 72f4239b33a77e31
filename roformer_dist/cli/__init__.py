"""Every command's ``main``, thin: parse the arguments, call the library, and let
:func:`roformer_dist.errors.run_command` turn our errors into one line and their exit status.

``train.py`` (``roformer-train``), ``convert.py`` (``roformer-convert``), ``eval.py``
(``roformer-eval``), ``finetune.py`` (``roformer-finetune``), ``demo.py`` (``make demo``).
``roformer-data`` and ``roformer-submit`` live with their packages (``data_pipeline.cli``,
``launcher.cli``). Every parser is a :class:`data_pipeline.command_line.CommandParser`: options and
positionals (``key.sub=value`` overrides) in any order, and ``--version``.

May import: everything in ``roformer_dist`` and ``data_pipeline``; heavy libraries lazily, after the
stop handlers are installed (``roformer-train``).
"""
