"""Fine-tuning a pretrained (or fresh) encoder for sequence classification or token classification (named
entities), and the baselines beside it.

Owns: ``run.py`` (``roformer-finetune``'s parser and ``run(argv) -> dict``, the content of
results.json), ``models.py`` (the classifier for an HF export, a checkpoint or a weights file; pooling; the
token head), ``tasks.py`` (what differs between the sentence tasks and the token task: encoding, targets,
loss, predictions, dev scores), ``train.py`` (the one loop; DDP under torchrun), ``data.py`` (jsonl/tsv
sentence readers), ``token_data.py`` (jsonl/CoNLL entity readers), ``entities.py`` (BIO tags <-> character
spans through piece offsets; entity precision/recall/F1), ``ngram.py`` (naive Bayes), ``dictionary.py``
(the longest-match entity baseline), ``metrics.py``.

May import: ``roformer_dist.hf``, ``checkpoint``, ``nn``, ``runtime``, ``config``, ``errors``,
``data_pipeline``; transformers lazily.

Start reading at ``run.py``.
"""
