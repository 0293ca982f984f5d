"""Packaging: pyproject.toml agrees with the code and requirements.txt, and the project installs into a fresh
virtual environment from a copy outside the repository and works from another directory."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import spreeze
from conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOP_LEVEL = ("spreeze", "autotune", "viz", "launch", "benchmarks")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_installs_the_top_level_packages_and_the_command():
    project = PYPROJECT["project"]
    assert project["scripts"] == {"spreeze": "launch.cli:main"}
    assert "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spreeze.__version__"}
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in TOP_LEVEL:
        assert package in include and f"{package}.*" in include
        assert (ROOT / package / "__init__.py").is_file()
    assert set(project["optional-dependencies"]) >= {"test", "bench"}


def test_pyproject_and_requirements_name_the_same_dependencies():
    """requirements.txt (CI's pins) and pyproject.toml (the ranges) must not drift apart; torch is pinned in both."""
    lines = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    runtime = {_name(d): d for d in PYPROJECT["project"]["dependencies"]}
    test = {_name(d) for d in PYPROJECT["project"]["optional-dependencies"]["test"]}
    assert {_name(line) for line in lines} == set(runtime) | test
    assert runtime["torch"] == "torch==2.13.0" and "torch==2.13.0" in lines
    bench = (ROOT / "benchmarks" / "requirements.txt").read_text().split()
    assert {_name(d) for d in PYPROJECT["project"]["optional-dependencies"]["bench"]} <= {_name(b) for b in bench}


def test_the_core_package_imports_no_outer_package():
    """spreeze/ is the core: importing every module of it loads neither launch, viz, autotune nor benchmarks."""
    code = ("import importlib, pkgutil, sys, spreeze\n"
            "for m in pkgutil.walk_packages(spreeze.__path__, 'spreeze.'): importlib.import_module(m.name)\n"
            "spreeze.train, spreeze.load_policy\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'launch', 'viz', 'autotune', 'benchmarks'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_cache_folder_follows_the_platform_after_the_flag_and_the_variable(tmp_path, monkeypatch):
    from autotune import cache

    monkeypatch.delenv(cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    platformdirs = pytest.importorskip("platformdirs")
    assert cache.cache_dir() == Path(platformdirs.user_cache_dir("spreeze", appauthor=False))
    if sys.platform.startswith("linux"):
        assert cache.cache_dir() == tmp_path / "xdg" / "spreeze"
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "env"))
    assert cache.cache_dir() == tmp_path / "env"
    assert cache.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"


# ----- the install test ---------------------------------------------------------------------------------
def project_files() -> list[str]:
    """What a clone would hold: the tracked files and the new ones git does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell the project's files from build leftovers")
    return [name for name in out.split("\0") if name and (ROOT / name).is_file()]


def copy_project(dest: Path) -> Path:
    for name in project_files():
        if name.startswith("benchmarks/results/"):  # measurements, not code: nothing installs them
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return dest


def clean_env(**extra) -> dict:
    """This environment without what would let the repository leak into the installed copy."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def make_venv(path: Path) -> Path:
    """A fresh venv that sees the system site (torch and friends come from there, offline); its pip is the
    system one, which installs into the venv's prefix."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
                   check=True, timeout=120)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str, cwd: Path) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                           "--quiet", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=clean_env(PIP_NO_CACHE_DIR="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_installs_into_a_fresh_venv_and_trains_from_another_directory(tmp_path):
    began = time.monotonic()
    source = copy_project(tmp_path / "source")
    python = make_venv(tmp_path / "venv")
    pip_install(python, str(source), cwd=tmp_path)
    shutil.rmtree(source)  # a regular install must not need the copy it came from
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = tmp_path / "venv" / "bin" / "spreeze"
    env = clean_env()

    def run(*args, timeout=120):
        return subprocess.run([str(a) for a in args], cwd=elsewhere, capture_output=True, text=True,
                              timeout=timeout, env=env)

    help_ = run(command, "--help")
    assert help_.returncode == 0, help_.stderr
    assert all(f"\n  {name} " in help_.stdout for name in ("train", "play", "plot", "bench"))
    version = run(command, "--version")
    assert version.stdout.strip() == f"spreeze {spreeze.__version__}"

    where = run(python, "-c", "import spreeze, launch.api; spreeze.train; print(spreeze.__file__)")
    assert where.returncode == 0, where.stderr
    installed = Path(where.stdout.strip().splitlines()[-1])
    assert installed.is_relative_to(tmp_path / "venv") and not installed.is_relative_to(ROOT)

    train = run(command, "train", "--env", "Pendulum-v1", "--minutes", "0.15", "--no-window",
                "--cache-dir", tmp_path / "cache", timeout=240)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    summaries = list((elsewhere / "runs").glob("Pendulum-v1-sac-*/summary.json"))
    assert len(summaries) == 1, train.stdout[-3000:]
    summary = json.loads(summaries[0].read_text())
    assert summary["exit_code"] == 0 and summary["stopped_by"] == "minutes"
    assert list((tmp_path / "cache").glob("Pendulum-v1-sac-*.json"))  # the profile went where --cache-dir said
    print(f"install test: {time.monotonic() - began:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_editable_install_runs_the_checkout_s_code(tmp_path):
    source = copy_project(tmp_path / "source")
    python = make_venv(tmp_path / "venv")
    pip_install(python, "-e", str(source), cwd=tmp_path)
    (source / "spreeze" / "__init__.py").write_text(
        (source / "spreeze" / "__init__.py").read_text().replace(f'"{spreeze.__version__}"', '"9.9.9"'))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "spreeze"), "--version"], cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "spreeze 9.9.9", proc.stderr  # an edit is live
