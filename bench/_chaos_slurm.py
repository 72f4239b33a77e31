"""bench/chaos.py --slurm: one job per variant on the local SLURM cluster (``slurm/local_cluster``), its fault
(a requeue, USR2 to the job, a node lost), resubmitted with the same command until it completes, then the
oracle."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from _chaos_launch import command, metrics, reference
from _chaos_oracle import oracle
from _common import REPO, child_env

SLURM_VARIANTS = {
    "requeue": "scontrol requeue while the job trains (1 node, 2 tasks)",
    "usr2": "scancel --signal=USR2 --full while the job trains (1 node, 2 tasks)",
    "node-loss": "node n2 of a 2-node job killed: its slurmd and every process of the job on it (2 nodes x 1 task)",
}
SLURM_LAYOUT = "zero2-async"
START = REPO / "slurm" / "local_cluster" / "start.sh"


def slurm_ready(nodes: int) -> str:
    """Why the SLURM variants cannot run, or '' (the local cluster of ``nodes`` nodes is up, started here if root)."""
    if shutil.which("sinfo") is None and os.geteuid() != 0:
        return "SLURM is not installed; slurm/local_cluster/start.sh installs and starts it (as root)"
    up = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True) \
        if shutil.which("sinfo") else None
    names = {line.split()[0] for line in up.stdout.splitlines()} if up is not None and up.returncode == 0 else set()
    if {f"n{i + 1}" for i in range(nodes)} <= names or (nodes == 1 and names):
        return ""
    if os.geteuid() != 0:
        return f"the local SLURM cluster with {nodes} node(s) is not up: slurm/local_cluster/start.sh --nodes {nodes}"
    r = subprocess.run(["bash", str(START), "--nodes", str(nodes)], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"slurm/local_cluster/start.sh --nodes {nodes} failed: {r.stdout[-500:]}"


def _job_env() -> dict:
    env = child_env(ROFORMER_STEP_DELAY_S="0.5", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _kill_node(job: str, node: str) -> str:
    """SIGKILL the slurmd of ``node`` and every process of ``job`` started on it (its tasks and their steps)."""
    victims = []
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = env_file.read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in env and f"SLURM_JOB_ID={job}".encode() in env:
            victims.append(int(env_file.parent.name))
    daemons = subprocess.run(["pgrep", "-f", f"slurmd -N {node}"], capture_output=True, text=True).stdout.split()
    for pid in [*map(int, daemons), *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"killed slurmd -N {node} ({len(daemons)}) and {len(victims)} process(es) of job {job} on it"


def _revive_node(node: str) -> None:
    subprocess.run(["slurmd", "-N", node], capture_output=True)
    for _ in range(150):
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout
        if re.search(r"idle|mixed|allocated", state):
            return
        if re.search(r"down|drain|fail", state):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        time.sleep(0.5)


def slurm_variant(variant: str, data: Path, out: Path, rng: random.Random, log) -> tuple[list[str], dict]:
    """One job under SLURM with one fault; resubmitted (the same command) until it completes. Returns the
    violations and a row of the table."""
    ref, _, _ = reference(data, out, SLURM_LAYOUT)
    run = out / f"slurm-{variant}"
    shutil.rmtree(run, ignore_errors=True)
    nodes, tasks = (2, 1) if variant == "node-loss" else (1, 2)
    train = command(data, run, SLURM_LAYOUT)
    cmd = [str(Path(sys.executable).parent / "roformer-submit"), *train[3:], "--profile", "local", "--nodes",
           str(nodes), "--tasks-per-node", str(tasks), "--wait"]
    bad, submits, attempts, detail = [], 0, 0, ""
    at_step = rng.randint(3, 10)
    while submits < 4:
        submits += 1
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=_job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        job = None
        while proc.poll() is None and time.monotonic() - t0 < 900:
            job = job or next((m.group(1) for m in map(lambda x: re.match(r"job_id: (\d+)$", x.strip()), list(lines))
                               if m), None)
            if job and not detail and len(metrics(run)) >= at_step:
                if variant == "requeue":
                    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
                    detail = f"scontrol requeue {job} at step {len(metrics(run))}"
                elif variant == "usr2":
                    subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True, capture_output=True)
                    detail = f"scancel --signal=USR2 --full {job} at step {len(metrics(run))}"
                else:
                    detail = _kill_node(job, "n2") + f" at step {len(metrics(run))}"
                    time.sleep(3)
                    _revive_node("n2")
                print(f"  [slurm {variant}] {detail}", flush=True)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            bad.append(f"slurm {variant}: roformer-submit --wait did not return within 900 s")
            if job:
                subprocess.run(["scancel", job], capture_output=True)
            break
        reader.join(timeout=10)
        text = "".join(lines)
        log.write(f"\n===== slurm {variant}, submit {submits}: rc={proc.returncode}\n{text}")
        if job:
            acct = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "JobID,State"],
                                  capture_output=True, text=True).stdout
            attempts += sum(1 for x in acct.splitlines() if x.split("|")[0] == job)
        for err in sorted((run / "logs").glob("*_log.err")):
            # node-loss: the surviving rank's failed collective ends its task with submitit's traceback
            if variant != "node-loss" and "Traceback" in err.read_text(errors="replace"):
                bad.append(f"slurm {variant}: a traceback in {err}")
        if proc.returncode == 0:
            break
        print(f"  [slurm {variant}] roformer-submit exited {proc.returncode}: submitting the same command again",
              flush=True)
    found = oracle(run, ref) if not bad else []
    bad += [f"slurm {variant}, at the end: {p}" for p in found]
    print(f"  [slurm {variant}] {submits} submission(s), {attempts} SLURM attempt(s); oracle: "
          f"{'ok' if not found else '; '.join(found)[:600]}", flush=True)
    return bad, {"variant": variant, "fault": detail, "submissions": submits, "attempts": attempts,
                 "violations": len(bad)}
