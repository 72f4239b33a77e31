"""DeepSpeed's universal checkpoint format, made on demand for a resume at another world size.

:func:`to_universal` converts ``step_XXXXXXXX/`` of a ZeRO 1-3 run into ``step_XXXXXXXX/universal/``
once (``universal/DONE`` marks a finished conversion; a half-done one is redone), on rank 0 only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from data_pipeline.atomic import StagedDir, atomic_write_text
from roformer_dist.checkpoint.safe_load import weights_only_loads
from roformer_dist.runtime.deepspeed_import import import_deepspeed

__all__ = ["UNIVERSAL", "to_universal"]

log = logging.getLogger(__name__)

UNIVERSAL = "universal"


def to_universal(ckpt_dir: Path, zero_stage: int) -> Path:
    """Convert a ZeRO 1-3 checkpoint to DeepSpeed's universal format once (idempotent); rank 0 only."""
    out = ckpt_dir / UNIVERSAL
    done = out / "DONE"
    if done.exists():
        return out
    from argparse import Namespace

    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    with StagedDir(out) as stage:  # a half-done conversion (no DONE) is replaced as a whole
        args = Namespace(input_folder=str(ckpt_dir), output_folder=str(stage.path), num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True,
                         inject_missing_state=zero_stage in (1, 2))
        log.info("converting %s to the universal format (ZeRO-%d)", ckpt_dir, zero_stage)
        with weights_only_loads():  # the conversion reads the ZeRO files without running their pickles
            ds_to_universal.main(args)
        atomic_write_text(stage.path / "DONE", "ok\n")
        stage.commit()
    return out
