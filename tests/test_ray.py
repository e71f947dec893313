"""The ``ray`` executor on a local two-node Ray cluster (127.0.0.1, dashboard off): the same tokens as one
worker, on the cluster and on a Ray instance the engine starts itself; a worker that cannot start names its rank;
a killed actor gives 503s, then a restarted engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from conveyor.executor import ExecutorError
from conveyor.entrypoints.llm import Completion
from tests.conftest import CHAT_PROMPTS
from tests.helpers import assert_same_or_near_tie
from tests.test_parallel import assert_same_logits, tiny_llama, tiny_run, tiny_single  # noqa: F401 - fixtures
from tests.test_parallel_faults import kill_a_worker_under_load, serve_split

# Ray turns a 127.0.0.1 cluster address into the machine's network address unless told, before it is
# imported, that this is a one-machine cluster; the servers started here are told too (one_machine below)
ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
with pytest.MonkeyPatch.context() as env:
    env.setenv(ONE_MACHINE, "0")
    ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def one_machine():
    """The setting for the cluster and the servers this module starts, and for nothing after it."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ONE_MACHINE, "0")
        yield


@pytest.fixture(autouse=True)
def disconnected():
    """Each test leaves this process as it found it: not connected to a cluster (an engine connects once)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """Two logical nodes of 3 CPUs each on this machine; this process is not connected to it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False,
                                                            "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=3, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    yield cluster.address
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_tp3_and_pp2_on_ray_equal_one_worker(ray_cluster, llm_fp32, tiny_llama, tiny_single):  # noqa: F811
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]]
    overrides = {"model.dtype": "float32", "quant.plugin": "none", "parallel.executor": "ray",
                 "parallel.ray_address": ray_cluster, "parallel.tensor_parallel_size": 3}
    with LLM(overrides=overrides) as llm:
        split = llm.generate(conversations, params)
    for prompt, ours, one in zip(CHAT_PROMPTS, split, llm_fp32.generate(conversations, params)):
        assert_same_or_near_tie(ours, one, f"ray TP=3 vs TP=1: {prompt}")
    pp2 = tiny_run(tiny_llama, 1, 2, {"parallel.executor": "ray", "parallel.ray_address": ray_cluster})
    assert_same_logits(pp2, tiny_single, "ray PP=2")


def test_a_killed_actor_gives_503s_then_the_engine_restarts(ray_cluster, tiny_llama, tmp_path):  # noqa: F811
    server = serve_split(tiny_llama, tmp_path, executor="ray", ray_address=ray_cluster, tensor_parallel_size=2)
    try:
        kill_a_worker_under_load(server, rank=0)
    finally:
        assert server.stop() == 0, server.output


def test_a_ray_address_nothing_answers_on_is_a_config_error():
    from conveyor.executor.mp import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=rf"\[parallel\] ray_address = '{address}': no Ray cluster answers there"):
        LLM(overrides={"parallel.executor": "ray", "parallel.ray_address": address})


# The engine of a process of its own: Ray (2.60) cancels every actor a driver creates on a cluster it joined
# before, left, and joins again after starting and stopping an instance of its own in between
LOCAL_RAY = """
import logging, sys
import msgspec, ray
from tests.test_parallel import tiny_run
logging.basicConfig(level=logging.WARNING)
logging.getLogger("conveyor").setLevel(logging.INFO)
split = tiny_run(sys.argv[1], 2, 1, {"parallel.executor": "ray", "parallel.ray_address": ""})
assert not ray.is_initialized(), "the engine's Ray instance outlived it"
sys.stdout.buffer.write(msgspec.json.encode(split))
"""


def test_a_local_ray_instance_serves_and_stops_with_the_engine(tiny_llama, tiny_single):  # noqa: F811
    """``ray_address = ""``: the engine starts a Ray instance of its own on this machine (it joins no cluster,
    not even one running here), its TP=2 actors compute what one worker does, and the instance ends with the
    engine."""
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # a cluster address Ray would otherwise join
    child = subprocess.run([sys.executable, "-c", LOCAL_RAY, str(tiny_llama)], check=False, capture_output=True,
                           env=env, cwd=Path(__file__).parent.parent, timeout=600)
    log = child.stderr.decode(errors="replace")
    assert child.returncode == 0, log
    assert "starting a local Ray instance" in log and "joining" not in log, log
    split = msgspec.json.decode(child.stdout, type=list[Completion])
    assert_same_logits(split, tiny_single, "local ray TP=2")


def test_a_worker_that_cannot_load_the_model_names_its_rank_and_the_reason(ray_cluster, tiny_llama,  # noqa: F811
                                                                           tmp_path):
    """A checkpoint whose weights file is cut short: the engine reads its config, the actors start but fail to
    load the weights, and the error names the rank and what went wrong; the actors' CPUs return to the cluster."""
    broken = shutil.copytree(tiny_llama, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ExecutorError, match=r"worker rank 0 failed to load_model: SafetensorError: .*header"):
        tiny_run(broken, 2, 1, {"parallel.executor": "ray", "parallel.ray_address": ray_cluster})
    # (this process joined the cluster for the engine: the actors' CPUs come back to it)
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, (ray.available_resources(), ray.cluster_resources())
        time.sleep(0.5)
