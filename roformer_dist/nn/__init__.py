"""The model, on one device: RoFormer for masked language modelling, knowing nothing of distribution.

Owns: ``model.py`` (``RoFormerForMaskedLM``: embeddings, post-LN layers, tied MLM head, the loss at
the predicted positions only), ``attention.py`` (the projections laid out for an attention kind: packed
documents, rotary on v), ``attention_kinds/`` (``model.attention``: each kind one module, chosen by a table:
softmax through SDPA, linear attention),
``documents.py`` (packed documents kept apart: length blocks, a block-diagonal mask or a varlen
layout, and per-document positions, from the document numbers in the mask; planned on the host, built on
the device), ``rotary.py`` (the one rotary convention, adjacent pairs (2i, 2i+1), its tables and every
faster backend tested against the reference), ``rotary_triton.py`` (the Triton kernel),
``rotary_tune.py`` (``rotary_backend: auto`` by measurement, and the cache of its choices).

May import: torch, ``roformer_dist.config``, ``roformer_dist.errors``, the data pipeline's ``IGNORE_INDEX`` (the labels' contract)
and ``data_pipeline.atomic`` (the measured choices' file); optional kernels (triton, apex, flash-attn)
lazily. Nothing of DeepSpeed, ``torch.distributed`` or the rest of the package.

Start reading at ``model.py``.
"""
