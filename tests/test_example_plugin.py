"""The example third-party plugin package (a scheduler written from the Scheduler base class alone):
installed with pip, listed, selected by TOML, and serving the real model with preemption."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import load_config
from conveyor.registry import PluginRegistry
from tests.conftest import REPO
from tests.factories import create_kvcache, create_request, run_to_completion
from tests.helpers import assert_same_or_near_tie


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
    assert "continuous  [conveyor.plugins.schedulers.declarations]" in result.stdout


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
        scheduler = cls(cls.Options(max_num_seqs=1), create_kvcache(), 256)
        for name, length in (("long", 40), ("medium", 20), ("short", 5)):  # arrival order
            scheduler.add(create_request(length, max_tokens=2, request_id=name))
        return run_to_completion(scheduler)

    # One request at a time: FCFS keeps arrival order, SJF runs the shortest first.
    assert finish_order("continuous") == ["long", "medium", "short"]
    assert finish_order("sjf") == ["short", "medium", "long"]


@pytest.mark.slow
def test_the_plugin_serves_with_preemption_under_a_tiny_kv_cache_and_loses_nothing(
        installed_sjf, monkeypatch, llm_fp32):
    monkeypatch.syspath_prepend(str(installed_sjf))
    prompts = [[{"role": "user", "content": f"Describe {topic} in a few sentences, please."}]
               for topic in ("rain", "a lighthouse", "the moon", "bread", "a city at night", "winter")]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)

    def run(num_blocks: int):
        llm = LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "scheduler.plugin": "sjf",
                             "kvcache.block_size": 16, "kvcache.num_blocks": num_blocks})
        assert type(llm.engine.scheduler).__module__ == "conveyor_sjf"
        completions = llm.generate(prompts, params)
        return completions, llm.engine

    # each request needs about 4 blocks at its longest; 10 blocks hold two of them at a time
    tight, engine = run(num_blocks=10)
    assert engine.scheduler.stats().num_preemptions > 0
    assert engine.kvcache.num_free_blocks == engine.kvcache.num_blocks and not engine.has_unfinished()
    # against the built-in scheduler with room for all of them at once
    roomy = llm_fp32.generate(prompts, params)
    for i, (a, b) in enumerate(zip(tight, roomy)):
        assert a.finish_reason == "length" and len(a.token_ids) == 24, i  # every request finished in full
        assert_same_or_near_tie(a, b, f"request {i}")
