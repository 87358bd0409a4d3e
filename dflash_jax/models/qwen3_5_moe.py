"""The Qwen3.5 MoE targets (HF model_type `qwen3_5_moe` / `qwen3_5_moe_text`: Qwen3.5-35B-A3B,
122B-A10B): the hybrid stack of models/qwen3_5.py (Gated DeltaNet + gated attention, the fold
rollback) with every layer's MLP a sparse MoE block plus a gated shared expert, as transformers'
`Qwen3_5MoeSparseMoeBlock`:

    out = experts(x) + sigmoid(x @ shared_expert_gate) * shared_expert(x)

  - router (`mlp.gate.weight` [E, H]): softmax over all experts in float32, top-k, always
    renormalised (HF's Qwen3_5MoeTopKRouter divides by the sum whatever norm_topk_prob says),
    the routed experts through models/moe.py (dropless, grouped matmul, expert parallelism on the
    mesh's 'model' axis);
  - the shared expert: a SwiGLU MLP of `shared_expert_intermediate_size`, its output scaled per
    token by the sigmoid of a [H, 1] projection.

Checkpoint keys: the router, `mlp.shared_expert.{gate,up,down}_proj.weight`,
`mlp.shared_expert_gate.weight`, and the experts either per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, as save_pretrained writes them) or stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], transformers' in-memory
layout); both load.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping

import jax
import numpy as np
from flax import nnx

from dflash_jax.config import ConfigError
from dflash_jax.kernel_config import KernelConfig
from dflash_jax.models import qwen3_5
from dflash_jax.models.layers import MLP, init_param
from dflash_jax.models.moe import MoE
from dflash_jax.models.qwen3_5 import Qwen35, Qwen35Config

__all__ = ["Qwen35MoeConfig", "Qwen35Moe", "SharedExpertMoE", "FAMILY", "TEXT_FAMILY", "PRESET_35B_A3B"]


@dataclasses.dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    """Qwen35Config plus the experts. intermediate_size (what a draft made by
    DraftConfig.for_target takes as its MLP width) is the shared expert's width when config.json
    has none (HF's MoE configs have none)."""

    model_type: str = "qwen3_5_moe"
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    READS = ("qwen3_5_moe", "qwen3_5_moe_text")
    NEED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"target: num_experts_per_tok={self.num_experts_per_tok} > "
                              f"num_experts={self.num_experts}")

    @classmethod
    def _intermediate(cls, d) -> int:
        return int(d["shared_expert_intermediate_size"])

    @classmethod
    def _more_fields(cls, d) -> dict:
        return dict(num_experts=int(d["num_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
                    moe_intermediate_size=int(d["moe_intermediate_size"]),
                    shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"]))


class SharedExpertMoE(nnx.Module):
    """The routed experts (models/moe.py) plus the gated shared expert; called as the dense MLP."""

    def __init__(self, c: Qwen35MoeConfig, dtype, rngs: nnx.Rngs):
        H = c.hidden_size
        self.experts = MoE(H, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, True, dtype, rngs)
        self.shared = MLP(H, c.shared_expert_intermediate_size, dtype, rngs)
        self.shared_gate = init_param(rngs, (H, 1), dtype, H ** -0.5)                 # [H, 1]

    def __call__(self, h, groups: int = 1, kernels: KernelConfig | None = None):
        routed = self.experts(h, groups, kernels)
        shared = jax.nn.sigmoid(h @ self.shared_gate[...]) * self.shared(h)      # in h's dtype, as HF
        return routed + shared


class Qwen35Moe(Qwen35):
    """Qwen35 with SharedExpertMoE in every layer."""

    def make_mlp(self, config, dtype, rngs):
        return SharedExpertMoE(config, dtype, rngs)

    @staticmethod
    def mlp_tensors(c: Qwen35MoeConfig, got: dict) -> tuple:
        if "mlp.experts.gate_up_proj" in got or "mlp.experts.down_proj" in got:
            experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
        else:
            experts = tuple(f"mlp.experts.{e}.{k}_proj.weight" for e in range(c.num_experts)
                            for k in ("gate", "up", "down"))
        return _ROUTER_AND_SHARED + experts

    @staticmethod
    def fill_mlp(mlp: SharedExpertMoE, c: Qwen35MoeConfig, t: dict, put) -> None:
        put(mlp.experts.router, t["mlp.gate.weight"].T)
        if "mlp.experts.gate_up_proj" in t:            # stacked [E, 2I, H] / [E, H, I] -> [in, out]
            put(mlp.experts.experts_gate_up, np.transpose(t["mlp.experts.gate_up_proj"], (0, 2, 1)))
            put(mlp.experts.experts_down, np.transpose(t["mlp.experts.down_proj"], (0, 2, 1)))
        else:
            E = c.num_experts
            put(mlp.experts.experts_gate_up, qwen3_5.stack([qwen3_5.cat(
                [t[f"mlp.experts.{e}.gate_proj.weight"].T, t[f"mlp.experts.{e}.up_proj.weight"].T])
                for e in range(E)]))
            put(mlp.experts.experts_down, qwen3_5.stack([t[f"mlp.experts.{e}.down_proj.weight"].T for e in range(E)]))
        s = "mlp.shared_expert."
        put(mlp.shared.gate_up, qwen3_5.cat([t[s + "gate_proj.weight"].T, t[s + "up_proj.weight"].T]))
        put(mlp.shared.down, t[s + "down_proj.weight"].T)
        put(mlp.shared_gate, t["mlp.shared_expert_gate.weight"].T)


_ROUTER_AND_SHARED = ("mlp.gate.weight", "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                      "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")


def _read(d: Mapping[str, Any]) -> Qwen35MoeConfig:
    return Qwen35MoeConfig.from_dict(d)


# Qwen3.5-35B-A3B's text model (random-weight benchmarks: `--random-init qwen3.5-35b-a3b`): 40 layers,
# every 4th full attention (16 q / 2 KV heads x 256, a quarter rotary), GDN 16 k-heads / 32 v-heads
# x 128, 256 experts top-8 of width 512 plus a shared expert of 512
PRESET_35B_A3B = Qwen35MoeConfig(
    vocab_size=248320, hidden_size=2048, intermediate_size=512, num_layers=40, num_heads=16, num_kv_heads=2,
    head_dim=256, layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)),
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144, tie_word_embeddings=False,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512)

FAMILY = dataclasses.replace(qwen3_5.FAMILY, model_type="qwen3_5_moe", read_config=_read, model=Qwen35Moe,
                             load=partial(qwen3_5.load_checkpoint, model_cls=Qwen35Moe))
TEXT_FAMILY = dataclasses.replace(FAMILY, model_type="qwen3_5_moe_text")
