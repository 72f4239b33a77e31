"""The package's layout is a checked contract: the import direction (import-linter, configured in
pyproject.toml), no stray top-level modules, and a docstring that maps every subpackage."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "roformer_dist"
LEAF_MODULES = {"__init__.py", "errors.py", "testing.py"}


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contract_holds():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout
    declared = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {declared} kept, 0 broken" in r.stdout            # every declared contract was checked
    assert "data_pipeline modules KEPT" in r.stdout


@pytest.mark.parametrize("module, upward", [
    ("roformer_dist/nn/model.py", "roformer_dist.cli.train"),          # the model reaching for a command
    ("roformer_dist/checkpoint/store.py", "roformer_dist.loop.trainer"),  # a lower layer importing the loop
    ("data_pipeline/loader.py", "roformer_dist.config"),               # the pipeline importing the package
    ("data_pipeline/manifest.py", "data_pipeline.loader"),             # the manifest checks reaching for the loader
    ("data_pipeline/formats/txt.py", "data_pipeline.corpus"),          # a format reaching for its dispatcher
])
def test_an_upward_import_breaks_the_contract(tmp_path, module, upward):
    """A copy of the tree with one upward import added, inside a function as lazy imports are: the
    contract must name it."""
    for name in ("roformer_dist", "data_pipeline", "launcher"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _upward():\n    import {upward}  # noqa: F401\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and upward in r.stdout, r.stdout


def test_only_leaf_modules_beside_the_subpackages():
    stray = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in LEAF_MODULES)
    assert stray == [], f"modules belong in a subpackage: {stray}"


@pytest.mark.parametrize("sub", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_every_subpackage_says_what_it_owns_and_may_import(sub):
    doc = ast.get_docstring(ast.parse((PACKAGE / sub / "__init__.py").read_text())) or ""
    assert "May import" in doc, f"roformer_dist/{sub}/__init__.py: its docstring must say what it may import"
    named = {p.name for p in (PACKAGE / sub).glob("*.py") if p.name != "__init__.py"}
    missing = sorted(n for n in named if n not in doc)
    assert not missing, f"roformer_dist/{sub}/__init__.py does not describe {missing}"


DATA_PIPELINE = ROOT / "data_pipeline"


def test_data_pipeline_modules_are_small_and_mapped():
    """Every module of data_pipeline stays under 600 lines and is named in its package's docstring (which
    also draws the layers that pyproject.toml's contract checks)."""
    modules = sorted(DATA_PIPELINE.rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these modules: {long}"
    for package in (DATA_PIPELINE, DATA_PIPELINE / "formats"):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        named = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        missing = sorted(n for n in named if n not in doc)
        assert not missing, f"{package.relative_to(ROOT)}/__init__.py does not describe {missing}"
    assert "May import" in (ast.get_docstring(ast.parse((DATA_PIPELINE / "formats" / "__init__.py").read_text())) or "")


def test_benches_import_the_library_not_the_commands():
    """bench/ imports roformer_dist's library, never a command module (``roformer_dist.cli.*``): a command is
    run as one (a child process), the code behind it imported from its library module."""
    found = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                      if n == "roformer_dist.cli" or n.startswith("roformer_dist.cli.")]
    assert not found, "benches importing a command module:\n" + "\n".join(found)


def test_package_modules_are_small():
    """No module of roformer_dist over 600 lines (data_pipeline: test_data_pipeline_modules_are_small_and_mapped)."""
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these modules: {long}"


NOT_RUN_DIRECTORIES = {"launcher/prepare.py": "logs of roformer-data's staging directory, not of a run"}
RUN_DIR_NAMES = ("checkpoints", "latest", "metrics.jsonl", "tb", "config.yaml", "logs", "jobs.jsonl", "parent.json",
                 "profile", "compile_cache", "rotary_backend.json", "resolved_run.json",
                 "wandb", "wandb_run.json", "mlruns", "mlflow.db", "mlflow_run.json")


def test_run_directory_paths_are_built_only_by_rundir():
    """A path of a run directory is built through ``runtime.rundir.RunDir`` (``RunDir(run_dir).checkpoints``),
    never spelled out (``run_dir / "checkpoints"``): the names live in one place."""
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "launcher").rglob("*.py")]):
        if path == PACKAGE / "runtime" / "rundir.py" or str(path.relative_to(ROOT)) in NOT_RUN_DIRECTORIES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and \
                    isinstance(node.right, ast.Constant) and node.right.value in RUN_DIR_NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: / {node.right.value!r}")
    assert not found, "run-directory paths spelled out (use RunDir):\n" + "\n".join(found)



RANK_MODULES = ("loop/trainer.py", "launch/entry.py", "launch/spawn.py", "parallel")
"""The code a rank runs once its launch is resolved (``launch/resolved.py``). ``observe/evaluation.py`` plans the
mixture's shares for a caller that gives none (``roformer-eval``); the trainer gives them (the spy test)."""
RE_DERIVING = {"resolve_data", "source_manifests", "plan_mixture", "choose_resume", "check_compatible", "validate",
               "micro_batch_size", "stage_plans", "data_parallel_size"}
FIELDS = {"micro_batch_size"}
"""Also a field of a StagePlan (``plan.micro_batch_size``): not looked for after a dot."""


def test_ranks_do_not_derive_what_the_resolved_run_holds():
    """The ranks take the manifests, the mixture plan, the stage plans and the resume decision from the
    ResolvedRun: their modules neither import nor name the functions that derive them (a rank started under
    torchrun resolves only through ``launch.resolved``, on rank 0). tests/test_resolved_run.py runs two ranks
    with these functions replaced by ones that fail."""
    found = []
    paths = [p for m in RANK_MODULES for p in ([PACKAGE / m] if m.endswith(".py") else sorted((PACKAGE / m).glob("*.py")))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.asname or a.name for a in node.names] if isinstance(node, ast.ImportFrom) else \
                [node.id] if isinstance(node, ast.Name) else \
                [node.attr] if isinstance(node, ast.Attribute) and node.attr not in FIELDS else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in RE_DERIVING]
    assert not found, "a rank derives what the resolved run holds:\n" + "\n".join(sorted(set(found)))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def cross_module_private_uses(root: Path, packages=("roformer_dist", "data_pipeline", "launcher")) -> list[str]:
    """Each ``obj._name`` (``self._name`` too: a mixin's or a subclass's) whose ``_name`` is a private name one of
    our modules defines (a function, a class, an attribute or variable it assigns) but not the module that uses
    it, and each ``from ... import _name`` between our modules. Privates of other libraries (``torch._dynamo``)
    are not ours to police: a name none of our modules defines is left alone."""
    trees, defined = {}, {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = str(path.relative_to(root))
            trees[rel] = tree = ast.parse(path.read_text(encoding="utf-8"))
            names = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
            defined[rel] = {n for n in names if _private(n)}
    ours = set().union(*defined.values())
    found = []
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in ours \
                    and node.attr not in defined[rel]:
                found.append(f"{rel}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in packages:
                found += [f"{rel}:{node.lineno}: import {node.module}.{a.name}" for a in node.names if _private(a.name)]
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = cross_module_private_uses(ROOT)
    assert not found, "private names used outside the module that defines them:\n" + "\n".join(found)


def test_a_private_name_used_across_modules_is_found(tmp_path):
    """A mixin reading its host's private attribute, and a private function imported by another module."""
    pkg = tmp_path / "roformer_dist"
    pkg.mkdir()
    (pkg / "host.py").write_text("class Host:\n    def __init__(self):\n        self._due = False\n\n\n"
                                 "def _helper():\n    return 1\n")
    (pkg / "mixin.py").write_text("class Part:\n    def run(self):\n        return self._due\n")
    (pkg / "user.py").write_text("from roformer_dist.host import _helper\n\n\ndef f(tr):\n"
                                 "    return tr._due or _helper() or tr._own_library_thing\n")
    assert cross_module_private_uses(tmp_path, ("roformer_dist",)) == [
        "roformer_dist/mixin.py:3: ._due", "roformer_dist/user.py:1: import roformer_dist.host._helper",
        "roformer_dist/user.py:5: ._due"]


def test_only_roformer_datas_command_line_reads_its_argparse_namespace():
    """The flags become one typed DataOptions in data_pipeline/cli.py (options_of); no module below it, and not the
    launcher's task runner, imports argparse or reads an ``args.<flag>``."""
    edge = {"data_pipeline/cli.py", "data_pipeline/command_line.py"}
    found = []
    for path in sorted([*(ROOT / "data_pipeline").rglob("*.py"), ROOT / "launcher" / "prepare.py"]):
        rel = str(path.relative_to(ROOT))
        if rel in edge:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "argparse" in \
                    [a.name for a in node.names] + [getattr(node, "module", None)]:
                found.append(f"{rel}:{node.lineno}: imports argparse")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args" \
                    and node.attr != "args":
                found.append(f"{rel}:{node.lineno}: args.{node.attr}")
    assert not found, "\n".join(found)
