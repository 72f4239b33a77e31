"""Every command takes its options and its positionals (``key.sub=value`` overrides, checkpoints, a shard set)
in any order, prints its version with ``--version``, and still refuses an unknown option with argparse's
usage error (exit 2). The parser they share: :mod:`data_pipeline.command_line`."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest
import yaml

from data_pipeline import command_line
from data_pipeline.command_line import CommandParser, version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEMO = "python -m roformer_dist.cli.demo"
COMMANDS = {**PYPROJECT["project"]["scripts"], DEMO: "roformer_dist.cli.demo:main"}
"""Every command (the console scripts and the demo) -> its ``module:function``."""
DEBUG = ROOT / "configs" / "experiments" / "debug.yaml"


def _main(command: str):
    module, function = COMMANDS[command].split(":")
    return getattr(importlib.import_module(module), function)


def _finetune_parser():
    from roformer_dist.finetune.run import build_parser

    return CommandParser.from_parser(build_parser())  # what roformer-finetune's main parses with


def _parser(command: str):
    if command == "roformer-finetune":
        return _finetune_parser()
    # roformer-data's console script is launcher.prepare.main, which hands data_pipeline.cli's parser a runner
    module = "data_pipeline.cli" if command == "roformer-data" else COMMANDS[command].split(":")[0]
    return importlib.import_module(module).build_parser()


# command -> (the order plain argparse parses, the same arguments with an option between the positionals)
ORDERS = {
    "roformer-train": (["--config", "demo.yaml", "--fork", "runs/demo", "run_dir=x", "model.rope_theta=40000"],
                       ["--config", "demo.yaml", "run_dir=x", "--fork", "runs/demo", "model.rope_theta=40000"]),
    "roformer-submit": (["--config", "demo.yaml", "--nodes", "2", "--dry-run", "run_dir=x", "trainer.stop_at_step=5"],
                        ["run_dir=x", "--config", "demo.yaml", "trainer.stop_at_step=5", "--nodes", "2", "--dry-run"]),
    "roformer-eval": (["--lengths", "128,256", "runs/a", "runs/b"], ["runs/a", "--lengths", "128,256", "runs/b"]),
    DEMO: (["--fresh", "--vocab-size", "800", "run_dir=x", "trainer.stop_at_step=5"],
           ["run_dir=x", "--fresh", "trainer.stop_at_step=5", "--vocab-size", "800"]),
    # the command's own option after the subcommand, between the subcommand's options and its positional
    "roformer-data": (["-v", "inspect", "--verify", "data/shards"], ["inspect", "--verify", "-v", "data/shards"]),
    # options only (no positionals): any order parsed the same before; here so that every command is checked
    # (a subcommand's parser, roformer-finetune's parser taken over from the library, still parse as they did)
    "roformer-convert": (["to-hf", "--checkpoint", "runs/a", "--out", "hf", "--force"],
                         ["to-hf", "--force", "--out", "hf", "--checkpoint", "runs/a"]),
    "roformer-finetune": (["--train", "t.jsonl", "--dev", "d.jsonl", "--out", "o", "--epochs", "2"],
                          ["--epochs", "2", "--out", "o", "--train", "t.jsonl", "--dev", "d.jsonl"]),
}


def test_every_command_is_covered():
    assert set(ORDERS) == set(UNKNOWN) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(ORDERS))
def test_an_option_between_the_positionals_parses_as_in_the_usual_order(command):
    usual, mixed = ORDERS[command]
    assert sorted(usual) == sorted(mixed) and usual != mixed
    assert vars(_parser(command).parse_args(mixed)) == vars(_parser(command).parse_args(usual))


def test_train_applies_every_override_around_its_options(tmp_path, capsys):
    """The issue's command line, tried as a new user would (roformer-train's --print-config: nothing runs)."""
    from roformer_dist.cli.train import main

    code = main(["--config", str(DEBUG), f"run_dir={tmp_path / 'x'}", "--fork", str(tmp_path / "parent"),
                 "model.rope_theta=40000", "--print-config", "trainer.stop_at_step=3"])
    assert code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["run_dir"] == str(tmp_path / "x")
    assert cfg["model"]["rope_theta"] == 40000
    assert cfg["trainer"]["stop_at_step"] == 3
    assert cfg["init"]["from"] == str((tmp_path / "parent").resolve())


def test_after_a_double_dash_everything_is_a_positional():
    """As plain argparse (Python 3.11's intermixed parsing would drop the ``--``)."""
    from roformer_dist.cli.train import build_parser

    args = build_parser().parse_args(["--config", "demo.yaml", "a=1", "--", "b=2", "--print-config"])
    assert args.overrides == ["a=1", "b=2", "--print-config"] and not args.print_config


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_name_and_version(command, capsys):
    with pytest.raises(SystemExit) as e:
        _main(command)(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"{command} {importlib.metadata.version('roformer-dist')}\n"


def test_the_version_in_a_checkout_without_installed_metadata(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version() == PYPROJECT["project"]["version"]
    monkeypatch.setattr(command_line, "_PYPROJECT", ROOT / "no-such-pyproject.toml")
    assert version() == "unknown"


# command -> arguments that are complete but for an unknown option (last: a word after an unknown option may be
# its value, and argparse names both)
UNKNOWN = {
    "roformer-train": ["--config", "demo.yaml", "a=1", "--fork", "runs/a", "b=2", "--no-such-option"],
    "roformer-submit": ["--config", "demo.yaml", "a=1", "--no-such-option"],
    "roformer-eval": ["runs/a", "--lengths", "128", "runs/b", "--no-such-option"],
    DEMO: ["a=1", "--no-such-option"],
    "roformer-data": ["inspect", "data/shards", "--no-such-option"],
    "roformer-convert": ["from-hf", "--hf-dir", "hf", "--no-such-option", "--out", "w.pt"],
    "roformer-finetune": ["--train", "t.jsonl", "--dev", "d.jsonl", "--out", "o", "--no-such-option"],
}


@pytest.mark.parametrize("command", sorted(UNKNOWN))
def test_an_unknown_option_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as e:
        _main(command)(UNKNOWN[command])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {command} ")
    assert err.endswith(f"\n{command}: error: unrecognized arguments: --no-such-option\n")


def test_a_subcommand_parser_has_no_version_of_its_own(capsys):
    from roformer_dist.cli.convert import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["to-hf", "--help"])
    assert "--version" not in capsys.readouterr().out
