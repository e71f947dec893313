"""The ``conveyor`` command's handling of what a user gives it: a file or a flag it cannot use is refused with
exit status 2 and a line ``error: ...`` naming the file or the flag and what was expected (after argparse's usage
lines for a flag)."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.stats import RequestRecord, summarize
from conveyor.entrypoints.cli import main


def refusal(capsys, argv: list[str]) -> str:
    """The line ``conveyor argv`` refuses with (exit status 2 and nothing on stdout): the command's one line, or
    argparse's after its usage lines (``conveyor bench: error: ...``), as ``error: ...``."""
    try:
        status = main(argv)
    except SystemExit as e:  # (argparse's own refusals exit)
        status = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2 and not out and lines, (status, out, err)
    last = lines[-1]
    if len(lines) > 1:  # (argparse: usage, then "PROG: error: ...")
        assert lines[0].startswith("usage: ") and ": error: " in last, err
        last = "error: " + last.split(": error: ", 1)[1]
    assert last.startswith("error: "), err
    return last


def a_run(rate: float | None) -> dict:
    """A run as ``conveyor bench --json`` writes it (a null rate is inf)."""
    records = [RequestRecord(0, 10, output_tokens=3, start=0.0, ttft=0.1, e2e=0.5, itl=[0.2, 0.2])]
    return {"label": "a", "config": {"rate": rate}, "summary": summarize(records, 1.0)}


@pytest.mark.parametrize("content, problem", [
    ({}, "the run has no 'config' object"),
    ([], "the top level is not an object"),
    ({"config": {"rate": 1.0}, "summary": []}, "the run has no 'summary' object"),
    ({"runs": [a_run(1.0), {"config": {}, "summary": {k: v for k, v in a_run(1.0)["summary"].items()
                                                      if k != "failed"}}]}, "runs[1]'s summary lacks 'failed'"),
    ({"runs": {}}, "runs is not a list of runs"),
])
def test_compare_names_the_file_that_is_not_a_result(tmp_path, capsys, content, problem):
    good, bad = tmp_path / "run1.json", tmp_path / "bad.json"
    good.write_text(json.dumps(a_run(None)))
    bad.write_text(json.dumps(content))
    line = refusal(capsys, ["bench", "compare", str(bad), str(good)])
    assert line.startswith(f"error: {bad}: {problem}; expected the JSON of conveyor bench --json"), line
    # the good file, and a sweep of two, compare as they are
    (tmp_path / "sweep.json").write_text(json.dumps({"runs": [a_run(1.0), a_run(None)]}))
    assert main(["bench", "compare", str(good), str(tmp_path / "sweep.json")]) == 0
    assert capsys.readouterr().out.count("\n   inf ") == 2


def test_compare_names_a_file_that_is_not_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert refusal(capsys, ["bench", "compare", str(bad)]).startswith(f"error: {bad}: not JSON (")


@pytest.mark.parametrize("content, problem", [
    ('{"not": "a list"}', "the top level is not a list"),
    ('["text", {"conversations": "no"}, {"conversations": ["a", "b"]}]', "no conversations with a question"),
    ("[", "not JSON ("),
])
def test_a_sharegpt_file_of_another_shape_is_named(tmp_path, capsys, content, problem):
    path = tmp_path / "f.json"
    path.write_text(content)
    line = refusal(capsys, ["bench", "--url", "http://127.0.0.1:9", "--dataset", f"sharegpt:{path}",
                            "--num-requests", "2", "--warmup", "0"])
    assert line.startswith(f"error: {path}: {problem}") and "expected a ShareGPT list" in line, line


BENCH = ["bench", "--url", "http://127.0.0.1:9", "--ready-timeout", "0", "--warmup", "0", "--num-requests", "1",
         "--dataset", "random", "--input-len", "4"]
PLAN = ["plan", "--hardware", "H100", "--slo", "ttft_p99=1s"]


@pytest.mark.parametrize("argv, flag, value, expected", [
    (BENCH, "--output-len", "0", "an integer > 0"),
    (BENCH, "--num-requests", "0", "an integer > 0"),
    (BENCH, "--input-len", "-3", "an integer > 0"),
    (BENCH, "--max-concurrency", "-1", "an integer >= 0"),
    (BENCH, "--warmup", "-1", "an integer >= 0"),
    (BENCH, "--request-rate", "nan", "a number > 0 or inf"),
    (BENCH, "--request-rate", "0", "a number > 0 or inf"),
    (BENCH, "--sweep", "1,nan", "a number > 0 or inf"),
    (BENCH, "--burstiness", "inf", "a number > 0"),
    (BENCH, "--ready-timeout", "-1", "a number >= 0"),
    (BENCH, "--temperature", "nan", "a number >= 0"),
    (BENCH, "--range-ratio", "1", "a number in [0, 1)"),
    (BENCH, "--range-ratio", "-0.5", "a number in [0, 1)"),
    (PLAN, "--range-ratio", "nan", "a number in [0, 1)"),
    (["simulate", "--hardware", "H100"], "--num-requests", "0", "an integer > 0"),
    (["simulate", "--hardware", "H100"], "--request-rate", "2,-1", "a number > 0 or inf"),
    (["simulate", "--hardware", "H100"], "--output-len", "0", "an integer > 0"),
    (PLAN, "--num-requests", "0", "an integer > 0"),
    (PLAN, "--top", "0", "an integer > 0"),
    (["doctor", "http://127.0.0.1:9"], "--interval", "-1", "a number > 0"),
    (["doctor", "http://127.0.0.1:9"], "--interval", "nan", "a number > 0"),
])
def test_a_number_out_of_range_is_refused_naming_the_flag(capsys, argv, flag, value, expected):
    """Each command's numeric flags refuse 0, negatives, NaN and inf where they mean nothing, before anything
    runs: one line naming the flag, what it takes and what it got (not a default put in its place, NaNs in a
    report, or a library's error without the flag)."""
    line = refusal(capsys, [*argv, f"{flag}={value}"])
    assert line == f"error: argument {flag}: expected {expected}, got {value.split(',')[-1]!r}", line


def test_the_flags_take_what_they_mean():
    """0 where it means none or no limit, inf for a rate, and the lengths as given."""
    from conveyor.bench.command import build_workload
    from conveyor.entrypoints.cli import build_parser

    args = build_parser().parse_args([*BENCH, "--max-concurrency", "0", "--warmup", "0", "--request-rate", "inf",
                                      "--sweep", "0.5,inf", "--ready-timeout", "0", "--output-len", "5"])
    inf = float("inf")
    assert (args.max_concurrency, args.warmup, args.request_rate, args.sweep) == (0, 0, inf, [0.5, inf])
    assert [r.max_tokens for r in build_workload(args, 3, seed=0)] == [5, 5, 5]
    assert build_parser().parse_args(["doctor", "--interval", "0.5"]).interval == 0.5


def test_goodput_names_a_bound_that_is_not_a_number_of_milliseconds(capsys):
    line = refusal(capsys, [*BENCH, "--goodput", "ttft:-5"])
    assert line == "error: --goodput 'ttft:-5': expected a number > 0, got '-5' (milliseconds)", line
