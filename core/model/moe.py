"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router scores every expert per token; each token goes through its top-k
experts (gated MLPs like the dense one) and their outputs are summed,
weighted by the router's softmax probabilities (renormalized over the top k
where the model does). Qwen2-MoE adds a shared expert every token takes,
scaled by a sigmoid gate.

On a CPU the experts run grouped: the (token, expert) pairs are sorted by
expert and each expert multiplies its tokens in one matmul, through the
quant method's linear (so int8 and fp8 weights work). On CUDA, where the
experts' weights are kept unquantized, the grouped matmuls run in one Triton
kernel each (``conveyor.model.moe_kernels``). Under tensor parallelism each
worker keeps its share of every expert's columns; the sum is all-reduced
after, as for a dense MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.checkpoint import Checkpoint
from conveyor.model.graph_ops import linear_op, register_linear
from conveyor.model.layers import LayerOptions, Linear, WeightPart
from conveyor.model.spec import ModelSpec


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> each token's top-k expert ids and weights ``[T, k]`` (float32 softmax)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


def activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a gated MLP's fused ``[T, 2I]`` output."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


class MoE:
    """One layer's experts, router and (Qwen2-MoE) shared expert, on this worker."""

    def __init__(self, spec: ModelSpec, prefix: str, options: LayerOptions, fused_kernel: bool = False):
        """The layer's experts, declared: ``load`` reads them.

        Args:
            prefix: the layer's MLP, e.g. ``model.layers.3.mlp.``.
            options: ``options.group.placement`` is this worker's place under tensor parallelism (its share of
                every expert's columns).
            fused_kernel: keep the experts' weights stacked for the Triton kernel (CUDA, unquantized).
        """
        self.prefix = prefix
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.activation = spec.activation
        self.num_experts = spec.num_experts
        self.fused_kernel = fused_kernel
        placement = options.group.placement

        def parts(name: str, width: int) -> tuple[list[WeightPart], list[WeightPart], slice | None]:
            """A gated MLP's gate|up rows and its down weight, with the columns of down this worker keeps."""
            part = placement.split(width)
            columns = slice(part.start, part.stop) if placement.tp_size > 1 else None
            return ([(name + "gate_proj.weight", part, 1), (name + "up_proj.weight", part, 1)],
                    [(name + "down_proj.weight", None, 1)], columns)

        def mlp(name: str, width: int) -> tuple[Linear, Linear]:
            gate_up, down, columns = parts(name, width)
            return Linear(options.quant, gate_up), Linear(options.quant, down, inputs=columns)

        names = [f"{prefix}experts.{e}." for e in range(self.num_experts)]
        # (stacked for the grouped kernel, the experts are read in ``load`` and never made layers)
        self._stacked = [parts(name, spec.moe_intermediate_size) for name in names] if fused_kernel else []
        experts = [] if fused_kernel else [mlp(name, spec.moe_intermediate_size) for name in names]
        self.gate_ups = [g for g, _ in experts]
        self.downs = [d for _, d in experts]
        self.router = self.shared_gate = torch.empty(0)
        self.shared = mlp(prefix + "shared_expert.", spec.shared_expert_intermediate_size) \
            if spec.shared_expert_intermediate_size else None
        self.out_features = spec.hidden_size
        self.number = register_linear(self)

    def load(self, ckpt: Checkpoint, options: LayerOptions) -> None:
        def dense(name: str) -> torch.Tensor:
            return ckpt.get(self.prefix + name).to(device=options.device, dtype=options.dtype)

        self.router = dense("gate.weight")
        for linear in self.linears():
            linear.load(ckpt, options)
        if self.shared is not None:
            self.shared_gate = dense("shared_expert_gate.weight")
        if self.fused_kernel:  # [E, 2I, H] and [E, H, I] for the grouped kernel
            def read(weights: list[WeightPart], columns: slice | None) -> torch.Tensor:
                weight = torch.cat([ckpt.get(n) if p is None else ckpt.get(n)[p.start : p.stop] for n, p, _ in weights])
                return weight if columns is None else weight[:, columns]

            self.gate_up_stack = torch.stack([read(g, None) for g, _, _ in self._stacked]).to(options.device,
                                                                                           options.dtype)
            self.down_stack = torch.stack([read(d, c) for _, d, c in self._stacked]).to(options.device, options.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in a compiled graph (its shapes depend on the routing)
            return linear_op(x, self.number)
        return self.apply(x)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> this worker's part of the MLP output ``[T, hidden]`` (all-reduced by the caller)."""
        experts, weights = route(F.linear(x, self.router), self.top_k, self.renormalize)
        if self.fused_kernel:
            from conveyor.model.moe_kernels import fused_moe

            out = fused_moe(x, self.gate_up_stack, self.down_stack, experts, weights, self.activation)
        else:
            out = self._grouped(x, experts, weights)
        if self.shared is not None:
            gate_up, down = self.shared
            shared = down.apply(activate(gate_up.apply(x), self.activation))
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert over its tokens in one matmul: pairs sorted by expert, results added back by token."""
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start : start + n]
            hidden = self.downs[e].apply(activate(self.gate_ups[e].apply(x[rows]), self.activation))
            out.index_add_(0, rows, (hidden * pair_weights[start : start + n]).to(x.dtype))
            start += n
        return out

    def linears(self) -> list:
        shared = list(self.shared) if self.shared is not None else []
        return self.gate_ups + self.downs + shared

    def dense_bytes(self) -> int:
        """Bytes of the weights kept outside the quant method's layers: the routers, the stacked experts."""
        dense = [self.router] + ([self.shared_gate] if self.shared is not None else [])
        if self.fused_kernel:
            dense += [self.gate_up_stack, self.down_stack]
        return sum(t.numel() * t.element_size() for t in dense)
