"""benchmarks/gpu_check.py, the day-one script for a GPU, runs here at tiny shapes (``--cpu-smoke``): the same
code, so it cannot rot between the days a GPU is at hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_cpu_smoke_passes_every_point_and_writes_its_numbers(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke", "--json",
                             str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    points = {p["point"]: p for p in report["points"]}
    assert {p["status"] for p in report["points"]} <= {"PASS", "SKIP"}
    for name in ("kernels", "decode b=1 graphs=off", "decode b=8 graphs=off", "decode b=64 graphs=off",
                 "prefill 2 x 64", "mp executor"):
        assert points[name]["status"] == "PASS", points[name]
        assert f"PASS {name}: " in result.stdout
    # the GPU-only points say why they did not run
    assert points["decode graphs=on"]["status"] == points["NVML"]["status"] == "SKIP"
    assert points["kernels"]["gemm_attention_failures"] == 0 and points["kernels"]["lora_error"] < 2e-2
    for batch in (1, 8, 64):
        decode = points[f"decode b={batch} graphs=off"]
        assert decode["batch"] == batch and decode["itl_ms"] > 0 and math.isfinite(decode["floor_ms"])
    assert points["prefill 2 x 64"]["tokens_per_second"] > 0
