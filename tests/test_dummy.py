"""``[model] load_format = "dummy"``: random weights of the shape a config.json gives (conveyor.model.dummy),
the same on every worker and in every run, loaded exactly as transformers' model with those weights computes."""

from __future__ import annotations

import pytest
import torch

from conveyor.config import ConfigError, load_config
from conveyor.model.dummy import DummyCheckpoint
from conveyor.model.loader import open_model
from tests.helpers import cpu_model, dense_attention
from tests.test_families import SEQUENCES, TINY


@pytest.fixture(scope="module")
def shape_only(tmp_path_factory):
    """A directory with a tiny Llama's config.json and nothing else."""
    import transformers

    path = tmp_path_factory.mktemp("dummy")
    transformers.LlamaConfig(**TINY, attention_bias=True, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def test_transformers_takes_every_tensor_and_computes_what_conveyor_does(shape_only):
    """Every parameter transformers' model has is made, in its shape (a strict load_state_dict); Conveyor's model
    over the same checkpoint gives the same logits."""
    import transformers

    ckpt = open_model(load_config(None, {"model.path": str(shape_only), "model.load_format": "dummy"}).model)
    assert isinstance(ckpt, DummyCheckpoint)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(shape_only)).eval()
    reference.load_state_dict({name: ckpt.tensor(name) for name in reference.state_dict()}, strict=True)
    model = cpu_model(ckpt)
    ids = torch.tensor([t for s in SEQUENCES for t in s])
    positions = torch.tensor([p for s in SEQUENCES for p in range(len(s))])
    with torch.inference_mode():
        ours = model.compute_logits(model.forward(ids, positions, dense_attention([len(s) for s in SEQUENCES],
                                                                                 model.attention_layers())))
        expected = torch.cat([reference(torch.tensor([s])).logits[0] for s in SEQUENCES])
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(ours).all() and float(ours.std()) > 0.1  # (random, and not collapsed to a constant)


def test_the_same_weights_every_time_and_another_seed_others(shape_only):
    name = "model.layers.1.mlp.down_proj.weight"
    a, b, c = DummyCheckpoint(shape_only), DummyCheckpoint(shape_only / "config.json"), DummyCheckpoint(shape_only, 1)
    assert torch.equal(a.tensor(name), b.tensor(name))
    assert not torch.equal(a.tensor(name), c.tensor(name))
    assert not torch.equal(a.tensor(name), a.tensor("model.layers.0.mlp.down_proj.weight"))
    with pytest.raises(KeyError, match="no tensor 'model.layers.0.mlp.experts.0.up_proj.weight'"):
        a.tensor("model.layers.0.mlp.experts.0.up_proj.weight")


def test_a_path_without_a_config_json_is_refused_naming_it(tmp_path):
    config = load_config(None, {"model.path": str(tmp_path), "model.load_format": "dummy"})
    with pytest.raises(ConfigError, match="takes the shape from a config.json"):
        open_model(config.model)
