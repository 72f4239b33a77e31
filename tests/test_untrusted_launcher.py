"""roformer-submit with untrusted inputs: config strings that would inject batch-script lines, secrets
given by reference, job ids read back from ``logs/jobs.jsonl``, the local cluster's root directory, and
the modes of what the launcher writes (docs/guides/security.md).

No cluster needed: stand-in ``sbatch``/``scancel``/``squeue``/``sacct`` record their arguments (as in
test_launcher.py); the local cluster's scripts are checked up to the point where they would start
anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import cli, profiles
from roformer_dist.config import load_config
from roformer_dist.errors import ConfigError
from test_launcher import BIN, DEBUG, ROOT, job_env, run_submit, shard_stub, submit_cmd  # noqa: F401 (fixture)

LOCAL_CLUSTER = ROOT / "slurm" / "local_cluster"
SECRET = "s3cr3t-token-value"


@pytest.fixture
def tools(tmp_path):
    """Stand-in SLURM commands on PATH: each appends its arguments to ``calls/<name>``; sbatch also its
    SLURM_UMASK and umask, and answers as SLURM does."""
    bindir, calls = tmp_path / "fakebin", tmp_path / "calls"
    bindir.mkdir()
    calls.mkdir()
    for name in ("scancel", "squeue", "sacct", "srun"):
        (bindir / name).write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls / name}\n')
    (bindir / "sbatch").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls / "sbatch"}\n'
                                   f'echo "$SLURM_UMASK $(umask)" > {calls / "sbatch_umask"}\n'
                                   "echo 'Submitted batch job 4242'\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = job_env(PATH=f"{bindir}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("SBATCH_EXPORT", None)
    env.pop("SLURM_UMASK", None)

    class Tools:
        pass

    t = Tools()
    t.env, t.calls, t.bindir = env, calls, bindir
    t.called = lambda name: (calls / name).read_text().splitlines() if (calls / name).exists() else []
    return t


def _profile(tmp_path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def _no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr, p.stderr


# --------------------------------------------------------------------------- 1. lines injected into the script


@pytest.mark.parametrize("flag", ["--partition", "--account", "--qos", "--constraint"])
def test_a_newline_in_a_slurm_name_is_a_config_error_naming_the_key(shard_stub, tmp_path, tools, flag):
    """`--partition $'debug\\nid'` used to put `id` on a line of its own in the batch script."""
    run_dir = tmp_path / "run"
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--cluster", "slurm", flag, "debug\nid",
                              "--dry-run"), tools.env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"slurm.{flag[2:]}" in p.stderr and "control character" in p.stderr, p.stderr
    _no_traceback(p)
    assert "\nid\n" not in p.stdout and not tools.called("sbatch") and not run_dir.exists()


@pytest.mark.parametrize("override, key", [
    ("slurm.partition=debug;id", "slurm.partition"),
    ("slurm.account=acct id", "slurm.account"),
    ("slurm.qos=normal'x", "slurm.qos"),
    ("slurm.constraint=a100 && id", "slurm.constraint"),
    ("slurm.partition=debug\rid", "slurm.partition"),
    ("slurm.constraint=a\x00b", "slurm.constraint"),
    ("slurm.setup=[\"module load x\\nid\"]", "slurm.setup[0]"),
    ("slurm.env={\"A;id\": x}", "slurm.env"),
    ("slurm.env={\"1A\": x}", "slurm.env"),
    ("slurm.env={A: \"$(id)\"}", "slurm.env.A"),
    ("slurm.env={A: \"`id`\"}", "slurm.env.A"),
    ("slurm.env={A: \"${HOME:-$(id)}\"}", "slurm.env.A"),
    ("slurm.env={A: \"${HOME:-/x}\"}", "slurm.env.A"),
    ("slurm.env={A: \"x\\ny\"}", "slurm.env.A"),
    ("slurm.env={A: \"x\\ty\"}", "slurm.env.A"),
    ("slurm.env_from={\"A B\": X}", "slurm.env_from"),
    ("slurm.env_from={A: \"$X\"}", "slurm.env_from.A"),
    ("slurm.exclude=[\"n1,n2\"]", "slurm.exclude[0]"),
    ("slurm.exclude=[n1, \"n2;id\"]", "slurm.exclude[1]"),
    ("slurm.max_hang_requeues=-1", "slurm.max_hang_requeues"),
    ("run_dir=/tmp/run\nid", "run_dir"),
])
def test_strings_that_reach_the_batch_script_are_validated(shard_stub, override, key):
    with pytest.raises(ConfigError) as e:
        profiles.resolve(str(DEBUG), [f"data.shards={shard_stub.dir}", override], profiles.JobFlags(profile="local"))
    assert str(e.value).startswith(f"{key}:") or f" {key}:" in str(e.value), e.value


def test_a_value_in_slurm_env_and_env_from_is_refused():
    with pytest.raises(ConfigError, match=r"slurm\.env_from\.A: also set in slurm\.env"):
        load_config(DEBUG, ["slurm.env={A: x}", "slurm.env_from={A: B}"])


def test_sane_slurm_names_and_constraints_pass():
    cfg = load_config(DEBUG, ["slurm.partition=gpu,gpu-long", "slurm.account=proj_1.x", "slurm.qos=high-prio",
                              "slurm.constraint=[rack1*2&rack2*4]|(a100:2,h100)"])
    assert cfg.slurm.constraint == "[rack1*2&rack2*4]|(a100:2,h100)"


def test_env_values_expand_only_variables_in_the_batch_shell(tmp_path):
    """$NAME / ${NAME} expand as the profiles expect ($HOME); quotes, backslashes and stray $ stay literal."""
    values = {"A": "$HOME/cache", "B": "${HOME}x", "C": 'say "hi" \\ back', "D": "cost $5, $$ and $", "E": "it's"}
    cfg = load_config(DEBUG, ["slurm.env=" + json.dumps(values)])
    lines = profiles.setup_lines(cfg)
    script = "\n".join([*lines, *(f'printf "%s\\n" "${k}"' for k in values)])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                         env={"HOME": "/home/u", "PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["/home/u/cache", "/home/ux", 'say "hi" \\ back', "cost $5, $$ and $", "it's"]
    assert "$(" not in "\n".join(lines) and "`" not in "\n".join(lines)


def test_the_batch_script_holds_no_command_substitution_and_no_injected_line(shard_stub, tmp_path, tools):
    """Dry run and the script submitit really writes: every line is one we expect, and no `$(` anywhere
    (the USR2 trap used to carry one)."""
    prof = _profile(tmp_path, "partition: debug\nnodes: 1\ntasks_per_node: 2\ntime_min: 30\nsignal_delay_s: 30\n"
                              "env:\n  TORCH_EXTENSIONS_DIR: $HOME/ext\n  ODD: 'a \"b\" $5 \\ c'\n"
                              "env_from:\n  WANDB_API_KEY: MY_TOKEN\n"
                              "setup:\n  - module load cuda\n")
    tools.env["MY_TOKEN"] = SECRET
    run_dir = tmp_path / "run"
    dry = run_submit(submit_cmd(shard_stub, run_dir, "--profile", str(prof), "--cluster", "slurm", "--dry-run"),
                     tools.env)
    assert dry.returncode == 0, dry.stderr
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", str(prof), "--cluster", "slurm"), tools.env)
    assert p.returncode == 0, p.stderr
    real = (run_dir / "logs" / "4242_submission.sh").read_text()
    for script in (dry.stdout, real):
        assert "$(" not in script and "`" not in script, script
        setup = script.split("# setup\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert setup == [profiles.USR2_TRAP, 'export TORCH_EXTENSIONS_DIR="$HOME/ext"',
                         'export ODD="a \\"b\\" \\$5 \\\\ c"',
                         'export WANDB_API_KEY="${MY_TOKEN?is not set: slurm.env_from.WANDB_API_KEY reads it from '
                         'the environment of roformer-submit}"',
                         "module load cuda"], setup
        for line in script.splitlines():
            assert line == "" or line.startswith(("#", "export ", "trap ", "module ", "srun ")), line


# --------------------------------------------------------------------------- 2. secrets by reference


def test_env_from_writes_names_never_values(shard_stub, tmp_path, tools):
    """The token is in no file of the run directory: not config.yaml, the script, the pickle, jobs.jsonl."""
    tools.env["WANDB_API_KEY"] = SECRET
    run_dir = tmp_path / "run"
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--cluster", "slurm",
                              "slurm.env_from={WANDB_API_KEY: WANDB_API_KEY}"), tools.env)
    assert p.returncode == 0, p.stderr
    files = [f for f in run_dir.rglob("*") if f.is_file() and not f.is_symlink()]
    assert {"config.yaml", "4242_submission.sh", "4242_submitted.pkl", "jobs.jsonl"} <= {f.name for f in files}
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f
    script = (run_dir / "logs" / "4242_submission.sh").read_text()
    assert ': "${WANDB_API_KEY?is not set' in script, "equal names: only a check, no export of a value"


def test_env_from_must_be_set_when_submitting(shard_stub, tmp_path, tools):
    tools.env.pop("MY_TOKEN", None)
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--profile", "local", "--cluster", "slurm",
                              "slurm.env_from={WANDB_API_KEY: MY_TOKEN}", "--dry-run"), tools.env)
    assert p.returncode == 2 and "slurm.env_from.WANDB_API_KEY: MY_TOKEN is not set" in p.stderr, p.stderr
    _no_traceback(p)
    tools.env.update(MY_TOKEN=SECRET, SBATCH_EXPORT="NONE")
    p = run_submit(submit_cmd(shard_stub, tmp_path / "run", "--profile", "local", "--cluster", "slurm",
                              "slurm.env_from={WANDB_API_KEY: MY_TOKEN}", "--dry-run"), tools.env)
    assert p.returncode == 2 and "SBATCH_EXPORT=NONE keeps MY_TOKEN from the job" in p.stderr, p.stderr


def test_check_submit_env_reads_sbatch_export():
    s = load_config(DEBUG, ["slurm.env_from={K: T}"]).slurm
    profiles.check_submit_env(s, "slurm", {"T": "x"})
    profiles.check_submit_env(s, "slurm", {"T": "x", "SBATCH_EXPORT": "ALL,FOO=1"})
    profiles.check_submit_env(s, "slurm", {"T": "x", "SBATCH_EXPORT": "PATH,T"})
    profiles.check_submit_env(s, "local", {"T": "x", "SBATCH_EXPORT": "NONE"})
    with pytest.raises(ConfigError, match="slurm.env_from.K"):
        profiles.check_submit_env(s, "slurm", {"T": "x", "SBATCH_EXPORT": "PATH,HOME"})


def test_env_from_lines_pass_the_value_at_run_time_and_fail_loudly_without_it():
    cfg = load_config(DEBUG, ["slurm.env_from={KEY: SRC, SAME: SAME}"])
    lines = [x for x in profiles.setup_lines(cfg) if not x.startswith("trap ")]
    script = "\n".join(lines + ['bash -c \'printf "%s|%s\\n" "$KEY" "$SAME"\''])
    base = {"PATH": os.environ["PATH"]}
    ok = subprocess.run(["bash", "-c", script], env={**base, "SRC": "v1", "SAME": "v2"}, capture_output=True,
                        text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout == "v1|v2\n", ok.stdout + ok.stderr
    bad = subprocess.run(["bash", "-c", script], env={**base, "SAME": "v2"}, capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "SRC: is not set: slurm.env_from.KEY" in bad.stderr and not bad.stdout


def test_local_job_environment_expands_like_the_batch_shell():
    s = load_config(DEBUG, ["slurm.env={A: \"$HOME/x\", B: \"${A}/y\", C: \"$5 $\"}", "slurm.env_from={D: SRC}"]).slurm
    assert profiles.job_environment(s, {"HOME": "/h", "SRC": "tok"}) == {"A": "/h/x", "B": "/h/x/y", "C": "$5 $",
                                                                        "D": "tok"}


def _modes(run_dir: Path, dirs: bool = False) -> dict:
    return {str(f.relative_to(run_dir)): stat.S_IMODE(f.lstat().st_mode) for f in run_dir.rglob("*")
            if not f.is_symlink() and f.is_dir() == dirs}


def test_what_the_launcher_writes_is_private_even_under_umask_000(shard_stub, tmp_path, tools):
    """config.yaml, the lock, job_id, jobs.jsonl, the sbatch script and the pickle: no bit for others and no
    group write, whatever the caller's umask; sbatch (and so the job, SLURM_UMASK) gets umask 027."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True, mode=0o750)
    run_dir.chmod(0o750)
    (run_dir / "logs").chmod(0o750)
    (run_dir / "logs" / "jobs.jsonl").write_text('{"job_id": "999999", "cluster": "local"}\n')
    (run_dir / "logs" / "jobs.jsonl").chmod(0o666)  # written wide by an older launcher
    cmd = submit_cmd(shard_stub, run_dir, "--profile", "local", "--cluster", "slurm")
    p = subprocess.run(["bash", "-c", 'umask 000; exec "$@"', "sh", *cmd], env=tools.env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    modes = _modes(run_dir)
    for name in ("config.yaml", "logs/job_id", "logs/jobs.jsonl", "logs/4242_submission.sh",
                 "logs/4242_submitted.pkl"):
        assert name in modes, sorted(modes)
    for name, mode in modes.items():
        assert not mode & 0o027, f"{name}: mode {mode:04o}"
    for name, mode in _modes(run_dir, dirs=True).items():
        assert not mode & 0o022, f"{name}/: mode {mode:04o}"
    assert (tools.calls / "sbatch_umask").read_text().split() == ["0027", "0027"]


def test_private_files_follow_run_dir_mode(monkeypatch):
    monkeypatch.setenv("SLURM_UMASK", "0022")  # as inside an allocation: sbatch would pass it on as it is
    before = os.umask(0o022)
    try:
        with cli.private_files("0700") as mask:
            assert mask == 0o077 and os.environ["SLURM_UMASK"] == "0077"
            assert os.umask(mask) == 0o077
        with cli.private_files("0770") as mask:
            assert mask == 0o027 and os.environ["SLURM_UMASK"] == "0027"
        assert os.umask(0o022) == 0o022 and os.environ["SLURM_UMASK"] == "0022"
    finally:
        os.umask(before)


# --------------------------------------------------------------------------- 3. job ids read from jobs.jsonl


def _jobs(run_dir: Path, *lines: str) -> Path:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / "jobs.jsonl").write_text("".join(x + "\n" for x in lines))
    return run_dir


@pytest.mark.parametrize("job_id", ["--user=x", "-u", "4242 -u", "", "4242;id", "../../etc/passwd", 4242, None])
def test_a_forged_slurm_job_id_never_reaches_a_command(tmp_path, tools, job_id):
    run_dir = _jobs(tmp_path / "run", json.dumps({"job_id": job_id, "cluster": "slurm"}))
    for sub in ("cancel", "status", "logs"):
        p = run_submit([str(BIN / "roformer-submit"), sub, str(run_dir)], tools.env)
        assert p.returncode == 2, (sub, p.stdout, p.stderr)
        assert "jobs.jsonl, line 1: job_id" in p.stderr and "is not a SLURM job id" in p.stderr, p.stderr
        _no_traceback(p)
    assert not any(tools.called(n) for n in ("scancel", "squeue", "sacct"))


@pytest.mark.parametrize("line, what", [
    ("not json at all", "not a JSON record"),
    ("[1, 2]", "expected a JSON object"),
    ("{}", "cluster None"),
    ('{"job_id": "12", "cluster": "pbs"}', "cluster 'pbs'"),
    ('{"job_id": "0", "cluster": "local"}', "not the process id"),
    ('{"job_id": "1", "cluster": "local"}', "not the process id"),
    ('{"job_id": "-1", "cluster": "local"}', "not the process id"),
    ('{"job_id": "12", "cluster": "local", "pid_start": "x"}', "pid_start"),
    ("", "holds no job record"),
], ids=["text", "list", "empty-object", "cluster", "pid0", "pid1", "pid-1", "pid-start", "empty-file"])
def test_a_damaged_jobs_record_is_a_clear_error(tmp_path, capsys, line, what):
    run_dir = _jobs(tmp_path / "run", line) if line else _jobs(tmp_path / "run")
    for sub in ("status", "cancel"):
        assert cli.main([sub, str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert "jobs.jsonl" in err and what in err, err


def test_a_damaged_record_does_not_stop_a_submission(shard_stub, tmp_path, tools):
    run_dir = _jobs(tmp_path / "run", '{"job_id": "--user=x", "cluster": "slurm"}')
    for d in (run_dir, run_dir / "logs"):
        d.chmod(0o750)
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--cluster", "slurm"), tools.env)
    assert p.returncode == 0, p.stderr
    assert "warning" in p.stderr and "is not a SLURM job id" in p.stderr
    assert not tools.called("squeue")


def test_slurm_commands_get_the_id_after_their_options(tmp_path, tools, monkeypatch):
    monkeypatch.setenv("PATH", tools.env["PATH"])
    run_dir = _jobs(tmp_path / "run", json.dumps({"job_id": "4242", "cluster": "slurm"}))
    assert cli.main(["cancel", str(run_dir)]) == 0
    assert cli.main(["status", str(run_dir)]) == 0
    assert tools.called("scancel") == ["-- 4242"]
    assert all("--jobs=4242" in c for c in tools.called("squeue") + tools.called("sacct"))
    from launcher import slurm

    with pytest.raises(ConfigError):
        slurm.cancel("-u")
    with pytest.raises(ConfigError):
        slurm.state("--me")
    assert tools.called("scancel") == ["-- 4242"]


def _start_time(pid: int) -> int:
    """/proc/PID/stat field 22 (the process's start time), read here independently of the launcher."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[19])


def _sleeper():
    # SIGINT's default action set explicitly: a shell starting the suite in the background ignores SIGINT in
    # what it starts, and a Python started that way keeps ignoring it; returned once it is set (a SIGINT sent
    # while the interpreter still starts would be ignored: a busy machine takes a second or more to get there)
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                             "signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_cancel_signals_a_local_job_only_when_it_is_the_recorded_process(tmp_path, capsys):
    """A pid from jobs.jsonl may belong to another process by now: its start time must match the record."""
    proc = _sleeper()
    try:
        start = _start_time(proc.pid)
        run_dir = _jobs(tmp_path / "run", json.dumps({"job_id": str(proc.pid), "cluster": "local",
                                                      "pid_start": start + 1}))
        assert cli.main(["cancel", str(run_dir)]) == 0
        assert "not running" in capsys.readouterr().out
        cli.main(["status", str(run_dir)])
        assert "state: FINISHED" in capsys.readouterr().out
        time.sleep(0.2)
        assert proc.poll() is None, "a process that merely reuses the pid must not be signalled"

        _jobs(run_dir, json.dumps({"job_id": str(proc.pid), "cluster": "local"}))  # an older record
        assert cli.main(["cancel", str(run_dir)]) == 1
        assert "no start time" in capsys.readouterr().err
        assert proc.poll() is None

        _jobs(run_dir, json.dumps({"job_id": str(proc.pid), "cluster": "local", "pid_start": start}))
        cli.main(["status", str(run_dir)])
        assert "state: RUNNING" in capsys.readouterr().out
        assert cli.main(["cancel", str(run_dir)]) == 0
        assert proc.wait(timeout=30) != 0, "SIGINT ends it"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_local_record_holds_the_start_time_of_its_process(tmp_path):
    (tmp_path / "logs").mkdir()
    cli._record(tmp_path, str(os.getpid()), "local")
    rec = json.loads((tmp_path / "logs" / "jobs.jsonl").read_text())
    assert rec["pid_start"] == _start_time(os.getpid())
    assert stat.S_IMODE((tmp_path / "logs" / "jobs.jsonl").stat().st_mode) == 0o600


def test_status_survives_a_metrics_line_cut_short(tmp_path, capsys):
    run_dir = _jobs(tmp_path / "run", json.dumps({"job_id": "999999", "cluster": "local", "pid_start": 1}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert cli.main(["status", str(run_dir)]) == 0
    assert "progress: step ?/" in capsys.readouterr().out


# --------------------------------------------------------------------------- 5. the run directory first


def test_nothing_is_written_through_a_symlinked_logs_directory(shard_stub, tmp_path, tools):
    """The run lock checks run_dir and logs/ before the launcher writes anything there."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir(mode=0o750)
    run_dir.chmod(0o750)
    elsewhere.mkdir()
    (run_dir / "logs").symlink_to(elsewhere)
    p = run_submit(submit_cmd(shard_stub, run_dir, "--profile", "local", "--cluster", "slurm"), tools.env)
    assert p.returncode == 2 and "symlink" in p.stderr, p.stderr
    assert list(elsewhere.iterdir()) == [] and not (run_dir / "config.yaml").exists()
    assert not tools.called("sbatch")


@pytest.mark.slurm
@pytest.mark.slow
def test_on_slurm_env_from_reaches_the_job_and_nothing_it_writes_is_open_to_others(small_shards, tmp_path):
    """A real job on the local cluster (one step): the variable named by slurm.env_from arrives, its value is
    in no file, and every file of the run directory -- the job's own logs, result pickles, checkpoints --
    is closed to others (the job runs with SLURM_UMASK 0027)."""
    if shutil.which("sinfo") is None:
        pytest.skip("no SLURM here (slurm/local_cluster/start.sh)")
    up = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    if up.returncode != 0 or not any(w in up.stdout for w in ("idle", "mixed", "allocated")):
        pytest.skip(f"the local SLURM cluster is not up (sinfo: {(up.stdout + up.stderr).strip()[:200]})")
    run_dir = tmp_path / "run"
    setup = "slurm.setup=['test \"$WANDB_API_KEY\" = \"$MY_TOKEN\" && echo env_from arrived']"
    p = subprocess.run(submit_cmd(small_shards, run_dir, "--profile", "local", "--wait", "trainer.stop_at_step=1",
                                  "slurm.env_from={WANDB_API_KEY: MY_TOKEN}", setup),
                       env=job_env(MY_TOKEN=SECRET), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    job = re.search(r"^job_id: (\d+)$", p.stdout, re.M).group(1)
    assert "env_from arrived" in (run_dir / "logs" / f"{job}_0_log.out").read_text()
    files = _modes(run_dir)
    assert f"logs/{job}_0_result.pkl" in files and "logs/rank0.log" in files, sorted(files)
    for name, mode in files.items():
        assert not mode & 0o027, f"{name}: mode {mode:04o}"
        assert SECRET.encode() not in (run_dir / name).read_bytes(), name


# --------------------------------------------------------------------------- 4. the local cluster's root


def _common(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'. "{LOCAL_CLUSTER / "common.sh"}"; {script}'], env=env,
                          capture_output=True, text=True, timeout=30)


def _base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ROFORMER_SLURM_ROOT", "LOCAL_SLURM_DIR", "TMPDIR")}
    env.update(extra)
    return env


def test_the_cluster_root_is_per_user():
    p = _common("cluster_root", _base_env(TMPDIR="/some/tmp"))
    assert p.stdout.strip() == f"/some/tmp/roformer-slurm-{os.geteuid()}", p.stderr
    p = _common("cluster_root", _base_env())
    assert p.stdout.strip() == f"/tmp/roformer-slurm-{os.geteuid()}"
    p = _common("cluster_root", _base_env(ROFORMER_SLURM_ROOT="/srv/slurm/"))
    assert p.stdout.strip() == "/srv/slurm"


def test_a_new_cluster_root_is_created_private(tmp_path):
    root = tmp_path / "cluster"
    p = _common(f'prepare_root "{root}"', _base_env())
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(root.stat().st_mode) == 0o711


@pytest.mark.parametrize("kind", ["symlink", "writable", "parent", "other-owner", "file"])
def test_a_cluster_root_someone_else_could_control_is_refused(tmp_path, kind):
    root, target = tmp_path / "cluster", tmp_path / "target"
    target.mkdir()
    if kind == "symlink":
        root.symlink_to(target)
    elif kind == "writable":
        root.mkdir()
        root.chmod(0o777)
    elif kind == "parent":
        parent = tmp_path / "open"
        parent.mkdir()
        parent.chmod(0o777)
        root = parent / "cluster"
        root.mkdir(mode=0o700)
    elif kind == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        root.mkdir()
        os.chown(root, 65534, 65534)
    else:
        root.write_text("")
    p = _common(f'prepare_root "{root}"', _base_env())
    assert p.returncode == 1 and "refusing cluster root" in p.stderr, p.stdout + p.stderr
    assert list(target.iterdir()) == []


def test_start_sh_refuses_a_symlinked_root_before_starting_anything(tmp_path):
    """start.sh as root with ROFORMER_SLURM_ROOT a symlink: refused first thing. Its PATH holds only basic
    tools (no dpkg, apt or SLURM), so that a start.sh that ignored the root could not start anything."""
    if os.geteuid() != 0:
        pytest.skip("start.sh runs as root only")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "sh", "id", "dirname", "stat", "readlink", "mkdir", "chmod", "cat", "sed", "head",
                 "hostname", "env", "nproc", "awk", "seq", "date", "sleep", "grep", "install", "mktemp", "rm",
                 "cmp", "getent"):
        found = shutil.which(tool)
        if found:
            (bindir / tool).symlink_to(found)
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "root").symlink_to(target)
    p = subprocess.run(["bash", str(LOCAL_CLUSTER / "start.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(bindir), "ROFORMER_SLURM_ROOT": str(tmp_path / "root"), "HOME": str(tmp_path)})
    assert p.returncode == 1 and "refusing cluster root" in p.stderr and "symlink" in p.stderr, p.stdout + p.stderr
    assert list(target.iterdir()) == []


def test_local_cluster_scripts_parse():
    for name in ("start.sh", "stop.sh", "common.sh"):
        p = subprocess.run(["bash", "-n", str(LOCAL_CLUSTER / name)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, (name, p.stderr)
