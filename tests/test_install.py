"""pip keeps the torch it finds: the package states a range, this repository pins its own.

``pip install roformer-dist`` beside a cluster's torch (2.11 ran the GPU check) must keep it rather than
download another multi-GB build; ``make venv`` passes ``-c constraints.txt`` and still installs exactly
the torch CI tests. Every case runs real pip on this checkout's metadata, offline, in a few seconds:

- a fresh venv under tmp_path sees the running interpreter's site-packages through a ``.pth`` file, so
  every requirement but torch is already satisfied and pip needs no index;
- its own site-packages, first on ``sys.path``, holds the torch under test as a ``dist-info`` with
  metadata only: pip decides from installed metadata alone, and a real torch of another version would be
  a multi-GB download;
- the only index is a directory holding a metadata-only wheel of the pinned torch, so a pip that wants
  another torch says so in its JSON report (``--report``) instead of downloading one;
- pip's config files and ``PIP_*`` variables are left out: the machine's pip config changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pinned_torch() -> str:
    """The torch version constraints.txt pins (what `make venv` installs)."""
    pins = re.findall(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.MULTILINE)
    assert len(pins) == 1, "constraints.txt pins torch exactly once"
    return pins[0]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _metadata(version: str) -> bytes:
    return f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n".encode()


def torch_wheel(index: Path, version: str) -> Path:
    """A wheel of torch `version` that holds only its metadata: what the index offers."""
    info = f"torch-{version}.dist-info"
    files = {f"{info}/METADATA": _metadata(version),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: roformer-dist tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n"}
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    index.mkdir(parents=True, exist_ok=True)
    wheel = index / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def venv_with_torch(root: Path, torch_version: str) -> Path:
    """A fresh venv whose installed torch is `torch_version`; the running interpreter's packages behind it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(subprocess.run([str(root / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "_running_interpreter.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    info = purelib / f"torch-{torch_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(_metadata(torch_version))
    (info / "INSTALLER").write_bytes(b"pip\n")
    # a RECORD, so that a pip that replaces this torch can uninstall it and report what it did
    (info / "RECORD").write_text("\n".join([_record_line(f"{info.name}/METADATA", _metadata(torch_version)),
                                            _record_line(f"{info.name}/INSTALLER", b"pip\n"),
                                            f"{info.name}/RECORD,,"]) + "\n")
    return root / "bin" / "python"


def pip(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # cwd away from the checkout: `python -m` puts it on sys.path, and its *.egg-info would count as installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    r = subprocess.run([str(python), "-m", "pip", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def install(python: Path, project: Path, tmp_path: Path, *extra: str) -> dict[str, str]:
    """`pip install project` offline (the torch wheel under tmp_path/index as the only index); what pip
    installed (or, with --dry-run, would install), from its report: {name: version}."""
    report = tmp_path / "report.json"
    pip(python, "install", "--no-index", "--find-links", str(tmp_path / "index"), "--no-build-isolation",
        "--report", str(report), *extra, str(project), cwd=tmp_path)
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


def installed_torch(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                          check=True, capture_output=True, text=True, cwd=python.parent).stdout.strip()


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """This checkout's project, as pip builds it: pyproject.toml, README.md and the packages. A copy,
    because building a directory in place writes build/ and *.egg-info into it, beside other runs."""
    dst = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(ROOT / name, dst / name)
    for pkg in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").is_file()):
        shutil.copytree(pkg, dst / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_installing_beside_a_cluster_torch_keeps_it(project, tmp_path):
    python = venv_with_torch(tmp_path / "venv", "2.11.0")
    torch_wheel(tmp_path / "index", pinned_torch())
    installed = install(python, project, tmp_path)
    assert set(installed) == {"roformer-dist"}, f"beside torch 2.11.0 pip installed {installed}"
    assert installed_torch(python) == "2.11.0"
    site_packages = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    assert (site_packages / "torch-2.11.0.dist-info" / "METADATA").is_file()
    assert not list(site_packages.glob(f"torch-{pinned_torch()}*"))


@pytest.mark.parametrize("torch_version, constrained, expected", [
    pytest.param("2.11.0", False, None, id="the-oldest-tested-torch-is-kept"),
    pytest.param("pin", False, None, id="the-ci-torch-is-kept"),
    pytest.param("2.20.0", False, None, id="a-newer-torch-is-kept"),
    pytest.param("2.10.0", False, "pin", id="an-older-torch-is-replaced"),
    pytest.param("pin", True, None, id="make-venv-keeps-the-pinned-torch"),
    pytest.param("2.11.0", True, "pin", id="make-venv-installs-the-pinned-torch"),
])
def test_which_torch_pip_would_install(project, tmp_path, torch_version, constrained, expected):
    pin = pinned_torch()
    torch_version, expected = (pin if v == "pin" else v for v in (torch_version, expected))
    python = venv_with_torch(tmp_path / "venv", torch_version)
    torch_wheel(tmp_path / "index", pin)
    extra = ["-c", str(project / "constraints.txt")] if constrained else []
    would_install = install(python, project, tmp_path, "--dry-run", *extra)
    assert would_install.get("torch") == expected, f"beside torch {torch_version} pip would install {would_install}"
    assert "roformer-dist" in would_install


def test_make_venv_installs_with_the_constraints():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = subprocess.run(["make", "-nB", "venv"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert re.search(r'pip install .*-e "\.\[dev\]" -c constraints\.txt', r.stdout), r.stdout
