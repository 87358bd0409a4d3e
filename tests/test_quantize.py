"""int8 weight-only targets (dflash_jax.quantize, issue 57's first slice): the dequantizing matmul
against a NumPy oracle, DFlash greedy == plain greedy on the quantized target of every family, its
logits near the float model's, a trained pair's acceptance with the int8 target, and bad input."""

from __future__ import annotations

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import DraftConfig, TargetConfig, generate, init_draft, init_target, load_draft, load_target
from dflash_jax.config import Qwen3MoeConfig
from dflash_jax.models.layers import linear
from dflash_jax.models.qwen3_5 import Qwen35Config
from dflash_jax.models.qwen3_5_moe import Qwen35MoeConfig
from dflash_jax.quantize import Int8Weight, quantize_int8, weight_bytes

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=16)
FAMILIES = {
    "qwen3": TargetConfig(**SMALL),
    "llama": TargetConfig(**{**SMALL, "model_type": "llama"}),
    "qwen3_moe": Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen3_5": Qwen35Config(**{**SMALL, "num_heads": 2, "num_kv_heads": 1},
                            layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=1,
                            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_5_moe": Qwen35MoeConfig(**{**SMALL, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 32},
                                   layer_types=("linear_attention",) * 3 + ("full_attention",),
                                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                                   linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=32),
}


def _oracle(x, q, scale):
    """x @ (q * scale) in float64 NumPy: dequantize, then multiply."""
    return np.asarray(x, np.float64) @ (np.asarray(q, np.float64) * np.asarray(scale, np.float64))


def test_int8_linear_matches_numpy_dequantize_oracle():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 40)).astype(np.float32)
    w[:, 3] = 0.0                                                              # an all-zero column
    qw = quantize_int8(jnp.asarray(w))
    q, scale = np.asarray(qw.q), np.asarray(qw.scale)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and q.shape == (48, 40) and scale.shape == (40,)
    assert np.abs(q).max() == 127 and np.all(q[:, 3] == 0) and scale[3] == 1.0
    amax = np.abs(w).max(axis=0)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-6)                   # round to nearest
    for shape in ((2, 3, 48), (1, 1, 48)):                                     # (1, 1): linear's one-row path
        x = rng.normal(size=shape).astype(np.float32)
        want = _oracle(x, q, scale)
        np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), qw)), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(jnp.asarray(x) @ qw), want, rtol=1e-5, atol=1e-5)
        xb = jnp.asarray(x, jnp.bfloat16)
        got = linear(xb, qw)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(got, np.float32), _oracle(np.asarray(xb, np.float32), q, scale),
                                   rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="read whole"):
        qw[0]


def _moe_oracle(x, weights, idx, gu, down):
    """The chosen experts' SwiGLU outputs summed per token in float64 NumPy, from dequantized
    weights gu [E, H, 2I], down [E, I, H]."""
    x, gu, down = (np.asarray(a, np.float64) for a in (x, gu, down))
    I = down.shape[1]
    out = np.zeros((x.shape[0], down.shape[2]))
    for n in range(x.shape[0]):
        for w, e in zip(np.asarray(weights[n], np.float64), np.asarray(idx[n])):
            h = x[n] @ gu[e]
            a = h[:I] / (1 + np.exp(-h[:I])) * h[I:]
            out[n] += w * (a @ down[e])
    return out


def test_int8_moe_experts_match_numpy_dequantize_oracle():
    """The stacked experts quantized per expert and output column; the experts' grouped matmuls
    (the XLA path, also when a Pallas gmm is asked for) against NumPy on the dequantized weights."""
    from dflash_jax.models.moe import experts, quantized_gmm
    rng = np.random.default_rng(1)
    E, H, I, N, k = 4, 24, 16, 5, 2
    gu = quantize_int8(jnp.asarray(rng.normal(size=(E, H, 2 * I)), jnp.float32))
    down = quantize_int8(jnp.asarray(rng.normal(size=(E, I, H)), jnp.float32))
    assert gu.q.shape == (E, H, 2 * I) and gu.scale.shape == (E, 2 * I) and down.scale.shape == (E, H)
    gu_w, down_w = np.asarray(gu.dequantize()), np.asarray(down.dequantize())
    # each expert's own column scales: expert e's dequantized matrix is q[e] * scale[e]
    np.testing.assert_allclose(gu_w[2], np.asarray(gu.q[2], np.float32) * np.asarray(gu.scale[2]), rtol=1e-6)
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, size=(N, k)), jnp.float32)
    want = _moe_oracle(x, weights, idx, gu_w, down_w)
    for impl in ("xla", "pallas_gpu_interpret"):
        got = experts(x, weights, idx, gu, down, gmm_impl=impl, first_expert=None)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    one = experts(x[:1], weights[:1], idx[:1], gu, down, gmm_impl="pallas_gpu_interpret", first_expert=None)
    np.testing.assert_allclose(np.asarray(one), want[:1], rtol=1e-4, atol=1e-4)    # B = 1: no gmm_rows
    # the grouped matmul alone: rows sorted by expert, rows past the groups zero
    sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)
    expert = jnp.asarray([0, 0, 2, 2, 2, 3, 3], jnp.int32)
    rows = jnp.asarray(rng.normal(size=(7, I)), jnp.float32)
    got = np.asarray(quantized_gmm(rows, down, sizes, expert))
    want = np.stack([np.asarray(rows[r], np.float64) @ down_w[int(expert[r])] for r in range(6)] + [np.zeros(H)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _quantized_leaves(model):
    from flax import nnx
    return [v for v in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param),
                                                 is_leaf=lambda v: isinstance(v, Int8Weight))
            if isinstance(v, Int8Weight)]


@pytest.mark.parametrize("family", ["qwen3"] + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES
                                                 if f != "qwen3"])
def test_int8_target_dflash_greedy_equals_plain_greedy_and_logits_near_float(family):
    cfg = FAMILIES[family]
    ref = init_target(cfg, seed=1, dtype="float32")
    target = init_target(cfg, seed=1, dtype="float32", quantize="int8")
    quantized = _quantized_leaves(target)
    # qkv, o (in_proj, out), gate_up, down (the MoE's stacked experts_gate_up, experts_down)
    # (Qwen3.5-MoE: its shared expert's gate_up, down too)
    per_layer = {"qwen3": 4, "llama": 4, "qwen3_moe": 4, "qwen3_5": 4, "qwen3_5_moe": 6}[family]
    assert len(quantized) == per_layer * cfg.num_layers
    assert target.embed[...].dtype == jnp.float32 and target.lm_head[...].dtype == jnp.float32   # kept as loaded
    assert weight_bytes(target) < weight_bytes(ref)
    # the logits of a prompt: near the float model's (int8 weights, a loose tolerance)
    tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, cfg.vocab_size)
    lf, lq = [np.asarray(m.logits(m(tokens, jnp.arange(12)[None], m.new_cache(1, 64), jnp.arange(12)[None] + 1)[0]))
              for m in (ref, target)]
    # (relative L2 error: ~1 % for the dense families, ~5 % for the random 4-layer Qwen3.5, whose
    # GDN layers amplify it more, ~12 % for the random Qwen3.5-MoE, its int8 experts on top)
    err = np.linalg.norm(lq - lf) / np.linalg.norm(lf)
    assert 0 < err < (0.2 if family == "qwen3_5_moe" else 0.1), err
    # lossless relative to the int8 target: DFlash greedy == plain greedy, token for token
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=4), seed=2, dtype="float32", target=target)
    prompts = [[int(t) for t in np.asarray(tokens[0])], [5, 9, 77, 3, 1]]
    # the default width (auto) in the default qwen3 case; the other families the full block: the
    # width logic does not depend on the weight format (every family's width-parametrized oracle
    # test proves it), and auto's extra verify programs cost each family ~5 s of CI compiles
    res = generate(target, draft, prompts, max_new_tokens=20, block_size=4,
                   verify_width="auto" if family == "qwen3" else "block")
    plain = generate(target, None, prompts, max_new_tokens=20)
    assert res.tokens == plain.tokens
    assert all(len(t) == 20 for t in res.tokens)


def _tau_and_tokens(target, draft, prompts, lossless=True):
    res = generate(target, draft, prompts, max_new_tokens=40, block_size=8, verify_width="block")
    if lossless:
        plain = generate(target, None, prompts, max_new_tokens=40)
        assert res.tokens == plain.tokens
    return res.mean_tau


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trained_pair_tau_with_int8_target(trained_pair, dtype):
    """A trained pair (vocab 128, S = 8): the checkpoint quantized at load keeps DFlash lossless and
    its acceptance within 3 % of the unquantized target's, in float32 and in bfloat16 (the dtype
    served; there the token-for-token check is float32's: a bf16 block verify and a bf16 one-token
    step may round a near-tie apart)."""
    prompts = trained_pair["eval_prompts"]
    ref = load_target(trained_pair["target_path"], dtype=dtype)
    target = load_target(trained_pair["target_path"], dtype=dtype, quantize="int8")
    assert _quantized_leaves(target) and not _quantized_leaves(ref)
    draft = load_draft(trained_pair["draft_path"], target=ref, dtype=dtype)
    exact = dtype == "float32"
    tau_f, tau_q = _tau_and_tokens(ref, draft, prompts, exact), _tau_and_tokens(target, draft, prompts, exact)
    print(f"\ntrained pair S=8 ({dtype}): tau unquantized {tau_f:.3f}, int8 target {tau_q:.3f}")
    assert tau_f > 2.0 and tau_q >= 0.97 * tau_f, (tau_q, tau_f)


@pytest.mark.slow
def test_trained_pair_with_an_int8_draft(trained_pair):
    """--quantize-draft int8 (load_draft(..., quantize="int8")): the draft's layer linears in int8,
    its embedding-free head and fc as loaded; DFlash stays lossless (the target decides) and the
    trained pair's tau is printed against the float draft's (docs/perf-log.md, session 39)."""
    prompts = trained_pair["eval_prompts"]
    target = load_target(trained_pair["target_path"], dtype="float32")
    draft = load_draft(trained_pair["draft_path"], target=target, dtype="float32")
    draft_q = load_draft(trained_pair["draft_path"], target=target, dtype="float32", quantize="int8")
    assert len(_quantized_leaves(draft_q)) == 4 * draft.config.num_layers and not _quantized_leaves(draft)
    assert draft_q.quantize == "int8"
    tau_f, tau_q = _tau_and_tokens(target, draft, prompts), _tau_and_tokens(target, draft_q, prompts)
    print(f"\ntrained pair S=8: tau float32 draft {tau_f:.3f}, int8 draft {tau_q:.3f}")
    assert tau_q >= 0.9 * tau_f, (tau_q, tau_f)


class _AsTransformers:
    """A dflash_jax target called like a transformers causal LM (ids [B, T] torch → .logits torch
    float32), for tests/test_sampling.py's enumeration of the exact joint."""

    def __init__(self, model):
        self.model, self.config = model, SimpleNamespace(vocab_size=model.config.vocab_size)

    def __call__(self, ids, attention_mask=None):
        import torch
        tokens = jnp.asarray(ids.numpy(), jnp.int32)
        B, T = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h, _, _ = self.model(tokens, pos, self.model.new_cache(B, 64), pos + 1)
        return SimpleNamespace(logits=torch.from_numpy(np.array(self.model.logits(h), np.float32)))


@pytest.mark.parametrize("setting", ["T0.6-topp0.95-topk20"])
def test_int8_target_speculative_sampling_matches_its_exact_distribution(trained_small_vocab_pair, setting):
    """Lossless in distribution relative to the target as run: DFlash sampling on the int8 target
    against the exact joint of its first three tokens, enumerated from the int8 target's own logits
    (tests/test_sampling.py's chi-square, p > 1e-4; half its samples, 1536). One setting, the one with
    every filter (plain T = 1 ran here too: 15 s of CI; test_sampling.py runs it on bf16/float32)."""
    from tests.test_sampling import SEEDS, SETTINGS, _chi_square_p, _exact_joint, _sample_joint
    p = trained_small_vocab_pair
    target = load_target(p["target_path"], dtype="float32", quantize="int8")
    draft = load_draft(p["draft_path"], target=target, dtype="float32")
    prompt = p["eval_prompts"][0]
    temperature, top_p, top_k = SETTINGS[setting]
    expected = _exact_joint(_AsTransformers(target), prompt, temperature, top_p, top_k)
    counts, n, acc = _sample_joint(dict(target=target, draft=draft), prompt, temperature, top_p, top_k,
                                   seeds=SEEDS // 2)
    assert max(acc) >= 2, acc[:20]                     # drafts were accepted: the rule really ran
    assert _chi_square_p(counts, expected, n) > 1e-4


def test_quantize_bad_input(tiny_target):
    with pytest.raises(ValueError, match=r"quantize='fp4' is not supported; supported: None, 'int8'"):
        init_target(FAMILIES["qwen3"], quantize="fp4")
    with pytest.raises(ValueError, match=r"quantize='fp4' is not supported"):
        load_target(tiny_target, quantize="fp4")


def test_generate_cli_quantize_flag(tiny_target, capsys, monkeypatch):
    """--quantize int8 reaches load_target (one plain run of the tiny checkpoint); --quantize fp4 is
    a usage error naming the choices."""
    import dflash_jax
    from dflash_jax.cli import generate as gen_cli

    seen = []
    real = dflash_jax.load_target

    def spy(*a, **kw):
        seen.append(kw.get("quantize"))
        return real(*a, **kw)

    monkeypatch.setattr(dflash_jax, "load_target", spy)
    code = gen_cli.main(["--model", tiny_target, "--draft", "none", "--dtype", "float32", "--quantize", "int8",
                         "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--no-stream"])
    out, _ = capsys.readouterr()
    assert code == 0 and seen == ["int8"] and len(out.split()) == 5
    with pytest.raises(SystemExit) as e:
        gen_cli.main(["--model", tiny_target, "--draft", "none", "--quantize", "fp4", "--prompt-ids", "1"])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "--quantize: invalid choice: 'fp4' (choose from" in err and "int8" in err


def test_generate_cli_quantize_draft_flag(tiny_pair):
    """--quantize-draft int8 (generate's, so benchmark's and serve's flags) loads the draft in int8
    and leaves the target as loaded (runs with an int8 draft: test_trained_pair_with_an_int8_draft)."""
    from dflash_jax import loading
    from dflash_jax.cli import generate as gen_cli

    parser = gen_cli.build_parser()
    args = parser.parse_args(["--model", tiny_pair["target_path"], "--draft", tiny_pair["draft_path"], "--dtype",
                              "float32", "--prompt-ids", "1,2,3", "--quantize-draft", "int8"])
    gen_cli.check_args(parser, args)
    target, draft = loading.load_models(parser, args)
    assert draft.quantize == "int8" and getattr(target, "quantize", None) is None
    assert len(_quantized_leaves(draft)) == 4 * draft.config.num_layers and not _quantized_leaves(target)


# ------------------------------------------------------------------------- a 2 x 2 mesh (child)

MESH_CHILD = os.environ.get("DFLASH_QUANTIZE_MESH_CHILD") == "1"


@pytest.mark.skipif(MESH_CHILD, reason="the parent's runner")
@pytest.mark.slow
def test_int8_and_fp8_on_a_2x2_mesh_equal_one_device():
    """The mesh cases of this file and of tests/test_fp8.py (its fp8 / fp8 MoE / w8a8 checkpoints)
    run in one child pytest on 4 virtual CPU devices (tests/children.py), with the other 4-device
    cases: tests/test_paged.py's pages on a mesh, tests/test_qwen3_5_mesh.py's hybrid target,
    tests/test_llama.py's Llama target and tests/test_adaptive.py's width decisions on a mesh. One
    process start, not six (each child paid ~6 s of start-up)."""
    from tests.children import run_child
    here = os.path.dirname(os.path.abspath(__file__))
    run_child(__file__, devices=4,
              env=dict(DFLASH_QUANTIZE_MESH_CHILD="1", DFLASH_FP8_MESH_CHILD="1", DFLASH_PAGED_CHILD="1",
                       DFLASH_HYBRID_CHILD="1", DFLASH_LLAMA_MESH_CHILD="1", DFLASH_ADAPTIVE_MESH_CHILD="1"),
              args=("-m", "slow or not slow", "-k", "mesh_child or 2x2_mesh_generates_the_one_device_tokens",
                    *(os.path.join(here, f) for f in ("test_fp8.py", "test_paged.py", "test_qwen3_5_mesh.py",
                                                      "test_llama.py", "test_adaptive.py"))),
              min_passed=6 + 1 + 1 + 1 + 1)


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child")
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_mesh_child_int8_target_and_draft_on_2x2_equal_one_device(family):
    """int8 target and int8 draft placed on a 2 x 2 mesh (fused TP layout; Qwen3-MoE's experts split
    over 'model'): each scale sits with its weight's columns, and DFlash greedy gives one device's
    tokens and acceptance lengths, which equal plain decoding's."""
    from jax.sharding import PartitionSpec as P

    from dflash_jax import decode, sharding
    assert jax.device_count() == 4
    cfg = {"qwen3": TargetConfig(**{**SMALL, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8}),
           "qwen3_moe": Qwen3MoeConfig(**{**SMALL, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8},
                                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)}[family]
    mesh = sharding.make_mesh("2x2", devices=jax.devices()[:4])
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3], [100, 101]]
    kw = dict(max_new_tokens=10, attention_impl="xla", capacity=64, verify_width="block")
    out = []
    for m in (None, mesh):
        target = init_target(cfg, seed=1, dtype="float32", quantize="int8")
        draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=4), seed=2, dtype="float32",
                           quantize="int8")
        if m is not None:
            sharding.shard_model(target, m)
            sharding.shard_model(draft, m)
            qkv, o = target.layers[0].qkv[...], target.layers[0].o[...]
            assert qkv.q.sharding.spec == P(None, "model") and qkv.scale.sharding.spec == P("model")
            assert o.q.sharding.spec == P("model", None) and o.scale.sharding.spec == P(None)
            assert qkv.scale.addressable_shards[0].data.shape == (qkv.shape[1] // 2,)
            if family == "qwen3_moe":
                gu = target.layers[0].mlp.experts_gate_up[...]
                assert gu.q.sharding.spec == P("model", None, None) and gu.scale.sharding.spec == P("model", None)
        out.append(decode.generate(target, draft, prompts, mesh=m, **kw))
    plain = decode.generate(init_target(cfg, seed=1, dtype="float32", quantize="int8"), None, prompts,
                            **{k: v for k, v in kw.items() if k != "verify_width"})
    one, many = out
    assert one.tokens == plain.tokens
    assert many.tokens == one.tokens and many.acceptance_lengths == one.acceptance_lengths


@pytest.mark.skipif(not MESH_CHILD, reason="runs in the 4-device child")
def test_mesh_child_load_target_int8_on_a_mesh(tmp_path):
    """load_target(..., mesh="2x2", quantize="int8") (what --quantize int8 --mesh 2x2 runs):
    quantized on one device, placed by the family's rules; plain greedy equals one device's."""
    from tests import checkpoints as ck

    from dflash_jax import decode
    path = ck.write_target(str(tmp_path / "t"), num_heads=8, num_kv_heads=2, head_dim=8, seed=4)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    kw = dict(max_new_tokens=8, attention_impl="xla", capacity=64)
    one = decode.generate(load_target(path, dtype="float32", quantize="int8"), None, prompts, **kw)
    target = load_target(path, dtype="float32", quantize="int8", mesh="2x2")
    assert target.layers[0].qkv[...].scale.sharding.spec[0] == "model"
    many = decode.generate(target, None, prompts, mesh=target.layers[0].qkv[...].q.sharding.mesh, **kw)
    assert many.tokens == one.tokens


def test_int8_head_logits_match_numpy_oracle_and_dflash_stays_lossless():
    """quantize="int8+head": the untied LM head int8 too, one scale per vocabulary entry; its logits
    equal h @ (q * scale) in NumPy, and DFlash greedy equals plain greedy of that target."""
    cfg = FAMILIES["qwen3"]
    target = init_target(cfg, seed=1, dtype="float32", quantize="int8+head")
    head = target.lm_head[...]
    assert isinstance(head, Int8Weight) and head.scale.shape == (cfg.vocab_size,)
    assert target.quantize == "int8+head"
    h = jax.random.normal(jax.random.key(3), (2, 5, cfg.hidden_size), jnp.float32)
    want = np.asarray(h, np.float64) @ (np.asarray(head.q, np.float64) * np.asarray(head.scale, np.float64))
    np.testing.assert_allclose(np.asarray(target.logits(h)), want, rtol=1e-4, atol=1e-4)
    draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=4), seed=2, dtype="float32", target=target)
    prompts = [[5, 9, 77, 3, 1], [2, 4]]
    assert generate(target, draft, prompts, max_new_tokens=16, block_size=4).tokens == \
        generate(target, None, prompts, max_new_tokens=16).tokens


@pytest.mark.slow
def test_dflash2_selector_over_an_int8_head(trained_pair, tmp_path):
    """The DFlash2 selector ranks its candidates with the target's LM head (sglang #35534 crashed on a
    quantized one): over an int8 head its greedy output equals plain greedy and sampling runs."""
    from tests.test_dflash2 import _write_reference_draft
    tp = trained_pair["target_path"]
    path, _ = _write_reference_draft(str(tmp_path / "d2"), tp, dflash2=True, layer_types=["full_attention"] * 2,
                                     is_causal=False, seed=13, init_from=trained_pair["draft_path"], scale=0.1)
    target = load_target(tp, dtype="float32", quantize="int8+head")
    draft = load_draft(path, target=target, dtype="float32")
    prompts = [list(p) for p in trained_pair["eval_prompts"][:2]]
    res = generate(target, draft, prompts, max_new_tokens=24, verify_width="block")
    assert res.tokens == generate(target, None, prompts, max_new_tokens=24).tokens
    assert max(a for row in res.acceptance_lengths for a in row) >= 3
    sampled = generate(target, draft, prompts, max_new_tokens=24, temperature=0.8, seed=3, verify_width="block")
    assert all(len(t) == 24 for t in sampled.tokens)
