"""The ``conveyor`` command: serve, generate, bench, plugins."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from conveyor import __version__
from conveyor.bench.flags import positive
from conveyor.registry import PluginError

logger = logging.getLogger("conveyor")

# errors that are the user's to fix: one line, no traceback
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, ImportError, PluginError)


def _add_config_args(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--config", "-c", required=required, help="TOML config file (default: built-in defaults)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key, e.g. --set model.dtype=float32 (repeatable)",
    )


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """``[MODEL_OR_CONFIG]``, ``--config``, ``--set`` and the shortcuts ``--port``, ``--host``, ... ."""
    from conveyor.config.shortcuts import add_shortcut_args

    parser.add_argument("target", nargs="?", metavar="MODEL_OR_CONFIG",
                        help="a .gguf file, a Hugging Face model directory or an installed model's name to serve "
                        "(model.path), or a .toml config file")
    _add_config_args(parser)
    add_shortcut_args(parser)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, dict[str, object]]:
    """The config file and the overrides that the positional, ``--set`` and the shortcuts give, in that order
    (a shortcut wins over a --set of the same key)."""
    from conveyor.config import ConfigError, parse_override
    from conveyor.config.shortcuts import shortcut_overrides, split_target

    config_file, model = split_target(args.target)
    if config_file and args.config:
        raise ConfigError("give the config file once: as an argument or with --config")
    overrides = dict(parse_override(text) for text in args.overrides)
    return config_file or args.config, {**overrides, **shortcut_overrides(args, model)}


def cmd_generate(args: argparse.Namespace) -> int:
    import msgspec

    from conveyor.entrypoints.llm import LLM
    from conveyor.sampling import SamplingParams

    start = time.perf_counter()
    llm = LLM(*_config_and_overrides(args))
    logger.info("ready in %.1f s", time.perf_counter() - start)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    for completion in llm.generate(prompts, params):
        if args.json:
            result = {k: getattr(completion, k) for k in ("text", "token_ids", "finish_reason")}
            if args.logprobs is not None:
                result["logprobs"] = [msgspec.structs.asdict(entry) for entry in completion.logprobs]
            print(json.dumps(result))
        else:
            print(completion.text)
        num = len(completion.token_ids)
        decode_time = completion.latency - completion.time_to_first_token
        rate = (num - 1) / decode_time if num > 1 and decode_time > 0 else float("nan")
        logger.info(
            "%d prompt tokens, %d generated (%s); first token after %.3f s, then %.1f tokens/s",
            len(completion.prompt_token_ids),
            num,
            completion.finish_reason,
            completion.time_to_first_token,
            rate,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import anyio

    from conveyor.serving.server import serve

    return anyio.run(serve, *_config_and_overrides(args), args.log_level)


def cmd_bench(args: argparse.Namespace) -> int:
    from conveyor.bench.command import main

    return main(args)


def cmd_plugins(args: argparse.Namespace) -> int:
    from conveyor.config import load_config
    from conveyor.registry import PluginRegistry

    registry = PluginRegistry.of(load_config(args.config)) if args.config else PluginRegistry()
    print(registry.describe())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from conveyor.config import paths
    from conveyor.perf.peaks import GPUS, describe_cpu_peaks, profile_cpu

    if args.gpus:
        print("| GPU | bf16 TFLOP/s | fp8 TFLOP/s | int8 TOP/s | HBM TB/s | source |\n|---|---|---|---|---|---|")
        for _, peaks in GPUS:
            flops = {k: f"{v / 1e12:g}" for k, v in peaks.flops.items()}
            print(f"| {peaks.name} | {flops['bfloat16']} | {flops.get('fp8', '-')} | {flops['int8']} | "
                  f"{peaks.bytes_per_second / 1e12:g} | {peaks.source} |")
        return 0
    print("measuring the int8 dot products (alone, and in the packed-block kernels), bfloat16 and float32 "
          "matmuls and the read bandwidth on all threads (the best of 3 runs each) ...", file=sys.stderr)
    peaks, path = profile_cpu(paths.cache_root())
    print(describe_cpu_peaks(peaks, path))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import httpx

    from conveyor.bench.doctor import examine, format_diagnosis, to_json

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.json:
        print(f"reading {args.url}/metrics for {args.interval:g} s ...", file=sys.stderr)
    try:
        diagnosis = examine(args.url, args.interval)
    except httpx.HTTPError as e:
        print(f"error: cannot read {args.url}/metrics: {e}", file=sys.stderr)
        return 2
    print(to_json(diagnosis) if args.json else format_diagnosis(diagnosis))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from conveyor.bench.simulator import main

    return main(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from conveyor.bench.planner import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor LLM inference server")
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI's and Anthropic's APIs) and the other "
                           "configured transports: conveyor serve ./model.gguf --port 8001")
    _add_model_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    _add_model_args(gen)
    gen.add_argument("--prompt", "-p", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's logprob and the N most likely alternatives")
    gen.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason"} per prompt')
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="measure an OpenAI-compatible server under load (TTFT, ITL, throughput)")
    from conveyor.bench.command import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    profile = sub.add_parser("profile", help="measure this CPU's peaks: the packed kernels' int8 dot products, "
                             "bf16 and fp32 matmuls, read bandwidth (what MFU and MBU are taken against), or list "
                             "the GPU table")
    profile.add_argument("--gpus", action="store_true", help="print the GPU peaks table instead (datasheets)")
    profile.set_defaults(func=cmd_profile)

    doctor = sub.add_parser("doctor", help="what limits a running server now (replicas, KV, batch, communication, "
                            "pipeline bubbles, host overhead, queue, prefill, compute, bandwidth), with the evidence "
                            "and the config key to change first")
    doctor.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    doctor.add_argument("--interval", type=positive(float), default=10.0,
                        help="seconds of /metrics to read (default: 10)")
    doctor.add_argument("--json", action="store_true", help="the diagnosis as JSON")
    doctor.set_defaults(func=cmd_doctor)

    simulate = sub.add_parser("simulate", help="what a config would do with a model on hardware you may not have: "
                              "the real scheduler and KV cache on a virtual clock, with bench's report")
    from conveyor.bench.simulator import add_arguments as add_simulate_arguments

    add_simulate_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    plan = sub.add_parser("plan", help="search scheduler, KV cache, quantization and parallelism for the configs "
                          "that carry the most requests within latency SLOs (simulated); prints them as TOML")
    from conveyor.bench.planner import add_arguments as add_plan_arguments

    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    plugins = sub.add_parser("plugins", help="list installed plugins by kind, with their options")
    plugins.add_argument("--config", "-c", help="also load the plugin modules this config lists")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
