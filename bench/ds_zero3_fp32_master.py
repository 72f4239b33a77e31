"""Minimal reproduction (DeepSpeed only: no roformer-dist code in the engine it builds and checks): fp32 ZeRO-3
keeps two fp32 copies of each parameter shard.

DeepSpeed's ZeRO-3 optimizer (``runtime/zero/stage3.py``, ``_create_fp32_partitions``) means to use the
parameter shard itself as the fp32 master copy when the shard already has the master dtype and sits on
the optimizer's device::

    elif fp16_partitioned_groups_flat[i].dtype == master_weights_and_grads_dtype and \\
            fp16_partitioned_groups_flat[i].device == self.device:      # reuse the shard

but ``self.device`` is the accelerator's device *name*, a ``str`` (``"cpu"``, ``"cuda:0"``), and a
``torch.device`` never equals a ``str`` (``torch.device("cpu") == "cpu"`` is ``False``), so the branch is
never taken: the shard is cloned and fp32 training holds 4 more bytes per parameter shard than it needs
(10 instead of 8 bytes per parameter at 2 ranks: ``bench/zero_memory.py``). With the optimizer
offloaded (``offload_optimizer.device: cpu``) the code clones on purpose. No configuration reaches the
reusing branch; the fix belongs upstream (compare ``torch.device(self.device)``).

This script builds one fp32 ZeRO-3 engine on 1 gloo rank (CPU) for each configuration below, and
reports whether the master partition shares storage with the parameter shard:

    python bench/ds_zero3_fp32_master.py            # exit status 0; the table says "duplicated: yes"
    python bench/ds_zero3_fp32_master.py --tiny     # the same with 64-wide layers

Tested with DeepSpeed 0.19.8 and torch 2.13.
"""

from __future__ import annotations

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

import torch  # noqa: E402


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--width", type=int, default=512, help="in and out features of the model's two Linear layers")
    C.tiny_defaults(p, argv, width=64)
    return p.parse_args(argv)


def check(name: str, width: int, zero: dict, **top: object) -> dict:
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner

    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3, **zero}, "steps_per_print": 10**9, **top}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    zero3 = engine.optimizer
    shard = zero3.fp16_partitioned_groups_flat[0]     # the parameter shard (fp32 here, despite the name)
    master = zero3.fp32_partitioned_groups_flat[0]    # the optimizer's master partition
    out = {"config": name, "shard_dtype": str(shard.dtype), "master_dtype": str(master.dtype),
           "device_compared": f"{shard.device!r} == {zero3.device!r}",
           "equal": bool(shard.device == zero3.device),
           "duplicated": shard.untyped_storage().data_ptr() != master.untyped_storage().data_ptr(),
           "duplicate_bytes": master.numel() * master.element_size()}
    engine.destroy()
    return out


def main(argv=None) -> int:
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner
    import torch.distributed as dist

    a = parse_args(argv)
    C.torch_setup()
    C.init_single_rank()
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}; "
          f"torch.device('cpu') == 'cpu' -> {torch.device('cpu') == 'cpu'}")
    rows = [check("defaults", a.width, {}),
            check("offload_optimizer: cpu", a.width, {"offload_optimizer": {"device": "cpu"}},
                  zero_force_ds_cpu_optimizer=False)]
    print(f"{'config':<24}{'shard':>15}{'master':>15}  {'device comparison':<54}{'equal':>6}{'duplicated':>11}{'bytes':>10}")
    for r in rows:
        print(f"{r['config']:<24}{r['shard_dtype']:>15}{r['master_dtype']:>15}  {r['device_compared']:<54}"
              f"{str(r['equal']):>6}{'yes' if r['duplicated'] else 'no':>11}{r['duplicate_bytes']:>10}")
    dist.destroy_process_group()
    C.result("ds_zero3_fp32_master", deepspeed=deepspeed.__version__, reproduced=all(r["duplicated"] for r in rows),
             rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
