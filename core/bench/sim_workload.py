"""What ``conveyor simulate`` and ``conveyor plan`` serve: the requests ``conveyor bench`` would send, as token
ids, or multi-turn conversations; and the arguments that choose them."""

from __future__ import annotations

import random

import msgspec

from conveyor.bench import flags
from conveyor.bench.costs import DEFAULT_INTERCONNECT, INTERCONNECTS

# the token every simulated step samples
SIMULATED_TOKEN = 1
# --dataset multiturn:TURNS: the tokens of each new question
QUESTION_TOKENS = 32


class SimRequest(msgspec.Struct):
    """One request of the workload: its prompt's token ids and how many tokens it asks for."""

    prompt_token_ids: list[int]
    max_tokens: int


def multiturn(num_requests: int, turns: int, system_len: int, output_len: int, seed: int,
              vocab_size: int) -> list[SimRequest]:
    """Conversations of ``turns`` turns (``num_requests`` requests in all), each turn resending the history: a
    system prompt of its own (``system_len`` random token ids), then per turn a question (``QUESTION_TOKENS``)
    and the reply (``output_len`` tokens, as the simulated model writes them). Turn by turn: every
    conversation's turn k comes before any turn k + 1, so that at a rate the turns arrive spread out."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, vocab_size) for _ in range(n)]

    histories = [tokens(system_len) for _ in range(max(1, num_requests // turns))]
    requests = []
    for _ in range(turns):
        for history in histories:
            history += tokens(QUESTION_TOKENS)
            requests.append(SimRequest(list(history), output_len))
            history += [SIMULATED_TOKEN] * output_len
    return requests


def workload(args) -> list[SimRequest]:
    """The requests ``conveyor bench`` would send with these arguments (dataset, lengths, seed), as token ids;
    or, for ``multiturn:TURNS``, conversations (``multiturn``: ``--input-len`` tokens of system prompt)."""
    from conveyor.bench.command import _tokenizer, build_workload

    tokenizer = _tokenizer(args.tokenizer)
    if args.dataset.startswith("multiturn:"):
        turns = args.dataset.partition(":")[2]
        if not turns.isdigit() or int(turns) < 1:
            raise ValueError(f"--dataset {args.dataset!r}: multiturn:TURNS takes a number of turns, e.g. multiturn:4")
        return multiturn(args.num_requests, int(turns), args.input_len,
                         64 if args.output_len is None else args.output_len, args.seed, tokenizer.vocab_size)
    return [SimRequest(tokenizer.encode_chat(r.messages) if r.messages is not None else list(r.prompt), r.max_tokens)
            for r in build_workload(args, args.num_requests, args.seed)]


def add_workload_arguments(parser) -> None:
    """The arguments ``conveyor simulate`` and ``conveyor plan`` share: config, model, hardware, workload."""
    from conveyor.bench.simulator import MODELS

    parser.add_argument("config_file", nargs="?", help="TOML config (scheduler, KV cache, quant, parallel)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"one of {', '.join(MODELS)}, or a config.json (or its directory)")
    parser.add_argument("--hardware", default="cpu", help="a GPU of the table (conveyor profile --gpus), or cpu: this "
                        "machine, calibrated by a short real run of the config's model")
    parser.add_argument("--interconnect", choices=list(INTERCONNECTS), default=None,
                        help=f"the link between the GPUs (default: {DEFAULT_INTERCONNECT}); see INTERCONNECTS in "
                        "conveyor.bench.simulator for each one's bandwidth and source")
    parser.add_argument("--dataset", default="mixed", help="mixed | random | sharegpt:FILE | multiturn:TURNS "
                        "(conversations resending their history; --input-len: system prompt tokens) (default: mixed)")
    parser.add_argument("--tokenizer", help="sizes the prompts (default: the default model's)")
    parser.add_argument("--num-requests", type=flags.positive(int), default=64)
    parser.add_argument("--burstiness", type=flags.positive(float), default=1.0)
    parser.add_argument("--input-len", type=flags.positive(int), default=256)
    parser.add_argument("--output-len", type=flags.positive(int), default=None)
    parser.add_argument("--range-ratio", type=flags.fraction, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
