"""The port a SLURM job's rank 0 listens on (``launcher/job.py``), and a port that another process holds.

A job's tasks derive MASTER_PORT from the job id and the attempt, without talking. Drawn in Linux's ephemeral
range, it was now and then held at that moment by the local end of some outgoing connection: rank 0 could not
listen (EADDRINUSE), said that another rank was gone, and the other ranks waited for it until the job was ended.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from launcher.job import MASTER_PORTS, _master_port
from roformer_dist.errors import EXIT_ENVIRONMENT, EnvironmentSetupError, exit_status
from roformer_dist.runtime.process_group import DistEnv, init_process_group, peer_lost, port_in_use


def test_master_ports_are_drawn_below_the_ephemeral_range_the_same_on_every_task(monkeypatch):
    ports = {}
    for attempt in range(4):
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(attempt))
        for job in range(1000, 1500):
            port = _master_port(str(job))
            assert MASTER_PORTS[0] <= port <= MASTER_PORTS[1] < 32768, port
            assert _master_port(str(job)) == port  # every task of the attempt derives the same one
            ports[job, attempt] = port
    assert len(set(ports.values())) > 1500  # spread over the range
    assert sum(ports[j, 0] != ports[j, 1] for j in range(1000, 1500)) > 490  # a requeued attempt: another port


def test_a_held_master_port_is_said_as_such_not_as_a_lost_peer():
    """What rank 0 raises when another process listens on its MASTER_PORT (torch's own TCPStore, here): a port
    in use, not a lost peer; a rendezvous whose peer went away stays a lost peer."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        try:
            dist.TCPStore("127.0.0.1", holder.getsockname()[1], 1, True, timeout=datetime.timedelta(seconds=10))
        except RuntimeError as e:
            raised = e
        else:
            raise AssertionError("the store listened on a port another socket holds")
    finally:
        holder.close()
    assert "EADDRINUSE" in str(raised) and port_in_use(raised) and not peer_lost(raised), raised
    gone = dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
    assert peer_lost(gone) and not port_in_use(gone)


def test_rank_0_on_a_held_port_is_one_error_naming_the_port_not_a_traceback(monkeypatch):
    """A local launch draws a free port and hands it to its ranks; another process may take it before rank 0
    listens (two launches on one machine). Rank 0 then says so (the launcher prints the message, the launch exits
    EXIT_ENVIRONMENT) instead of raising torch's DistNetworkError."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        with pytest.raises(EnvironmentSetupError, match=rf"rank 0: MASTER_PORT {port} on 127.0.0.1 is held by another "
                                                        r"process \(EADDRINUSE\).*Run the same command again") as got:
            init_process_group(DistEnv(0, 2, 0), "gloo", timeout_s=10)
    finally:
        holder.close()
    assert not dist.is_initialized()
    assert exit_status(got.value) == EXIT_ENVIRONMENT and port_in_use(got.value) and not peer_lost(got.value)
