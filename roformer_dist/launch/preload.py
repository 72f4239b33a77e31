"""What a training rank imports, for a process that forks ranks to import once: ``roformer-train``'s
(``launch/spawn.py``) and the fork server of ``roformer_dist.testing.run_distributed``. torch, torch's dynamo (torch's optimizers import it when the first one
is built), the trainer and, with DeepSpeed's CPU accelerator, DeepSpeed.

Nothing here may touch CUDA: a process that initialised CUDA cannot fork a process that uses it. On a GPU,
DeepSpeed (whose accelerator asks the device at import) is left to the ranks, and so is everything else of
torch.cuda (``tests/test_startup.py`` imports this module with CUDA's entry points watched)."""

import os

import torch._dynamo  # noqa: F401

import roformer_dist.launch.entry  # noqa: F401
from roformer_dist.runtime.deepspeed_import import import_deepspeed

if os.environ.get("DS_ACCELERATOR") == "cpu":
    import_deepspeed()
