"""The simulator's cost models: the seconds of one step from what it computes and moves.

Cost models:

- **Calibrated** (this machine): ``seconds = a + b x FLOPs + c x bytes + d x
  sequences``, fitted by least squares to the steps of a short real run
  (``calibrate``). On a CPU compute and memory traffic do not overlap much,
  so their times add. Each simulated step's seconds are multiplied by the
  ratio of a calibration step's time to the fit's, drawn at random (seeded):
  the run's jitter, which latency percentiles feel.
- **Datasheet** (a GPU from the table): ``seconds = overhead + max(FLOPs /
  (60% of peak), bytes / (80% of bandwidth))`` per device, the work split
  over ``tensor_parallel_size`` devices, plus two ring all-reduces of the
  hidden states per layer over the interconnect (``--interconnect``: NVLink,
  PCIe, InfiniBand or Ethernet, ``INTERCONNECTS``; each hop its latency,
  the bytes at the datasheet's bandwidth). ``pipeline_parallel_size`` P
  splits the layers over P stages that a step passes in turn (hidden states
  sent between them over the same link), with up to P steps in flight. The
  efficiencies, the 2 ms overhead and the links' latencies are assumptions,
  not measurements: calibrate them on the GPU where there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from conveyor.kvcache import DTYPE_BYTES
from conveyor.messages import StepStats
from conveyor.model.spec import ModelSpec
from conveyor.perf.peaks import DevicePeaks
from conveyor.perf.roofline import weight_counts

# bytes per weight of the linear layers by [quant] plugin (scales aside); embeddings stay in the model dtype
QUANT_BYTES = {"int8": 1, "fp8": 1}
# the datasheet cost model's assumptions
GPU_FLOP_EFFICIENCY = 0.6
GPU_BYTE_EFFICIENCY = 0.8
GPU_STEP_OVERHEAD_S = 0.002
# a KV connector's tiers (``[connector] plugin = "tiers"``): bytes/s of the copies between the pool and host
# memory (both ways: PCIe Gen4 x16's pinned copies from a GPU; a CPU's memcpy runs faster), and of reads from
# the disk tier (an NVMe SSD; its writes run beside the steps); assumptions, not measurements
TIER_BYTES_PER_S = {"host": 25e9, "disk": 3e9}


@dataclass(frozen=True)
class Interconnect:
    """A link between a node's devices (or between nodes): its bandwidth, one way, per device, and the latency
    one hop of a collective adds (an assumption of the order NCCL reaches, not a datasheet figure)."""

    bytes_per_second: float
    latency_s: float
    source: str


# what ``--interconnect`` may name; the bandwidths are the datasheets' (both directions together), halved
INTERCONNECTS = {
    "nvlink5": Interconnect(900e9, 1e-6, "NVIDIA B200 datasheet: fifth-generation NVLink, 1.8 TB/s per GPU"),
    "nvlink4": Interconnect(450e9, 1e-6, "NVIDIA H100 SXM datasheet: fourth-generation NVLink, 900 GB/s per GPU"),
    "nvlink3": Interconnect(300e9, 1e-6, "NVIDIA A100 SXM datasheet: third-generation NVLink, 600 GB/s per GPU"),
    "pcie5": Interconnect(64e9, 3e-6, "NVIDIA H100 PCIe datasheet: PCIe Gen5 x16, 128 GB/s"),
    "pcie4": Interconnect(32e9, 3e-6, "NVIDIA A100 PCIe datasheet: PCIe Gen4 x16, 64 GB/s"),
    "infiniband-ndr": Interconnect(50e9, 5e-6, "NVIDIA ConnectX-7: InfiniBand NDR, 400 Gb/s per port"),
    "ethernet-100g": Interconnect(12.5e9, 10e-6, "IEEE 802.3 100 Gb/s Ethernet (RoCE)"),
}
DEFAULT_INTERCONNECT = "nvlink4"


def weight_bytes(spec: ModelSpec, dtype_bytes: int, quant: str = "none") -> int:
    """Bytes of the model's weights: linear layers at the quant method's size, embeddings in the model dtype."""
    dense, experts, embeddings = weight_counts(spec)
    return (dense + experts) * QUANT_BYTES.get(quant, dtype_bytes) + embeddings * dtype_bytes


@dataclass
class CostModel:
    """Seconds of one step (its scheduling and sampling too) from what it computes and moves."""

    overhead_s: float
    # seconds per FLOP, per byte, per sequence in the step (calibrated); or rates for the roofline (datasheet)
    per_flop: float
    per_byte: float
    per_sequence: float = 0.0
    # the datasheet model: the larger of the compute and the memory time (they overlap), plus the collectives
    # over the link between the devices (bytes/s one way, seconds a hop)
    overlap: bool = False
    tp: int = 1
    hidden_size: int = 0
    num_layers: int = 0
    dtype_bytes: int = 2
    link_bytes_per_s: float = 0.0
    link_latency_s: float = 0.0
    # calibrated: each calibration step's time over the fit's, which the simulator multiplies a step's seconds by
    # (one drawn at random, seeded): the device's jitter and the fit's error, which a P99 latency target feels
    jitter: tuple[float, ...] = ()
    # calibrated: the bytes of the weights the calibration run read (quantized layers at their packed size), which
    # a simulated step reads too; 0: counted from the model's shape, dtype and quant method (``weight_bytes``)
    weight_bytes: int = 0
    # bytes/s of a KV connector's copies by tier (a tier not named: the host's)
    tier_bytes_per_s: dict[str, float] = field(default_factory=lambda: dict(TIER_BYTES_PER_S))

    def transfer_seconds(self, moved: dict[str, float]) -> float:
        """Seconds a step waits for a KV connector's copies: ``moved`` bytes by tier."""
        host = self.tier_bytes_per_s.get("host", TIER_BYTES_PER_S["host"])
        return sum(n / self.tier_bytes_per_s.get(tier, host) for tier, n in moved.items())

    def seconds(self, flops: float, moved: float, sequences: int, tokens: int) -> float:
        if not self.overlap:
            return self.overhead_s + self.per_flop * flops + self.per_byte * moved + self.per_sequence * sequences
        return self.overhead_s + max(self.per_flop * flops, self.per_byte * moved) / self.tp + self.comm_seconds(tokens)

    def comm_seconds(self, tokens: int) -> float:
        """The step's collectives: two all-reduces of [tokens, hidden] per layer, each a ring of 2 (tp - 1) hops
        that carry 2 (tp - 1) / tp of the bytes."""
        if self.tp == 1 or not self.link_bytes_per_s:
            return 0.0
        hops = 2 * (self.tp - 1)
        one = hops * self.link_latency_s + hops / self.tp * tokens * self.hidden_size * self.dtype_bytes / self.link_bytes_per_s
        return 2 * self.num_layers * one

    def hop_seconds(self, tokens: int) -> float:
        """Hidden states of ``tokens`` sent from one pipeline stage to the next."""
        if not self.link_bytes_per_s:
            return 0.0
        return self.link_latency_s + tokens * self.hidden_size * self.dtype_bytes / self.link_bytes_per_s

    @classmethod
    def datasheet(cls, peaks: DevicePeaks, dtype: str, spec: ModelSpec, tp: int = 1,
                  interconnect: str = DEFAULT_INTERCONNECT) -> CostModel:
        link = INTERCONNECTS[interconnect]
        return cls(GPU_STEP_OVERHEAD_S, 1 / (GPU_FLOP_EFFICIENCY * peaks.flops_for(dtype)),
                   1 / (GPU_BYTE_EFFICIENCY * peaks.bytes_per_second), overlap=True, tp=tp,
                   hidden_size=spec.hidden_size, num_layers=spec.num_layers, dtype_bytes=DTYPE_BYTES[dtype],
                   link_bytes_per_s=link.bytes_per_second, link_latency_s=link.latency_s)


def calibrate(steps: Sequence[StepStats], weight_bytes: int = 0) -> CostModel:
    """The least-squares fit of the steps' whole times (schedule, forward, sample, update) to overhead + FLOPs +
    bytes + sequences (each coefficient at least 0), in relative error: a 20 ms decode step weighs as much as a
    2 s prompt step (in absolute error the long steps would decide the fit alone, and the decodes' latency
    would come out several times too long). ``weight_bytes``: the weights the steps read, as stored."""
    rows = np.array([[1.0, s.flops, s.bytes_moved, s.scheduler.num_running] for s in steps])
    times = np.array([s.schedule_time + s.forward_time + s.sample_time + s.update_time for s in steps])
    scale = np.maximum(np.abs(rows).max(axis=0), 1e-30)
    weights = 1 / np.maximum(times, 1e-9)
    active = list(range(4))
    while True:  # (drop a coefficient that comes out negative, fit again)
        fit, *_ = np.linalg.lstsq(rows[:, active] / scale[active] * weights[:, None], times * weights, rcond=None)
        if (fit >= 0).all():
            break
        del active[int(np.argmin(fit))]
    coefficients = np.zeros(4)
    coefficients[active] = fit / scale[active]
    fitted = rows @ coefficients
    jitter = tuple(float(r) for r in times[fitted > 0] / fitted[fitted > 0])
    return CostModel(*(float(c) for c in coefficients), jitter=jitter, weight_bytes=weight_bytes)
