"""The training loop and its callbacks: a trainer that only loops, every other concern a callback.

Owns: ``trainer.py`` (``Trainer``: the step counter, the batches, the call to the runner, the stop decision),
``callback.py`` (the hooks, and the records they are handed: ``StepRequest``, ``StageRequest``, ``StepDone``),
``callbacks/`` (one concern per module, chosen by a table: metrics, checkpoints, evaluation, the hang watch,
stragglers, loss spikes and rollback, the profiler, the rotary measurement, fault injection), ``stage.py``
(``StageSwitch``: the one place a curriculum stage switch happens), ``restore.py`` (a trainer put back to a
checkpoint: a resume, a rollback), ``policies.py`` (when to log, save, evaluate and stop: pure), ``spikes.py``
(``SpikeGuard``: what a loss spike is: pure).

May import: ``observe``, ``plan``, ``hf``, ``checkpoint``, ``parallel``, ``nn``, ``runtime``, ``config``,
``errors``, ``data_pipeline``; ``launch`` only for annotations. Inside: ``trainer`` > ``callbacks`` >
``restore | stage`` > ``callback | spikes | policies`` (a callback never imports the trainer).

Start reading at ``trainer.py`` (the loop), then ``callback.py`` (the hooks), then ``callbacks/__init__.py``
(the table).
"""
