"""The example third-party plugin package: installed with pip, listed, selected by TOML."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor.config import load_config
from conveyor.registry import PluginRegistry
from tests.conftest import REPO
from tests.factories import create_kvcache, create_request, run_to_completion


@pytest.fixture(scope="module")
def installed_sjf(tmp_path_factory):
    """pip-install examples/conveyor-sjf into a private directory (not into the venv)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO / "examples" / "conveyor-sjf")],
        check=True, capture_output=True, timeout=300,
    )
    return target


def test_installed_plugin_shows_in_conveyor_plugins(installed_sjf):
    env = {**os.environ, "PYTHONPATH": str(installed_sjf)}
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "plugins"], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert "sjf  [conveyor-sjf 0.1.0]" in result.stdout
    assert "continuous  [conveyor.plugins.schedulers.continuous]" in result.stdout


def test_toml_selects_the_plugin_and_it_schedules_shortest_first(installed_sjf, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_sjf))
    config_file = tmp_path / "sjf.toml"
    config_file.write_text('[scheduler]\nplugin = "sjf"\nmax_num_seqs = 1\n')
    config = load_config(config_file)
    assert config.scheduler.plugin == "sjf"
    assert config.scheduler.options.max_num_seqs == 1

    registry = PluginRegistry()
    assert registry.get("scheduler", "sjf").__module__ == "conveyor_sjf"

    def finish_order(plugin: str) -> list[str]:
        cls = registry.get("scheduler", plugin)
        scheduler = cls(config.scheduler.options, create_kvcache(), 256)
        for name, length in (("long", 40), ("medium", 20), ("short", 5)):  # arrival order
            scheduler.add(create_request(length, max_tokens=2, request_id=name))
        return run_to_completion(scheduler)

    # One request at a time: FCFS keeps arrival order, SJF runs the shortest first.
    assert finish_order("continuous") == ["long", "medium", "short"]
    assert finish_order("sjf") == ["short", "medium", "long"]
