"""Every model family against transformers on tiny random checkpoints made here, with the family's quirks
switched on: a sliding window shorter than the prompts, soft caps, q/k norms, fused weights, Gemma's norms."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor import native
from conveyor.entrypoints.llm import LLM
from conveyor.model.checkpoint import open_checkpoint
from conveyor.sampling import SamplingParams
from tests.conftest import hf_greedy
from tests.gguf_writer import write_gguf
from tests.helpers import assert_matches_reference, cpu_model, dense_attention

TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "head_dim": 16,
}
WINDOW = 8  # shorter than most prompts below

# family -> (transformers config and model class names, what the tiny checkpoint switches on)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM",
                      {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    # q/k/v biases, the window on the layers from max_window_layers on
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": WINDOW, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0,
                "query_pre_attn_scalar": 24}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 24}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # a shared expert, weights not renormalized, and the second layer dense
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True}),
}
SEQUENCES = [[5, 17, 3, 88, 41, 2, 9, 60, 1, 33, 12, 70, 8, 8, 19, 54, 3, 90, 27, 4], [60, 1, 33], list(range(30, 43))]


def tiny_model(family: str, **overrides):
    import transformers

    config_name, model_name, quirks = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**TINY, initializer_range=0.1, **{**quirks, **overrides})
    model = getattr(transformers, model_name)(config)
    offset = 1.0 if family.startswith("gemma") else 0.0  # Gemma scales by 1 + weight
    with torch.no_grad():  # random norms and biases, so a swapped or missing norm weight or bias shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5 - offset, 1.5 - offset)
            elif name.endswith(".bias"):  # (transformers starts them at zero)
                param.normal_(0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # routers that choose clearly (no near ties between experts)
                param.normal_(0, 1.0)
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    """(name, transformers model, checkpoint directory with the SmolLM2 tokenizer: ids < 96 in and out)."""
    model = tiny_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokenizer.hf.save(str(path / "tokenizer.json"))
    return request.param, model, path


def conveyor_logits(path, sequences: list[list[int]], fused: bool) -> torch.Tensor:
    model = cpu_model(path, fused=fused)
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.tensor([p for s in sequences for p in range(len(s))])
    attention = dense_attention([len(s) for s in sequences], model.attention_layers())
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, positions, attention))


@pytest.mark.parametrize(
    "fused",
    [False, pytest.param(True, marks=pytest.mark.skipif(not native.load(), reason="no C++ compiler"))],
    ids=["torch-ops", "cpu-kernels"],
)
def test_logits_match_transformers(family, fused):
    name, model, path = family
    with torch.inference_mode():
        expected = torch.cat([model(torch.tensor([s])).logits[0] for s in SEQUENCES])
    ours = conveyor_logits(path, SEQUENCES, fused)
    print(f"{name}: max |logit difference| {float((ours - expected).abs().max()):.2e}")
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


PROMPTS = [SEQUENCES[0], SEQUENCES[1], SEQUENCES[2], [7] * 25, list(range(50, 90)), [44, 45]]
PROMPTS += [[t + 1 for t in p] for p in PROMPTS]
NUM_TOKENS = 32


@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_greedy_decoding_matches_transformers_alone_and_in_a_preempting_batch(family, attention):
    """32 greedy tokens per prompt, six prompts alone and then all twelve at once in small steps (prompts in
    chunks of at most 16 tokens) with too few KV blocks for all (preemption; 18 blocks of 4 tokens hold the
    longest request alone): transformers' tokens, or a near tie at the first difference."""
    name, model, path = family
    if attention == "cpu" and not native.load():
        pytest.skip("no C++ compiler")
    references = [hf_greedy(model, prompt, NUM_TOKENS) for prompt in PROMPTS]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    overrides = {"model.path": str(path), "model.dtype": "float32", "model.max_model_len": 128,
                 "engine.attention": attention, "kvcache.block_size": 4, "kvcache.num_blocks": 18,
                 "scheduler.max_num_batched_tokens": 16}
    with LLM(overrides=overrides) as llm:
        alone = [llm.generate([prompt], params)[0] for prompt in PROMPTS[:6]]
        batch = llm.generate(PROMPTS, params)
        preemptions = llm.engine.scheduler.counters.num_preemptions
    assert preemptions > 0, "the batch was meant to run out of KV blocks"
    for i, (ref_tokens, ref_logprobs) in enumerate(references):
        if i < len(alone):
            assert_matches_reference(alone[i], ref_tokens, ref_logprobs, f"{name}, prompt {i} alone")
        assert_matches_reference(batch[i], ref_tokens, ref_logprobs, f"{name}, prompt {i} in the batch")


def test_kv_blocks_behind_a_sliding_window_go_back_to_the_pool(family):
    """A 40-token prompt and 60 greedy tokens (transformers' tokens), one request: where every layer slides
    (Mistral, Phi-3), the blocks it holds at each step stay within what its window and the step's tokens
    touch; where some layers are global (Gemma, Qwen's max_window_layers), every block stays."""
    name, model, path = family
    prompt, window, size, budget = list(range(20, 60)), WINDOW, 4, 16
    ref_tokens, ref_logprobs = hf_greedy(model, prompt, 60)
    overrides = {"model.path": str(path), "model.dtype": "float32", "model.max_model_len": 128,
                 "kvcache.block_size": size, "kvcache.num_blocks": 64, "scheduler.max_num_batched_tokens": budget}
    with LLM(overrides=overrides) as llm:
        step, held = llm.engine.step, []

        def recording_step():
            outputs, stats = step()
            if stats is not None:
                held.append(stats.kv.num_blocks - stats.kv.num_free_blocks)
            return outputs, stats

        llm.engine.step = recording_step
        [ours] = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=5))
        sliding = llm.engine.kvcache.spec.sliding_window
    print(f"{name}: most blocks held {max(held)}")
    assert_matches_reference(ours, ref_tokens, ref_logprobs, name)
    if name in ("mistral-sliding", "phi3"):
        assert sliding == window
        # the window, the step's tokens and a block boundary on either side
        assert max(held) <= -(-(window + budget) // size) + 1, held
    else:
        assert sliding == 0
        assert max(held) == -(-(len(prompt) + 59) // size)


def test_gguf_of_each_family_matches_transformers(family, tmp_path):
    """The same checkpoint written as llama.cpp writes it (names from the gguf package's map, Gemma's norms
    with +1, Phi-3's fused projections, experts stacked) loads with the same logits. Qwen's per-layer windows
    have no GGUF form (llama.cpp runs Qwen without them): not written; nor have Qwen MoE's dense layers
    (every layer a mixture there)."""
    name, model, _ = family
    if name in ("qwen2-sliding", "qwen3-sliding"):
        pytest.skip("GGUF has no per-layer window for Qwen")
    if getattr(model.config, "mlp_only_layers", None):
        model = tiny_model(name, mlp_only_layers=[])
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.F32)
    with torch.inference_mode():
        expected = torch.cat([model(torch.tensor([s])).logits[0] for s in SEQUENCES])
    ours = conveyor_logits(path, SEQUENCES, fused=False)
    print(f"{name} (GGUF): max |logit difference| {float((ours - expected).abs().max()):.2e}")
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_an_unsupported_architecture_stops_the_server_at_start_with_what_is_supported(tmp_path, tokenizer):
    import json
    import re
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], **TINY}))
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--set", f"model.path={tmp_path}", "--set", "transport.0.port=0"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    assert re.search(r"architecture 'FalconForCausalLM' is not supported; supported: LlamaForCausalLM, .*"
                     r"Gemma3ForCausalLM", errors[0]), errors[0]


@pytest.mark.parametrize("what", ["architecture", "type"])
def test_an_unsupported_gguf_is_refused_naming_what_is_supported(tmp_path, what):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon" if what == "architecture" else "llama")
    writer.add_block_count(1)
    weight = np.zeros((4, 256), dtype=np.float32)
    if what == "type":
        weight = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_0)
        # (the bytes of an IQ4_NL tensor have the same size as Q4_0's: 18 bytes per 32 values)
        writer.add_tensor("token_embd.weight", weight, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    else:
        writer.add_tensor("token_embd.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {"architecture": r"GGUF architecture 'falcon' is not supported; supported: llama, qwen2, .*gemma3",
                "type": r"stored as IQ4_NL, which is not supported; supported: F32, F16, BF16, Q8_0, .*Q6_K"}[what]
    with pytest.raises(ValueError, match=expected):
        open_checkpoint(path)


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_weights_of_each_family_stay_close(family, method):
    """int8 (per-channel), fp8 (e4m3) and int4 (Q4_1 blocks) weights, experts included: logits near the float32
    model's (mean relative error), and the linear weights (experts and all) really stored at a byte or less."""
    from conveyor.plugins.quant.fp8 import FP8, FP8Options
    from conveyor.plugins.quant.int4 import Int4
    from conveyor.plugins.quant.int8 import Int8Options, Int8WeightOnly

    name, _, path = family
    cpu = torch.device("cpu")
    quant = {"int8": lambda: Int8WeightOnly(Int8Options(), torch.float32, cpu),
             "fp8": lambda: FP8(FP8Options(), torch.float32, cpu),
             "int4": lambda: Int4(None, torch.float32, cpu)}[method]()
    ckpt = open_checkpoint(path)
    full = cpu_model(ckpt)
    quantized = cpu_model(ckpt, quant)
    ids = torch.tensor(SEQUENCES[0])
    positions = torch.arange(len(ids))
    attention = dense_attention([len(ids)], full.attention_layers())
    with torch.inference_mode():
        expected = full.compute_logits(full.forward(ids, positions, attention))
        ours = quantized.compute_logits(quantized.forward(ids, positions, attention))
    error = float((ours - expected).abs().mean() / expected.abs().mean())
    agree = float((ours.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{name} {method}: mean logit error {error:.3%}, top-1 agreement {agree:.0%}")
    # (tiny random models have small logits: these relative errors run 1-5% for int8 and 5-11% for fp8 here;
    # a layer whose weights are misplaced or left out gives errors near 100%)
    assert error < {"int8": 0.08, "fp8": 0.2, "int4": 0.5}[method], error
    linear_bytes = sum(lin.num_bytes() for layer in quantized.layers for lin in layer.linears())
    full_bytes = sum(lin.num_bytes() for layer in full.layers for lin in layer.linears())
    assert linear_bytes < 0.3 * full_bytes  # one byte per weight (+ scales) against four


def run_split(path, tp: int, pp: int) -> list:
    """Every prompt of PROMPTS (12 greedy tokens, top-5 logprobs of the prompt and the output) on ``tp`` x ``pp``
    workers."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    overrides = {"model.path": str(path), "model.dtype": "float32", "model.max_model_len": 128,
                 "parallel.tensor_parallel_size": tp, "parallel.pipeline_parallel_size": pp,
                 "kvcache.memory_gb": 0.05, "scheduler.max_num_batched_tokens": 32}
    with LLM(overrides=overrides) as llm:
        return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, tokenizer):
    """Per family: its checkpoint directory and one worker's outputs, made once for all the split cases."""
    made: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in made:
            path = tmp_path_factory.mktemp(f"{name}-split")
            tiny_model(name).save_pretrained(path)
            tokenizer.hf.save(str(path / "tokenizer.json"))
            made[name] = path, run_split(path, 1, 1)
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "phi3", "qwen2-moe", "qwen3-moe"])
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_split_workers_compute_what_one_worker_does(one_worker, name, tp, pp):
    """Two workers (processes): heads, MLP columns and every expert's columns split (TP), or the layers
    (PP; Gemma's sliding and global layers on different stages): the same greedy tokens and top-5 logprobs
    at every prompt and output position as one worker."""
    from tests.test_parallel import assert_same_logits

    path, expected = one_worker(name)
    assert_same_logits(run_split(path, tp, pp), expected, f"{name} TP={tp} PP={pp}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "qwen3-moe"])
def test_compiled_decode_computes_what_eager_does(tmp_path, tokenizer, name):
    """Soft caps, windows and q/k norms traced into the decode graphs, a mixture of experts as one opaque op:
    the same greedy tokens and logprobs within 1e-4 as eager, every decode step after the prompts' in a graph."""
    tiny_model(name).save_pretrained(tmp_path)
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for compile in ("off", "on"):
        overrides = {"model.path": str(tmp_path), "model.dtype": "float32", "model.max_model_len": 128,
                     "engine.compile": compile, "engine.compile_batch_sizes": [1, 4], "scheduler.max_num_seqs": 4}
        with LLM(overrides=overrides) as llm:
            runs[compile] = llm.generate(PROMPTS[:4], params)
            if compile == "on":
                assert llm.engine.executor.worker.runner.compiled.num_steps == 7  # (the first token: prefill)
    for eager, compiled in zip(runs["off"], runs["on"]):
        assert compiled.token_ids == eager.token_ids
        for a, b in zip(compiled.logprobs, eager.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
