"""Fine-tuning of pretrained (or fresh) RoFormer encoders for sequence classification, and an n-gram
baseline: ``roformer-finetune`` (see :mod:`roformer_dist.finetune.cli`).

``run(argv) -> dict`` runs the command in-process and returns the content of results.json.
"""

from roformer_dist.finetune.cli import main, run

__all__ = ["run", "main"]
