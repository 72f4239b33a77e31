"""The torch.distributed bootstrap (``runtime/process_group.py``): gloo's interface follows NCCL's.

A job on NCCL also runs gloo (the runner's host-side sums). Where GLOO_SOCKET_IFNAME is unset, gloo binds to
the address the hostname resolves to, 127.0.1.1 on many SLURM nodes, and its group hangs across nodes; the
bootstrap sets it from NCCL_SOCKET_IFNAME (prefixes or exact names; an exclusion list is left to the user)."""

from __future__ import annotations

import logging

import torch.distributed as dist

from roformer_dist.runtime.process_group import DistEnv, free_port, gloo_interface, init_process_group

HOST = ["lo", "eth0", "ib0", "ib1"]


def test_gloos_interface_is_taken_from_nccls_where_unset():
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib"}, HOST)[0] == "ib0"             # a prefix: the first match
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "=eth0"}, HOST)[0] == "eth0"         # an exact name
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "en,eth"}, HOST)[0] == "eth0"        # a list of prefixes
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "=eth"}, HOST) == (
        None, "NCCL_SOCKET_IFNAME==eth matches none of this host's interfaces (lo, eth0, ib0, ib1); "
              "GLOO_SOCKET_IFNAME left unset")
    name, note = gloo_interface({"NCCL_SOCKET_IFNAME": "^docker,lo"}, HOST)
    assert name is None and "set GLOO_SOCKET_IFNAME" in note
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, HOST) == (None, "")  # the user's
    assert gloo_interface({}, HOST) == (None, "")


def test_the_bootstrap_sets_it_and_the_group_works_on_it(monkeypatch, caplog):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with caplog.at_level(logging.INFO, logger="roformer_dist.runtime.process_group"):
        assert init_process_group(DistEnv(0, 1, 0), "gloo", timeout_s=60) == "gloo"
    try:
        import os

        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
        assert "GLOO_SOCKET_IFNAME=lo (from NCCL_SOCKET_IFNAME=lo)" in caplog.text
        dist.barrier()
    finally:
        dist.destroy_process_group()
