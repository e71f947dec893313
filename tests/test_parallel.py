"""Tensor and pipeline parallelism: how the model splits, and that a split model computes what one worker does.

The split runs in worker processes (the ``mp`` executor over gloo on this
CPU): a tiny random Llama made by transformers here, and the real SmolLM2.
"""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import ConfigError, ParallelConfig, load_config
from conveyor.model.parallel import Placement, check_divisible
from tests.conftest import CHAT_PROMPTS, NUM_TOKENS, REPO
from tests.helpers import assert_matches_reference, assert_same_or_near_tie
from tests.test_model import tiny_hf_model


@pytest.mark.parametrize("tp, pp, num_kv_heads", [(1, 1, 2), (2, 1, 2), (4, 1, 2), (3, 2, 6), (1, 3, 2), (2, 2, 2)])
def test_every_layer_head_and_vocabulary_row_has_an_owner(tp, pp, num_kv_heads):
    """Across the workers, the stages' layers are contiguous and cover the model once; every query head
    and vocabulary row is on exactly one TP worker; each worker's KV heads are the ones its query heads read."""
    num_layers, num_heads, vocab = 7, 12, 101
    assert check_divisible(Placement(0, tp, pp), num_heads, num_kv_heads, 48, num_layers) is None
    placements = [Placement(rank, tp, pp) for rank in range(tp * pp)]
    layers = sorted(i for p in placements if p.tp_rank == 0 for i in p.layers(num_layers))
    assert layers == list(range(num_layers))
    for p in placements:
        assert len(p.layers(num_layers)) >= num_layers // pp
    stage = [p for p in placements if p.pp_rank == 0]
    assert sorted(h for p in stage for h in p.heads(num_heads)) == list(range(num_heads))
    assert sorted(v for p in stage for v in p.vocab(vocab)[0]) == list(range(vocab))
    group = num_heads // num_kv_heads
    for p in stage:
        read = sorted({h // group for h in p.heads(num_heads)})
        assert read == list(p.kv_heads(num_kv_heads))
    assert sum(p.driver for p in placements) == 1


def test_collectives_are_counted_and_timed_by_cuda_events_on_cuda(monkeypatch):
    """A worker's collectives and transfers, counted with their bytes; on CUDA each is timed by a pair of CUDA
    events read once the step is done (NCCL returns once the work is queued, so a host clock would see none of
    it). Stand-ins for torch.distributed and CUDA events, whose elapsed times are set here."""
    import torch
    import torch.distributed as dist

    from conveyor.model.parallel import ParallelGroup

    elapsed_ms = iter([4.0, 1.5, 2.5])  # an all-reduce, a send, a receive

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.recorded = self.synchronized = False

        def record(self):
            self.recorded = True

        def synchronize(self):
            self.synchronized = True

        def elapsed_time(self, end) -> float:
            assert self.recorded and end.recorded and end.synchronized
            return next(elapsed_ms)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    for name in ("all_reduce", "send", "recv"):
        monkeypatch.setattr(dist, name, lambda *args, **kwargs: None)
    group = ParallelGroup(Placement(0, 2, 2), tp_group=None, cuda=True)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    group.all_reduce(x)
    group.send_next(x)
    group.recv_prev((3, 64), torch.bfloat16, torch.device("cpu"))
    counts = group.take_counts()
    assert (counts.num_collectives, counts.collective_bytes) == (1, 3 * 64 * 2)
    assert counts.comm_time == pytest.approx((4.0 + 1.5) / 1e3) and counts.wait_time == pytest.approx(2.5e-3)
    assert group.take_counts() == type(counts)()  # (read once)
    # on a CPU the host clock times the same calls
    cpu = ParallelGroup(Placement(0, 2, 1), tp_group=None)
    cpu.all_reduce(x)
    assert cpu.take_counts().num_collectives == 1


def test_a_split_that_does_not_divide_names_the_numbers():
    assert "9 attention heads" in check_divisible(Placement(0, 2, 1), 9, 3, 1536, 30)
    assert "3 KV heads" in check_divisible(Placement(0, 2, 1), 4, 3, 64, 30)
    assert "MLP width 102" in check_divisible(Placement(0, 4, 1), 8, 2, 102, 30)
    assert "MLP width 30" in check_divisible(Placement(0, 4, 1), 8, 2, 128, 30, (64, 30))  # (an expert's)
    assert "exceeds the model's 2 layers" in check_divisible(Placement(0, 1, 3), 8, 2, 128, 2)
    assert check_divisible(Placement(0, 3, 1), 9, 3, 1536, 30) is None
    # the sizes that split it: SmolLM2's 9 heads, 3 KV heads and 1,536 MLP columns take 1 and 3 (9 not: 1536 % 9)
    assert check_divisible(Placement(0, 2, 1), 9, 3, 1536, 30).endswith("allowed: tensor_parallel_size = 1 | 3")
    assert check_divisible(Placement(0, 3, 1), 8, 2, 128, 30).endswith("= 1 | 2 | 4 | 8")


def test_serve_refuses_a_split_before_any_worker_starts():
    """``conveyor serve`` with a tensor-parallel size the default model cannot take: one line naming the sizes
    that work, exit 1 (the workers never start)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "conveyor", "serve", "configs/default.toml", "--set",
                             "parallel.tensor_parallel_size=2"], capture_output=True, text=True, timeout=300,
                            check=False, cwd=REPO)
    assert result.returncode == 1
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
    assert errors == [("error: configs/default.toml: [parallel] tensor_parallel_size = 2 does not divide the model's"
                       " 9 attention heads; allowed: tensor_parallel_size = 1 | 3")]
    assert "Traceback" not in result.stderr and "workers ready" not in result.stdout
    assert check_divisible(Placement(0, 4, 1), 8, 2, 128, 30) is None  # KV heads copied


def test_parallel_config_keys_and_auto_executor():
    config = load_config(None, {"parallel.tensor_parallel_size": "3", "parallel.pipeline_parallel_size": "2"})
    assert (config.parallel.world_size, config.parallel.executor_name) == (6, "mp")
    assert ParallelConfig().executor_name == "uniproc"
    with pytest.raises(ConfigError, match=r"\[parallel\] executor = 'uniproc' runs one worker.*allowed"):
        load_config(None, {"parallel.tensor_parallel_size": "2", "parallel.executor": "uniproc"})
    with pytest.raises(ConfigError, match=r"--set parallel.executor.*allowed: 'auto', 'uniproc', 'mp', 'ray'"):
        load_config(None, {"parallel.executor": "threads"})


# A tiny Llama whose heads (8), KV heads (2), MLP width, layers (4) and vocabulary (98: uneven) split every
# way tested.
SPLITTABLE = {"vocab_size": 98, "num_hidden_layers": 4, "num_attention_heads": 8}
PROMPTS = [[5, 17, 3, 88, 41, 2, 9, 60, 1, 33], [60, 1, 33, 97], [7] * 12, list(range(40, 70))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    model = tiny_hf_model("llama", **SPLITTABLE)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.hf.save(str(path / "tokenizer.json"))  # only token ids < 98 go in and come out
    return path


def tiny_run(path, tp: int, pp: int, extra: dict | None = None) -> list:
    overrides = {
        "model.path": str(path), "model.dtype": "float32", "model.max_model_len": 128,
        "parallel.tensor_parallel_size": tp, "parallel.pipeline_parallel_size": pp,
        "kvcache.memory_gb": 0.05, "scheduler.max_num_batched_tokens": 32,  # prompts in chunks
        **(extra or {}),
    }
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    with LLM(overrides=overrides) as llm:
        return llm.generate(PROMPTS, params)


@pytest.fixture(scope="module")
def tiny_single(tiny_llama):
    return tiny_run(tiny_llama, 1, 1)


def assert_same_logits(ours: list, reference: list, label: str) -> None:
    """Greedy tokens equal, and every prompt and output position's top-5 logprobs equal within fp32 rounding."""
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids, label
        pairs = list(zip(a.prompt_logprobs, b.prompt_logprobs)) + list(zip(a.logprobs, b.logprobs))
        for x, y in pairs:
            assert x.top_ids == y.top_ids, label
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4), label


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)], ids=lambda v: str(v))
def test_tiny_llama_split_computes_what_one_worker_does(tiny_llama, tiny_single, tp, pp):
    """TP=2; TP=4 (more workers than the 2 KV heads: copied); PP=2; PP=3 (4 layers: 2+1+1); TP=2 x PP=2."""
    assert_same_logits(tiny_run(tiny_llama, tp, pp), tiny_single, f"TP={tp} PP={pp}")


@pytest.fixture(scope="module")
def smollm2_tp3():
    with LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.seed": 1234,
                        "parallel.tensor_parallel_size": 3}) as llm:
        yield llm


@pytest.mark.slow
def test_smollm2_tp3_matches_one_worker_and_transformers(smollm2_tp3, llm_fp32, reference):
    """SmolLM2: 9 query heads and 3 KV heads split over 3 workers, the vocabulary gathered for sampling."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    split = smollm2_tp3.generate(conversations, params)
    single = llm_fp32.generate(conversations, params)
    for prompt, ours, one, (_, ref_tokens, ref_logprobs) in zip(CHAT_PROMPTS, split, single, reference):
        assert_matches_reference(ours, ref_tokens, ref_logprobs, f"TP=3: {prompt}")
        assert_same_or_near_tie(ours, one, f"TP=3 vs TP=1: {prompt}")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_weights_split_over_workers_compute_what_one_worker_does(tiny_llama, method):
    """Each worker keeps its rows with their scales (QKV, gate/up) or its columns with the whole row's
    scale (o_proj, down; int4: the blocks of its columns, whose scales are their own): the same numbers as one
    worker (tiny Llama, TP=2). With AMX, int8 rounds a step's inputs per 64 values from 16 rows, where a layer's
    columns allow (a worker's half of o_proj here: per 32), and applies its rows' scales after the sums: a value
    at a rounding edge may then round the other way, as with the K-quants below."""
    from conveyor import native

    extra = {"quant.plugin": method}
    split, single = tiny_run(tiny_llama, 2, 1, extra), tiny_run(tiny_llama, 1, 1, extra)
    if method != "int8" or not native.load() or native.ggml_linear_path() != "amx":
        assert_same_logits(split, single, f"{method} TP=2")
        return
    for a, b in zip(split, single):
        assert_same_or_near_tie(a, b, "int8 TP=2")
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=0.02), "int8 TP=2"


@pytest.mark.slow
@pytest.mark.parametrize("stored", ["Q4_K", "fp8"])
def test_stored_quantized_weights_split_along_whole_blocks_compute_what_one_worker_does(tmp_path, tokenizer,
                                                                                        stored):
    """A K-quant GGUF (blocks of 256 values: o_proj's and down's columns cut at 256 and 512, each worker keeps
    its blocks as the file has them) and a compressed-tensors fp8 checkpoint (each worker keeps its rows' scales,
    or the whole rows' for its columns): TP=2 computes TP=1's tokens and logits. (The block kernels round each
    32 activations to int8, and the workers' partial sums round differently in float32 from one worker's sum:
    a value at a rounding edge may round the other way, which moves a logprob by up to about a hundredth
    here; a block cut or scaled wrong moves them by far more.)"""
    import gguf

    from tests.gguf_writer import write_gguf
    from tests.kquants import quantize
    from tests.test_hf_quant import compressed_tensors_checkpoint

    model = tiny_hf_model("llama", vocab_size=98, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                          num_key_value_heads=4)
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    if stored == "Q4_K":
        path = tmp_path / "tiny-Q4_K.gguf"
        write_gguf(path, model, gguf.GGMLQuantizationType.Q4_K, quantize)
    else:
        path = compressed_tensors_checkpoint(tmp_path / "tiny-fp8", model, "FP8_DYNAMIC")
    extra = {"model.tokenizer": str(tmp_path / "tokenizer.json")}
    split, single = tiny_run(path, 2, 1, extra), tiny_run(path, 1, 1, extra)
    if stored == "fp8":  # (float32 activations: nothing rounded but the sums)
        assert_same_logits(split, single, "fp8 TP=2")
        return
    for a, b in zip(split, single):
        assert_same_or_near_tie(a, b, f"{stored} TP=2")
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=0.05), f"{stored} TP=2"
