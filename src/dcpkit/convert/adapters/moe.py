"""What the mixture-of-experts families share: the MoE layer's key map (stacked experts one HF
tensor per expert), TorchTitan's other spellings of it, and its shapes."""

from __future__ import annotations

from typing import Any

from dcpkit.convert.adapters.base import ConversionError

MOE_KEY_MAP: dict[str, str] = {
    "layers.{i}.moe.router.gate.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.moe.experts.w1": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "layers.{i}.moe.experts.w2": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "layers.{i}.moe.experts.w3": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
}
_SHARED = "model.layers.{i}.mlp.shared_experts."
SHARED_EXPERTS_KEY_MAP: dict[str, str] = {
    "layers.{i}.moe.shared_experts.w1.weight": _SHARED + "gate_proj.weight",
    "layers.{i}.moe.shared_experts.w2.weight": _SHARED + "down_proj.weight",
    "layers.{i}.moe.shared_experts.w3.weight": _SHARED + "up_proj.weight",
}


def moe_layer_shapes(args: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer ``layer``'s FFN keys (dense or MoE) in canonical TorchTitan names."""
    p = f"layers.{layer}."
    if layer < args.n_dense_layers:
        return {
            p + "feed_forward.w1.weight": (args.hidden_dim, args.dim),
            p + "feed_forward.w2.weight": (args.dim, args.hidden_dim),
            p + "feed_forward.w3.weight": (args.hidden_dim, args.dim),
        }
    m = args.moe
    shapes = {
        p + "moe.router.gate.weight": (m.num_experts, args.dim),
        p + "moe.experts.w1": (m.num_experts, m.hidden_dim, args.dim),
        p + "moe.experts.w2": (m.num_experts, args.dim, m.hidden_dim),
        p + "moe.experts.w3": (m.num_experts, m.hidden_dim, args.dim),
    }
    if m.num_shared_experts:
        shared = m.hidden_dim * m.num_shared_experts
        shapes.update(
            {
                p + "moe.shared_experts.w1.weight": (shared, args.dim),
                p + "moe.shared_experts.w2.weight": (args.dim, shared),
                p + "moe.shared_experts.w3.weight": (shared, args.dim),
            }
        )
    if m.load_balance_coeff is not None:
        shapes[p + "moe.expert_bias"] = (m.num_experts,)
    return shapes


def leading_dense_layers(config: dict[str, Any], family: str) -> int:
    """How many leading layers of a Qwen 3 MoE ``config.json`` are dense (``mlp_only_layers``
    must be a prefix and every other layer sparse)."""
    dense = sorted(int(i) for i in config.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or int(config.get("decoder_sparse_step", 1)) != 1:
        raise ConversionError(
            f"config.json places its dense layers at {dense} with decoder_sparse_step "
            f"{config.get('decoder_sparse_step')}; {family} supports dense layers only before "
            "every MoE layer"
        )
    return len(dense)
