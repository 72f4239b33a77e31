"""Fine-tuning a pretrained (or fresh) encoder for sequence classification, and the n-gram baseline.

Owns: ``run.py`` (``roformer-finetune``'s parser and ``run(argv) -> dict``, the content of
results.json), ``models.py`` (the classifier for an HF export, a checkpoint or a weights file;
pooling), ``train.py`` (the loop; DDP under torchrun), ``data.py`` (jsonl/tsv readers), ``ngram.py``
(naive Bayes), ``metrics.py``.

May import: ``roformer_dist.hf``, ``checkpoint``, ``nn``, ``runtime``, ``config``, ``errors``,
``data_pipeline``; transformers lazily.

Start reading at ``run.py``.
"""
