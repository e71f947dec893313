"""core/ installs as `conveyor` and plugins/ as `conveyor.plugins`, editable or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

PROBE = (
    "import conveyor, conveyor.model.decoder_model, conveyor.plugins.quant.none, conveyor.plugins.kvcache.paged, "
    "conveyor.plugins.schedulers.continuous; from conveyor import LLM, SamplingParams; print(conveyor.__file__)"
)


def test_wheel_holds_both_packages_and_imports_outside_the_repo(tmp_path):
    # (built from a copy of the source files: a build/ left in the checkout would lend the wheel stale modules)
    source = tmp_path / "source"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(source)],
        check=True, capture_output=True, timeout=300,
    )
    [wheel] = tmp_path.glob("conveyor_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("conveyor/__init__.py", "conveyor/model/decoder_model.py", "conveyor/plugins/__init__.py",
                     "conveyor/plugins/quant/none.py", "conveyor/plugins/schedulers/continuous.py",
                     "conveyor/serving/static/dashboard.html", "conveyor/serving/static/uPlot.iife.min.js"):
        assert expected in names
    assert not any(n.startswith(("core/", "plugins/")) for n in names)
    # every module of the source tree is in the wheel (a new subpackage missing from pyproject.toml's list is not)
    sources = [f"conveyor/{p.relative_to(REPO / 'core')}" for p in (REPO / "core").rglob("*.py")]
    sources += [f"conveyor/plugins/{p.relative_to(REPO / 'plugins')}" for p in (REPO / "plugins").rglob("*.py")]
    assert sorted(set(sources) - set(names)) == []
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True, text=True, check=True, timeout=120,
    )
    assert result.stdout.strip() == str(site / "conveyor" / "__init__.py")


def test_editable_install_imports_from_any_directory(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == str(REPO / "core" / "__init__.py")


def test_the_frontend_process_runs_with_torch_unimportable():
    """The frontend process tokenizes and speaks HTTP and ZMQ; the scheduler and the KV cache manager decide
    without tensors (a second copy of torch in the frontend would cost some 200 MB and a second of start-up).
    tests/torchless_frontend.py makes torch and triton unimportable, loads what ``conveyor serve`` loads there
    (the command line, the server, every built-in plugin) and serves completions, chat (streamed, with tools),
    Responses, Messages, embeddings and tokenize over a stand-in engine, checking each answer; it fails on any
    attempt to import them, even one caught."""
    result = subprocess.run([sys.executable, str(REPO / "tests" / "torchless_frontend.py")], check=False,
                            capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_importing_conveyor_lets_idle_openmp_threads_sleep_unless_the_environment_chose():
    """``import conveyor`` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (where another process shares
    the cores, spinning threads take time from the working ones); a policy the user set stays."""
    probe = "import os, conveyor, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")]:
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", probe], env=run_env, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        assert out.strip() == expected


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler here")
def test_the_cpu_kernels_build_where_a_compiler_is_found():
    # the kernels' tests skip where the kernels do not load: one that no longer compiles must fail here
    from conveyor import native

    assert native.load(), "the CPU kernels did not build: see the warning above"


def test_every_module_of_core_and_plugins_stays_under_400_lines():
    """A module that grows past 400 lines holds two jobs: split it by what it holds."""
    long = {str(path.relative_to(REPO)): n for path in sorted([*REPO.glob("core/**/*.py"), *REPO.glob("plugins/**/*.py")])
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long
