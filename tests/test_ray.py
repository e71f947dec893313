"""The ``ray`` executor on a local two-node Ray cluster (127.0.0.1, dashboard off): the same tokens as one
worker, and a killed actor gives 503s, then a restarted engine."""

from __future__ import annotations

import os

import pytest

# Ray turns a 127.0.0.1 cluster address into the machine's network address unless told, before it is
# imported, that this is a one-machine cluster; the servers started here inherit the setting.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError
from tests.conftest import CHAT_PROMPTS
from tests.helpers import assert_same_or_near_tie
from tests.test_parallel import assert_same_logits, tiny_llama, tiny_run, tiny_single  # noqa: F401 - fixtures
from tests.test_parallel_faults import kill_a_worker_under_load, serve_split

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


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
    ray.shutdown()  # an engine connects once: leave the cluster an earlier test joined in this process
    with pytest.raises(ConfigError, match=rf"\[parallel\] ray_address = '{address}': no Ray cluster answers there"):
        LLM(overrides={"parallel.executor": "ray", "parallel.ray_address": address})
