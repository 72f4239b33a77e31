"""``import deepspeed`` without what DeepSpeed imports on the way and this project never uses:
:func:`import_deepspeed`.

- mlflow: DeepSpeed's autotuner (``deepspeed.autotuning.autotuner``, imported by ``import deepspeed`` itself)
  imports mlflow at module level when it is installed, which it is wherever the ``mlflow`` sink is (the dev
  and CI environments). That cost about a second in every process that imports DeepSpeed (measured: ``import
  deepspeed`` 2.3 s without it, 3.3 s with it; CPU, this project's venv), and the project never autotunes. So
  the first import of DeepSpeed in a process goes through here, with mlflow hidden for its duration
  (``sys.modules["mlflow"] = None`` makes ``import mlflow`` raise ImportError, which the autotuner takes for
  "not installed"). Afterwards mlflow imports as usual (the mlflow sink imports it when opened).
- Muon: every ZeRO engine DeepSpeed builds imports its Muon optimizer (to ask ``isinstance(optimizer,
  MuonWithAuxAdam)``), whose module compiles three functions at import, which imports torch's inductor: about
  a second of every rank's start-up, for an optimizer no setting of this project chooses. With the DeepSpeed
  this project is tested with (0.19), its two Muon modules are replaced by stand-ins (:data:`MUON_MODULES`)
  whose ``MuonWithAuxAdam`` no optimizer is an instance of; anything that would run Muon raises. Another
  DeepSpeed version imports its own.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["import_deepspeed", "MUON_MODULES"]

MUON_MODULES = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")
"""DeepSpeed's Muon modules, replaced by stand-ins in this process (see the module docstring)."""


def import_deepspeed() -> ModuleType:
    """The ``deepspeed`` module, imported now if it was not (see the module docstring)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    if "DS_ACCELERATOR" not in os.environ:  # its accelerator, chosen at import: said rather than guessed (a warning)
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", ModuleType("x")) is None:
            del sys.modules["mlflow"]
    if deepspeed.__version__.startswith("0.19.") and not any(m in sys.modules for m in MUON_MODULES):
        for name in MUON_MODULES:
            sys.modules[name] = _muon_stand_in(name)
    return deepspeed


def _muon_stand_in(name: str) -> ModuleType:
    import torch

    class MuonWithAuxAdam(torch.optim.Optimizer):
        """DeepSpeed's Muon is not loaded in this process (``roformer_dist.runtime.deepspeed_import``)."""

        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"{name} is a stand-in in roformer-dist's ranks: Muon is not used here")

    def not_loaded(*args, **kwargs):
        raise NotImplementedError(f"{name} is a stand-in in roformer-dist's ranks: Muon is not used here")

    module = ModuleType(name, "A stand-in for DeepSpeed's Muon module (roformer_dist.runtime.deepspeed_import).")
    module.MuonWithAuxAdam = MuonWithAuxAdam
    module.muon_update = module.adam_update = not_loaded
    return module
