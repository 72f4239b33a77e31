"""``import deepspeed`` without the mlflow import DeepSpeed makes on the way: :func:`import_deepspeed`.

DeepSpeed's autotuner (``deepspeed.autotuning.autotuner``, imported by ``import deepspeed`` itself) imports
mlflow at module level when it is installed, which it is wherever the ``mlflow`` sink is (the dev and CI
environments). That costs about a second in every process that imports DeepSpeed (measured: ``import
deepspeed`` 2.3 s without it, 3.3 s with it; CPU, this project's venv) and the project never autotunes.
So the first import of DeepSpeed in a process goes through here, with mlflow hidden for its duration
(``sys.modules["mlflow"] = None`` makes ``import mlflow`` raise ImportError, which the autotuner takes for
"not installed"). Afterwards mlflow imports as usual (the mlflow sink imports it when opened).
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["import_deepspeed"]


def import_deepspeed() -> ModuleType:
    """The ``deepspeed`` module, imported now if it was not (see the module docstring)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", ModuleType("x")) is None:
            del sys.modules["mlflow"]
    return deepspeed
