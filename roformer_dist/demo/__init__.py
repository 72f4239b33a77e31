"""The demo's recipe as library code (``make demo`` is ``cli/demo.py``, which parses its flags, chains the
steps and prints; the benches that train on the demo's data or draw its downstream curves use this too).

Owns: ``data.py`` (the demo's data: People's Daily and the reviews split, tokenised and sharded once into the
directories of ``configs/experiments/demo.yaml``, reused by recipe; ``data_overrides`` to move them; the NER
task beside them; ``DemoError``), ``tasks.py`` (the two downstream tasks as data: the seeded sentiment and
NER splits and their jsonl files), ``results.py`` (the last evals read back, the curves PNG, the downstream
fine-tunings against random initialisation and a baseline, each kept with its command line).

May import: ``roformer_dist.finetune``, ``train``, ``checkpoint``, ``runtime``, ``config``, ``errors``,
``data_pipeline``; the project's console scripts run as subprocesses (``roformer-data``).

Start reading at ``data.py``.
"""
