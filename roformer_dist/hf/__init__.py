"""Hugging Face transformers in and out.

Owns: ``convert.py`` (our state dict <-> ``transformers.RoFormerForMaskedLM``, configs both ways),
``export.py`` (a whole HF repository from our weights: ``roformer-convert to-hf``), ``tokenizer.py``
(our SentencePiece model as a fast ``tokenizer.json``, and the agreement check), ``model_card.py``.

May import: ``roformer_dist.checkpoint``, ``nn``, ``runtime`` (TensorBoard events, for the model card), ``config``,
``errors``, ``data_pipeline``; transformers and tokenizers lazily.

Start reading at ``export.py``.
"""
