"""core/ installs as `conveyor` and plugins/ as `conveyor.plugins`, editable or not."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from tests.conftest import REPO

PROBE = (
    "import conveyor, conveyor.model.llama, conveyor.plugins.quant.none, conveyor.plugins.kvcache.paged, "
    "conveyor.plugins.schedulers.continuous; from conveyor import LLM, SamplingParams; print(conveyor.__file__)"
)


def test_wheel_holds_both_packages_and_imports_outside_the_repo(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    [wheel] = tmp_path.glob("conveyor_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("conveyor/__init__.py", "conveyor/model/llama.py", "conveyor/plugins/__init__.py",
                     "conveyor/plugins/quant/none.py", "conveyor/plugins/schedulers/continuous.py"):
        assert expected in names
    assert not any(n.startswith(("core/", "plugins/")) for n in names)
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


def test_the_frontend_and_the_plugin_interfaces_load_no_torch():
    """The frontend process tokenizes and speaks HTTP; the scheduler and the KV cache manager decide without
    tensors. None of them imports torch (a second copy of it in the frontend would cost memory and start-up)."""
    modules = ("conveyor.serving.frontend", "conveyor.engine.mp_client", "conveyor.transport", "conveyor.scheduler",
               "conveyor.kvcache", "conveyor.plugins.schedulers.continuous", "conveyor.plugins.schedulers.static",
               "conveyor.plugins.schedulers.dynamic", "conveyor.plugins.kvcache.paged",
               "conveyor.plugins.kvcache.contiguous", "conveyor.client")
    probe = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)
