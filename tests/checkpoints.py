"""Independent oracles for the tests: tiny Qwen3 targets and DFlash drafts written by transformers and
the reference `dflash` package (PyPI 0.1.0) with `save_pretrained`, plus a small *trained* pair.

Nothing here imports dflash_jax: these checkpoints are what the JAX code must read and reproduce.

- `write_target` / `write_draft`: random weights, non-unit RMSNorm weights (a wrong norm shows).
- `train_target`: a Qwen3ForCausalLM trained briefly on a synthetic second-order grammar, so its
  continuations are learnable by a draft; a random target's continuations are too chaotic.
- `train_draft`: the paper's recipe scaled down (anchors inside target-generated responses, block
  [anchor, MASK x (S-1)], context = target taps strictly before the anchor, decaying slot weights),
  then τ measured with the reference `dflash_generate` on held-out prompts.
- `reference_generate`: `dflash.model.dflash_generate` made to run on a CPU-only torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from collections import Counter

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "hf_greedy", "write_target", "write_moe_target", "write_fp8_target", "to_fp8", "fp8_dequantized_hf",
    "write_fp8_dequantized", "write_draft", "load_torch_pair", "train_target", "train_draft",
    "reference_generate", "random_prompts", "acceptance_histogram", "saved_tensor_names",
    "draft_tensor_names", "DRAFT_TENSOR_SUFFIXES", "make_grammar", "build_trained_pair", "read_pair",
    "TRAINED_PAIR", "SMALL_VOCAB_PAIR", "default_target_layer_ids", "pack_blocks", "torch_block_loss",
]

# Per-layer tensors of a z-lab draft (prefixed by `layers.N.`), besides fc / hidden_norm / norm.
DRAFT_TENSOR_SUFFIXES = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def draft_tensor_names(num_layers: int) -> set[str]:
    """The exact tensor names of a z-lab draft checkpoint with `num_layers` layers."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    names |= {f"layers.{i}.{s}" for i in range(num_layers) for s in DRAFT_TENSOR_SUFFIXES}
    return names


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference package's default taps (used when a config has no target_layer_ids)."""
    from dflash.model import build_target_layer_ids

    return list(build_target_layer_ids(num_target_layers, num_draft_layers))


def saved_tensor_names(path: str) -> set[str]:
    """Tensor names over every *.safetensors file in a checkpoint directory."""
    names: set[str] = set()
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                names |= set(st.keys())
    return names


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def _noisy_norms(model: torch.nn.Module, gen: torch.Generator, scale: float = 0.2) -> None:
    """Every RMSNorm weight to 1 + scale * N(0, 1): a missing or misplaced norm changes the output."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + scale * torch.randn(p.shape, generator=gen))


def _qwen3_config(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def write_target(path: str, *, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 128,
                 num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                 tie_word_embeddings: bool = False, seed: int = 0, norm_noise: bool = True,
                 dtype: torch.dtype = torch.float32, init_std: float = 0.1, **extra) -> str:
    """A random `transformers.Qwen3ForCausalLM`, saved with `save_pretrained` (safetensors).

    `init_std` (saved as `initializer_range`) is 5x the HF default so the logits of a 64-wide model
    are not all ~uniform; `extra` goes into the `Qwen3Config`."""
    from transformers import Qwen3ForCausalLM

    cfg_kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, tie_word_embeddings=tie_word_embeddings, max_position_embeddings=4096,
                  rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=init_std, hidden_act="silu",
                  attention_bias=False, use_sliding_window=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    cfg_kw.update(extra)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_qwen3_config(**cfg_kw)).eval()
    if norm_noise:
        _noisy_norms(model, _seeded(seed + 1))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


def write_moe_target(path: str, *, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 96,
                     moe_intermediate_size: int = 32, num_experts: int = 8, num_experts_per_tok: int = 2,
                     norm_topk_prob: bool = True, decoder_sparse_step: int = 1, mlp_only_layers=(),
                     num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                     seed: int = 0, router_std: float = 0.5, dtype: torch.dtype = torch.float32,
                     init_std: float = 0.1) -> str:
    """A random `transformers.Qwen3MoeForCausalLM` saved with `save_pretrained` (the Hub's per-expert
    keys). The routers get std `router_std` so tokens spread over several experts (a router near
    zero would send near-ties to top-k); norms are noisy as in `write_target`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
                         num_experts_per_tok=num_experts_per_tok, norm_topk_prob=norm_topk_prob,
                         decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=4096,
                         rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=init_std, hidden_act="silu",
                         tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    gen = _seeded(seed + 1)
    _noisy_norms(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(router_std * torch.randn(p.shape, generator=gen))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_block_quantize(w: torch.Tensor, block, gen: torch.Generator):
    """w [out, in] float32 → (float8_e4m3fn [out, in], weight_scale_inv [ceil(out/n), ceil(in/k)]
    float32) the way Qwen's / DeepSeek's FP8 checkpoints are made: per block, scale = amax / 448.
    Each block is first multiplied by a random factor in [0.5, 2] so the blocks' scales differ (a
    scale applied to the wrong block shows)."""
    n, k = block
    rows, cols = -(-w.shape[0] // n), -(-w.shape[1] // k)
    factor = torch.exp2(torch.rand((rows, cols), generator=gen) * 2 - 1)
    w = w * factor.repeat_interleave(n, 0)[:w.shape[0]].repeat_interleave(k, 1)[:, :w.shape[1]]
    amax = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            amax[i, j] = w[i * n:(i + 1) * n, j * k:(j + 1) * k].abs().max()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = scale.repeat_interleave(n, 0)[:w.shape[0]].repeat_interleave(k, 1)[:, :w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def write_fp8_target(path: str, *, block=(128, 128), keep_float=(), seed: int = 0, moe: bool = False,
                     **target_kw) -> str:
    """A random Qwen3 (`write_target(**target_kw)`, float32; `moe`: a Qwen3-MoE, `write_moe_target`)
    rewritten as an FP8 checkpoint in Qwen's format: every layer linear (`FP8_LINEARS`, the experts'
    too; not the MoE router) as float8_e4m3fn + `weight_scale_inv`, config.json's
    `quantization_config` {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size};
    embeddings, norms and the LM head stay float32. `keep_float`: layer tensor names (e.g.
    "model.layers.0.self_attn.o_proj.weight") left unquantized, as `modules_to_not_convert` does."""
    (write_moe_target if moe else write_target)(path, seed=seed, **target_kw)
    return to_fp8(path, block=block, linears=FP8_LINEARS, keep_float=keep_float, seed=seed)


def to_fp8(path: str, *, block=(128, 128), linears=FP8_LINEARS, keep_float=(), seed: int = 0) -> str:
    """The float checkpoint at `path` (one or more safetensors files) rewritten in place as an FP8
    checkpoint in Qwen's format: every tensor `X.weight` whose module name (X's last part) is in
    `linears` and not in `keep_float` as float8_e4m3fn + `X.weight_scale_inv` (`_fp8_block_quantize`),
    the rest as they were, and config.json's `quantization_config` added."""
    gen = _seeded(seed + 7)
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                tensors.update({k: st.get_tensor(k) for k in st.keys()})
            os.remove(os.path.join(path, f))
    for f in os.listdir(path):
        if f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(path, f))
    out = {}
    for name, t in sorted(tensors.items()):
        if name.endswith(".weight") and t.ndim == 2 and name.split(".")[-2] in linears and name not in keep_float:
            out[name], out[name + "_scale_inv"] = _fp8_block_quantize(t.float(), block, gen)
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = _target_config_dict(path)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def write_fp8_dequantized(path: str, out: str) -> str:
    """The FP8 checkpoint at `path` dequantized in torch (weight.float() * weight_scale_inv spread
    over each block) and saved at `out` as a float32 checkpoint without quantization_config."""
    import shutil
    cfg = _target_config_dict(path)
    n, k = cfg.pop("quantization_config")["weight_block_size"]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as st:
        tensors = {name: st.get_tensor(name) for name in st.keys()}
    state = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            t = t.float() * s.repeat_interleave(n, 0)[:t.shape[0]].repeat_interleave(k, 1)[:, :t.shape[1]]
        state[name] = t.float().contiguous()
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(path):
        if not f.endswith(".safetensors") and f != "config.json":
            shutil.copy(os.path.join(path, f), out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out


def fp8_dequantized_hf(path: str):
    """The oracle of an FP8 checkpoint: transformers' Qwen3ForCausalLM (float32) holding its weights
    dequantized in torch (weight.float() * weight_scale_inv spread over each block)."""
    from transformers import Qwen3ForCausalLM

    cfg = _target_config_dict(path)
    n, k = cfg.pop("quantization_config")["weight_block_size"]
    tensors = {}
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as st:
        tensors = {name: st.get_tensor(name) for name in st.keys()}
    state = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"]
            t = t.float() * s.repeat_interleave(n, 0)[:t.shape[0]].repeat_interleave(k, 1)[:, :t.shape[1]]
        state[name] = t.float()
    model = Qwen3ForCausalLM(_qwen3_config(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                           "transformers_version")}))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" and cfg["tie_word_embeddings"]
                                  for m in missing), (missing, unexpected)
    return model.float().eval().requires_grad_(False)


def _target_config_dict(target_path: str) -> dict:
    with open(os.path.join(target_path, "config.json")) as f:
        return json.load(f)


def _draft_config(target_path: str, *, num_layers: int, block_size: int, mask_token_id: int | None,
                  target_layer_ids, intermediate_size: int | None = None):
    """A draft `Qwen3Config` the way z-lab writes them: the target's width, heads, vocab and RoPE, plus
    `num_target_layers`, `block_size` and `dflash_config`."""
    t = _target_config_dict(target_path)
    rope = (t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))
    cfg = _qwen3_config(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
        intermediate_size=intermediate_size or t["intermediate_size"], num_hidden_layers=num_layers,
        num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"], rms_norm_eps=t["rms_norm_eps"], rope_theta=rope,
        max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=False,
        initializer_range=t.get("initializer_range", 0.02), hidden_act="silu", attention_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = t["num_hidden_layers"]
    cfg.block_size = block_size
    dflash = {"mask_token_id": t["vocab_size"] - 1 if mask_token_id is None else int(mask_token_id)}
    if target_layer_ids is not None:  # None: leave it out, so readers use the default formula
        dflash["target_layer_ids"] = [int(i) for i in target_layer_ids]
    cfg.dflash_config = dflash
    return cfg


def _save_draft(draft, path: str) -> str:
    """`save_pretrained`, then keep exactly the z-lab tensor names (no rotary buffers, nothing else)."""
    draft.save_pretrained(path, safe_serialization=True)
    want = draft_tensor_names(draft.config.num_hidden_layers)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    have = saved_tensor_names(path)
    missing = want - have
    if missing:
        raise AssertionError(f"draft save lacks {sorted(missing)[:5]}")
    if have != want or len(files) != 1:  # rewrite as one clean file
        tensors = {}
        for f in files:
            with safe_open(os.path.join(path, f), "pt") as st:
                tensors.update({k: st.get_tensor(k) for k in st.keys() if k in want})
            os.remove(os.path.join(path, f))
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            os.remove(index)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
    return path


def write_draft(path: str, target_path: str, *, num_layers: int = 2, block_size: int = 8,
                mask_token_id: int | None = None, target_layer_ids=None, seed: int = 0,
                norm_noise: bool = True, dtype: torch.dtype = torch.float32) -> str:
    """A random reference `dflash.model.DFlashDraftModel` for the target at `target_path`, saved in
    z-lab format. `mask_token_id` defaults to vocab_size - 1; `target_layer_ids=None` omits the field."""
    from dflash.model import DFlashDraftModel

    cfg = _draft_config(target_path, num_layers=num_layers, block_size=block_size,
                        mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg).eval()
    if norm_noise:
        _noisy_norms(draft, _seeded(seed + 1))
    return _save_draft(draft.to(dtype), path)


def load_torch_pair(target_path: str, draft_path: str | None = None):
    """(HF Qwen3ForCausalLM, reference DFlashDraftModel or None), float32, eval mode, no grads."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval().requires_grad_(False)
    draft = None
    if draft_path is not None:
        draft = DFlashDraftModel.from_pretrained(draft_path, dtype=torch.float32).eval().requires_grad_(False)
    return target, draft


@contextlib.contextmanager
def _cpu_clock():
    # dflash_generate(return_stats=True) times with torch.cuda.synchronize(), which a CPU torch refuses.
    import dflash.model as ref

    saved = ref._cuda_time
    ref._cuda_time = time.perf_counter
    try:
        yield
    finally:
        ref._cuda_time = saved


def hf_greedy(hf, prompt, n: int, eos=None) -> list[int]:
    """transformers' own greedy decoding of `n` tokens after `prompt` (a list of ids), no stop unless `eos`."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=eos, pad_token_id=0 if eos is None else eos)
    return out[0, len(prompt):].tolist()


def reference_generate(draft, target, input_ids, max_new_tokens: int, *, temperature: float = 0.0,
                       block_size: int | None = None, stop_token_ids=None, seed: int | None = None, **kw):
    """`dflash.model.dflash_generate(..., return_stats=True)` on a CPU torch. `input_ids`: list or [1, P]."""
    from dflash.model import dflash_generate

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if seed is not None:
        torch.manual_seed(seed)
    with _cpu_clock(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        return dflash_generate(draft, target, ids, max_new_tokens, stop_token_ids, temperature=temperature,
                               block_size=block_size, return_stats=True, **kw)


def random_prompts(n: int, vocab_size: int, *, min_len: int = 8, max_len: int = 16, seed: int = 0,
                   exclude=()) -> list[list[int]]:
    """n prompts of uniform random tokens in [0, vocab_size) minus `exclude`, lengths in [min_len, max_len]."""
    gen = _seeded(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(exclude)])
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        out.append(allowed[torch.randint(len(allowed), (length,), generator=gen)].tolist())
    return out


def acceptance_histogram(lengths) -> dict[int, int]:
    return dict(sorted(Counter(int(x) for x in lengths).items()))


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _torch_threads(n: int | None):
    # Tiny matrices: one thread beats two (no spin-waits on a busy 2-core CI box). Restored after.
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _cosine_lr(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _grammar_batch(grammar: dict, batch: int, length: int, p_jump: float, gen: torch.Generator) -> torch.Tensor:
    """Sequences of the synthetic grammar over tokens [0, n): next = succ[cur], except when cur is a
    branch token and the previous token is in the lower half (then succ2[cur]); with probability
    p_jump a uniform token instead. [batch, length] int64."""
    succ, succ2, branch = (torch.tensor(grammar[k]) for k in ("succ", "succ2", "branch"))
    n = len(succ)
    seq = torch.empty(batch, length, dtype=torch.long)
    seq[:, :2] = torch.randint(n, (batch, 2), generator=gen)
    jumps = torch.rand(batch, length, generator=gen) < p_jump
    rand = torch.randint(n, (batch, length), generator=gen)
    for t in range(2, length):
        cur, prev = seq[:, t - 1], seq[:, t - 2]
        nxt = torch.where(branch[cur] & (prev < n // 2), succ2[cur], succ[cur])
        seq[:, t] = torch.where(jumps[:, t], rand[:, t], nxt)
    return seq


def make_grammar(n_tokens: int, p_branch: float, seed: int) -> dict:
    """succ: a random permutation of [0, n_tokens); succ2: another; branch: the tokens (a p_branch
    fraction) whose successor also depends on the token before them (a second-order rule, so the
    draft has to track the path through its block and errs more the further a slot is)."""
    gen = _seeded(seed)
    return dict(succ=torch.randperm(n_tokens, generator=gen).tolist(),
                succ2=torch.randperm(n_tokens, generator=gen).tolist(),
                branch=(torch.rand(n_tokens, generator=gen) < p_branch).tolist())


def train_target(path: str, *, vocab_size: int = 128, steps: int = 100, batch_size: int = 32, seq_len: int = 32,
                 p_jump: float = 0.15, p_branch: float = 0.5, lr: float = 3e-3, seed: int = 0,
                 num_threads: int | None = 1,
                 **target_kw) -> dict:
    """A genuine Qwen3ForCausalLM (shapes as `write_target`, random init, noisy norms) trained briefly on
    a synthetic grammar over tokens [0, vocab_size - 1) (see `make_grammar`): next = succ[cur], or
    succ2[cur] for branch tokens preceded by a lower-half token; with probability p_jump a uniform token.
    The last id (vocab_size - 1) never occurs in the data: it is the draft's MASK. Greedy continuations
    follow the grammar, so a draft can learn them; at T = 1 the target keeps ~p_jump of entropy.
    Saved with `save_pretrained`; returns stats (`greedy_follows_grammar`: the greedy next-token match
    rate on clean grammar sequences, ~0.99)."""
    with _torch_threads(num_threads), torch.random.fork_rng():
        return _train_target(path, vocab_size=vocab_size, steps=steps, batch_size=batch_size, seq_len=seq_len,
                             p_jump=p_jump, p_branch=p_branch, lr=lr, seed=seed, **target_kw)


def _train_target(path, *, vocab_size, steps, batch_size, seq_len, p_jump, p_branch, lr, seed, **target_kw):
    from transformers import Qwen3ForCausalLM

    t0 = time.perf_counter()
    write_target(path, vocab_size=vocab_size, seed=seed, **target_kw)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    grammar = make_grammar(vocab_size - 1, p_branch, seed + 17)
    gen = _seeded(seed + 18)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * _cosine_lr(step, steps, warmup)
        seq = _grammar_batch(grammar, batch_size, seq_len, p_jump, gen)
        logits = model(seq).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval().save_pretrained(path, safe_serialization=True)
    with torch.no_grad():
        probe = _grammar_batch(grammar, 64, seq_len, 0.0, gen)
        greedy = model(probe).logits[:, :-1].argmax(-1)
        follows = float((greedy[:, 1:] == probe[:, 2:]).float().mean())
    return dict(path=path, final_loss=sum(losses[-10:]) / 10, greedy_follows_grammar=follows,
                grammar=grammar, p_jump=p_jump, seconds=time.perf_counter() - t0)


@torch.no_grad()
def _target_sequences(target, prompts: list[list[int]], seq_len: int, sampled: list[bool],
                      seed: int) -> torch.Tensor:
    """Each prompt continued by the target itself to seq_len tokens in all: greedily, or sampled at
    temperature 1 where `sampled[i]`. Batched per (prompt length, mode), attention mask all ones."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((len(p), bool(sampled[i])), []).append(i)
    out: list[torch.Tensor] = [None] * len(prompts)  # type: ignore[list-item]
    torch.manual_seed(seed)
    for (length, sample), idx in sorted(groups.items()):
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        extra = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        seqs = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=seq_len - length,
                               min_new_tokens=seq_len - length, pad_token_id=0, eos_token_id=None, **extra)
        for row, i in enumerate(idx):
            out[i] = seqs[row]
    return torch.stack(out)


def _measure(draft, target, prompts, max_new_tokens: int, block_size: int, temperature: float, seed: int):
    lengths = []
    for i, p in enumerate(prompts):
        r = reference_generate(draft, target, p, max_new_tokens, temperature=temperature, block_size=block_size,
                               seed=seed + i)
        lengths += list(r.acceptance_lengths)
    return dict(tau=sum(lengths) / len(lengths), histogram=acceptance_histogram(lengths), iterations=len(lengths))


def pack_blocks(seqs: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """K training blocks per sequence, packed after the sequence's context (the paper's layout).

    seqs [R, T] token ids, anchors [R, K] with anchor + block_size <= T. Block k of row r is
    [seqs[r, a], MASK x (S-1)] at positions [a, a+S), a = anchors[r, k]; its queries see the context
    keys at positions < a and the keys of their own block only. Returns block ids [R, K*S], labels
    [R, K, S-1] (seqs[r, a+1 .. a+S-1]), position_ids [R, T + K*S] (context 0..T-1, then the blocks)
    and the visibility mask [R, K*S, T + K*S] (True = attend), for the draft's forward with
    target_hidden = the target's tap features of all T positions."""
    R, T = seqs.shape
    K, S = anchors.shape[1], block_size
    offs = torch.arange(S)
    block = torch.full((R, K, S), mask_token_id, dtype=torch.long)
    block[:, :, 0] = seqs.gather(1, anchors)
    labels = seqs.gather(1, (anchors[:, :, None] + offs[1:]).view(R, -1)).view(R, K, S - 1)
    position_ids = torch.cat([torch.arange(T).expand(R, T), (anchors[:, :, None] + offs).view(R, K * S)], 1)
    key_pos = torch.arange(T + K * S)
    key_block = (key_pos - T).div(S, rounding_mode="floor")  # block of each block key; < 0 for context
    query_anchor = anchors.repeat_interleave(S, dim=1)  # [R, K*S]
    query_block = torch.arange(K).repeat_interleave(S)  # [K*S]
    visible = torch.where(key_block[None, None, :] < 0,
                          key_pos[None, None, :] < query_anchor[:, :, None],
                          key_block[None, None, :] == query_block[None, :, None])
    return block.view(R, K * S), labels, position_ids, visible


def torch_block_loss(draft, target, tokens, loss_mask, anchors, keep, block_size: int, mask_token_id: int,
                     gamma: float) -> torch.Tensor:
    """dflash_jax.train's loss restated on the reference draft in torch (the oracle of
    tests/test_train_loss_oracle.py), on given anchors: Σ w·CE / Σ w over the blocks [tok[a], MASK x
    (S-1)] at positions [a, a+S) (the layout of `pack_blocks`: context = the target's taps strictly
    before a, each block seeing itself), slot k = 1..S-1 predicting tok[a+k] through the target's LM
    head, w = exp(-(k-1)/γ) · loss_mask[a+k] · (a+k < T) · keep. tokens, loss_mask [B, T]; anchors,
    keep [B, N] (any array type). Returns the scalar loss, differentiable in the draft's parameters."""
    from dflash.model import extract_context_feature

    tokens = torch.as_tensor(tokens, dtype=torch.long)
    loss_mask = torch.as_tensor(loss_mask).float()
    anchors = torch.as_tensor(anchors, dtype=torch.long)
    keep = torch.as_tensor(keep, dtype=torch.bool)
    (B, T), S = tokens.shape, block_size
    with torch.no_grad():
        out = target(tokens, output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, draft.target_layer_ids)          # [B, T, n·H]
    # S-1 pad positions so a block near the end has its S slots: never visible (context keys < a <= T-1)
    # and never weighted (loss_mask 0 there)
    pad = S - 1
    seqs = torch.cat([tokens, torch.zeros(B, pad, dtype=torch.long)], 1)
    mask = torch.cat([loss_mask, torch.zeros(B, pad)], 1)
    feats = torch.cat([feats, torch.zeros(B, pad, feats.shape[-1])], 1)
    block, labels, position_ids, visible = pack_blocks(seqs, anchors, S, mask_token_id)
    with torch.no_grad():
        noise = target.get_input_embeddings()(block)
    hidden = draft(position_ids=position_ids, attention_mask=visible[:, None], noise_embedding=noise,
                   target_hidden=feats)
    N = anchors.shape[1]
    logits = target.lm_head(hidden.view(B, N, S, -1)[:, :, 1:]).float()                    # [B, N, S-1, V]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           reduction="none").view(B, N, S - 1)
    k = torch.arange(1, S)
    w = torch.exp(-(k - 1).float() / gamma) * mask.gather(1, (anchors[:, :, None] + k).view(B, -1)).view(B, N, S - 1)
    w = w * keep[:, :, None] * ((anchors[:, :, None] + k) < T)
    return (w * ce).sum() / w.sum()


def train_draft(target_path: str, out_path: str, *, block_size: int = 8, num_layers: int = 2, steps: int = 600,
                batch_size: int = 16, blocks_per_row: int = 8, lr: float = 3e-3, warmup_frac: float = 0.04,
                gamma: float | None = None, num_sequences: int = 256, sampled_fraction: float = 1.0,
                seq_len: int = 96, prompt_len=(8, 16), mask_token_id: int | None = None, target_layer_ids=None,
                num_eval_prompts: int = 8, eval_max_new_tokens: int = 64,
                eval_temperatures=(0.0, 1.0), seed: int = 0, num_threads: int | None = 1) -> dict:
    """Train a reference DFlashDraftModel against the frozen target at `target_path`, save it in z-lab
    format at `out_path` and measure its acceptance with the reference `dflash_generate`.

    Data: random prompts (tokens in [0, vocab - 1), lengths `prompt_len`) continued by the target itself
    (HF generate, all-ones attention mask) to `seq_len` tokens: sampled at T = 1 for a
    `sampled_fraction` of them, greedy for the rest. Labels are the response tokens, as in the paper.
    All-greedy data (sampled_fraction=0) makes a draft that memorises the few greedy attractor paths and
    fails after any break in the context (right after the prompt, after a T = 1 jump): acceptance is
    then all-or-nothing ({1, S}) and τ at T = 1 ~1.4; sampled responses give graded acceptance.
    Training blocks (`pack_blocks`, K = blocks_per_row per sequence, batch_size sequences per step):
    anchor a uniform inside the response, block [tok[a], MASK x (S-1)] at positions [a, a+S), context
    = target taps at positions [0, a), labels tok[a+1 .. a+S-1]; loss sum_k w_k CE_k / sum_k w_k with
    w_k = exp(-(k-1)/gamma); AdamW, cosine schedule with warm-up, grad clip 1.0. The target's
    embedding and LM head are frozen and shared. Returns stats: `tau[T]` and `histogram[T]` for each
    eval temperature (reference dflash_generate on `eval_prompts`, `eval_max_new_tokens` each), etc."""
    kw = {k: v for k, v in locals().items() if k not in ("target_path", "out_path", "num_threads")}
    with _torch_threads(num_threads), torch.random.fork_rng():
        return _train_draft(target_path, out_path, **kw)


def _train_draft(target_path, out_path, *, block_size, num_layers, steps, batch_size, blocks_per_row, lr,
                 warmup_frac, gamma, num_sequences, sampled_fraction, seq_len, prompt_len, mask_token_id,
                 target_layer_ids, num_eval_prompts, eval_max_new_tokens, eval_temperatures, seed):
    from dflash.model import DFlashDraftModel, extract_context_feature

    t0 = time.perf_counter()
    S = block_size
    gamma = gamma if gamma is not None else {8: 4.0, 10: 5.0, 16: 7.0}.get(S, S / 2)
    target, _ = load_torch_pair(target_path)
    V = target.config.vocab_size
    cfg = _draft_config(target_path, num_layers=num_layers, block_size=S, mask_token_id=mask_token_id,
                        target_layer_ids=target_layer_ids)
    mask_id = cfg.dflash_config["mask_token_id"]
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg).train()
    taps = draft.target_layer_ids

    # Training data: the target's own responses and its tap features, computed once.
    prompts = random_prompts(num_sequences, V, min_len=prompt_len[0], max_len=prompt_len[1], seed=seed + 101,
                             exclude=(mask_id,))
    n_sampled = int(round(sampled_fraction * num_sequences))
    seqs = _target_sequences(target, prompts, seq_len, [i < n_sampled for i in range(num_sequences)],
                             seed + 102)  # [N, T]
    plens = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        out = target(seqs, output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, taps)  # [N, T, n_taps * H]
    t_data = time.perf_counter() - t0

    embed = target.get_input_embeddings()
    lm_head = target.lm_head
    weights = torch.exp(-torch.arange(S - 1, dtype=torch.float32) / gamma)  # slots 1..S-1
    weights = weights / weights.sum()
    T, K, R = seq_len, blocks_per_row, batch_size  # K blocks packed per sequence row, R rows per step
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, int(warmup_frac * steps))
    gen = _seeded(seed + 202)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * _cosine_lr(step, steps, warmup)
        rows = torch.randint(len(seqs), (R,), generator=gen)
        lo = plens[rows][:, None]
        anchors = lo + (torch.rand(R, K, generator=gen) * (T - S + 1 - lo)).long()  # [R, K] in [plen, T - S]
        block, labels, position_ids, visible = pack_blocks(seqs[rows], anchors, S, mask_id)
        with torch.no_grad():
            noise = embed(block)
        hidden = draft(position_ids=position_ids, attention_mask=visible[:, None], noise_embedding=noise,
                       target_hidden=feats[rows])
        logits = lm_head(hidden.view(R, K, S, -1)[:, :, 1:])  # [R, K, S-1, V]; labels [R, K, S-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
        loss = (ce.view(R * K, S - 1).mean(0) * weights).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    t_train = time.perf_counter() - t0 - t_data
    draft.eval().requires_grad_(False)
    _save_draft(draft, out_path)

    eval_prompts = random_prompts(num_eval_prompts, V, min_len=prompt_len[0], max_len=prompt_len[1],
                                  seed=seed + 303, exclude=(mask_id,))
    stats = dict(target_path=target_path, draft_path=out_path, block_size=S, mask_token_id=mask_id,
                 target_layer_ids=list(taps), gamma=gamma, steps=steps, batch_size=batch_size,
                 final_loss=sum(losses[-10:]) / min(10, len(losses)), first_loss=losses[0],
                 eval_prompts=eval_prompts, eval_max_new_tokens=eval_max_new_tokens, tau={}, histogram={},
                 data_seconds=t_data, train_seconds=t_train)
    for temp in eval_temperatures:
        m = _measure(draft, target, eval_prompts, eval_max_new_tokens, S, temp, seed + 404)
        stats["tau"][float(temp)] = m["tau"]
        stats["histogram"][float(temp)] = m["histogram"]
    stats["seconds"] = time.perf_counter() - t0
    return stats


# ---------------------------------------------------------------------------------------------------
# Trained pairs (what the conftest fixtures build)
# ---------------------------------------------------------------------------------------------------

TRAINED_PAIR = dict(vocab_size=128, block_size=8, target_layer_ids=(1, 2), draft_steps=600)
SMALL_VOCAB_PAIR = dict(vocab_size=32, block_size=8, target_layer_ids=(1, 2), draft_steps=300,
                        draft_kw=dict(seq_len=64))


def build_trained_pair(root: str, *, vocab_size: int = 128, block_size: int = 8, target_layer_ids=(1, 2),
                       draft_steps: int = 600, seed: int = 0, target_kw: dict | None = None,
                       draft_kw: dict | None = None) -> dict:
    """`train_target` into root/target, `train_draft` into root/draft; the stats also go to
    root/pair.json (see `read_pair`). Returns train_draft's stats plus `target_training`."""
    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    tstats = train_target(os.path.join(root, "target"), vocab_size=vocab_size, seed=seed, **(target_kw or {}))
    stats = train_draft(tstats["path"], os.path.join(root, "draft"), block_size=block_size, steps=draft_steps,
                        target_layer_ids=None if target_layer_ids is None else list(target_layer_ids),
                        seed=seed, **(draft_kw or {}))
    stats["target_training"] = {k: v for k, v in tstats.items() if k != "path"}
    stats["vocab_size"] = vocab_size
    stats["prompt_token_range"] = [0, vocab_size - 1]  # half-open; the last id is the MASK
    stats["total_seconds"] = time.perf_counter() - t0
    with open(os.path.join(root, "pair.json"), "w") as f:
        json.dump({**stats, "target_path": "target", "draft_path": "draft"}, f, indent=1)
    return stats


def read_pair(root: str) -> dict:
    """The stats of a pair built by `build_trained_pair` (possibly copied elsewhere), paths under root."""
    with open(os.path.join(root, "pair.json")) as f:
        stats = json.load(f)
    stats["target_path"] = os.path.join(root, stats["target_path"])
    stats["draft_path"] = os.path.join(root, stats["draft_path"])
    stats["tau"] = {float(k): v for k, v in stats["tau"].items()}
    stats["histogram"] = {float(k): {int(n): c for n, c in h.items()} for k, h in stats["histogram"].items()}
    return stats
