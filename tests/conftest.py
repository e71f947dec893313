"""Shared fixtures: the real SmolLM2 weights, Conveyor on them, and transformers as the oracle."""

from __future__ import annotations

import inspect
import logging
import os
import random
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton kernels run on CPU tensors in the interpreter; it must be chosen
# before any kernel is defined, so before test modules import them.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Give me a tip for learning to play the guitar.",
    "Who wrote Romeo and Juliet?",
]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from conveyor.model.checkpoint import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def llm_fp32():
    """Conveyor on SmolLM2 at float32, the configuration compared with transformers."""
    from conveyor import LLM

    logging.getLogger("conveyor").setLevel(logging.WARNING)
    return LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.seed": 1234})


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer, built from the GGUF metadata."""
    from conveyor.config import ModelConfig
    from conveyor.model.tokenizer import load_tokenizer

    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """transformers' own Llama on the same GGUF file: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture()
def random_seed() -> int:
    """Fresh random inputs each run, reproducible: seeds Python's and torch's generators and prints the seed
    (pytest shows it for a failing test; CONVEYOR_TEST_SEED=N replays it)."""
    import torch

    seed = int(os.environ.get("CONVEYOR_TEST_SEED") or secrets.randbelow(2**31))
    random.seed(seed)
    torch.manual_seed(seed)
    print(f"random seed {seed} (replay with CONVEYOR_TEST_SEED={seed})")
    return seed


# tokens each reference continuation has
NUM_TOKENS = 48


def hf_greedy(hf_model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' forward pass; returns tokens and each step's log_softmax."""
    import torch
    from transformers import DynamicCache

    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    # transformers 5 names the argument `cache`, 4.x `past_key_values`; the cache fills in place.
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=hf_model.config)
    inputs = torch.tensor([prompt_ids])
    with torch.inference_mode():
        for _ in range(num_tokens):
            out = hf_model(inputs, use_cache=True, **{name: cache})
            step = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
            token = int(step.argmax())
            tokens.append(token)
            logprobs.append(step)
            inputs = torch.tensor([[token]])
    return tokens, logprobs


@pytest.fixture(scope="session")
def reference(hf_model, tokenizer):
    """transformers' greedy continuation of each chat prompt."""
    results = []
    for prompt in CHAT_PROMPTS:
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        results.append((ids, *hf_greedy(hf_model, ids, NUM_TOKENS)))
    return results


# the largest file the shared server's Files API takes
BATCH_FILE_MB = 4


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One `conveyor serve` with the default config (on free ports) and the Batch API's files in a folder of its
    own (up to 4 MB each), shared by every test that needs nothing else of a server. Tests that kill its engine
    wait for the new one; tests read its counters as differences."""
    from tests.server import Server, http_config

    tmp = tmp_path_factory.mktemp("default_server")
    config = http_config() + f'\n[batch]\ndir = "{tmp / "batch"}"\nmax_file_mb = {BATCH_FILE_MB}\n'
    server = Server(config, tmp).start()
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="session")
def openai_client(default_server):
    """The openai client on the shared server, for the tests that only send it requests (structured output,
    tool calls)."""
    import openai

    with openai.OpenAI(base_url=f"{default_server.http}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client
