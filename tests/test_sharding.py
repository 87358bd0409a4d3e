"""dflash_jax.sharding on 8 virtual CPU devices.

The virtual devices need XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts its
backend, which other tests in the same process may already have done; so the cases run in a child
pytest of this file (`test_on_8_devices`: every case, slow ones included, in one child), and are
skipped in the parent. Run them directly with
    DFLASH_SHARDING_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/test_sharding.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

CHILD = os.environ.get("DFLASH_SHARDING_CHILD") == "1"
child = pytest.mark.skipif(not CHILD, reason="runs in the 8-device child (test_on_8_devices)")
parent = pytest.mark.skipif(CHILD, reason="the parent's runner")


@parent
@pytest.mark.slow
def test_on_8_devices():
    """Every child case in one child process (two children, one per marker, paid the start-up, the
    models and the programs twice), with the 8-device cases of tests/test_moe_sharding.py (expert
    parallelism) and tests/test_engine.py (slots on a mesh): one process start, not three (CI time)."""
    from tests.children import run_child
    here = os.path.dirname(os.path.abspath(__file__))
    run_child(__file__, devices=8,
              env=dict(DFLASH_SHARDING_CHILD="1", DFLASH_MOE_CHILD="1", DFLASH_ENGINE_CHILD="1"),
              args=("-m", "slow or not slow", os.path.join(here, "test_moe_sharding.py"),
                    os.path.join(here, "test_engine.py") + "::test_slots_mesh_child_greedy_equals_one_device"),
              min_passed=39 + 10 + 1)


# ------------------------------------------------------------------------------- child cases

if CHILD:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dflash_jax import sharding as sh
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.weights import init_draft, init_target

    TINY = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0)


def _mesh(spec):
    d, m = sh.parse_mesh(spec)
    return sh.make_mesh(spec, devices=jax.devices()[: d * m])


@child
def test_eight_devices():
    assert jax.device_count() == 8


@child
def test_make_mesh_specs_and_errors():
    assert sh.parse_mesh("data=2,model=4") == (2, 4)
    assert sh.parse_mesh("tp=8") == (1, 8) and sh.parse_mesh("dp=8") == (8, 1)
    assert sh.parse_mesh("2x4") == (2, 4) and sh.parse_mesh(4) == (1, 4)
    m = sh.make_mesh("data=2,model=4")
    assert m.axis_names == ("data", "model") and dict(m.shape) == {"data": 2, "model": 4}
    assert dict(sh.make_mesh(dp=2, tp=4).shape) == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="needs 16 devices"):
        sh.make_mesh("data=4,model=4")
    with pytest.raises(ValueError, match="needs 2 devices.*devices=jax.devices"):
        sh.make_mesh("model=2")
    for bad in ("data=2,modle=4", "data=0", "data=2,data=2", "x"):
        with pytest.raises(ValueError, match="mesh"):
            sh.parse_mesh(bad)


@child
@pytest.mark.parametrize("spec", ["1x2", "2x4", "1x8", "8x1"])
def test_rules_cover_every_leaf_with_no_silent_replication(spec):
    mesh = _mesh(spec)
    target = sh.shard_model(init_target(TINY, dtype="float32"), mesh)
    draft = sh.shard_model(init_draft(DraftConfig.for_target(TINY, num_layers=2, block_size=4), dtype="float32"), mesh)
    tp = sh.model_axis_size(mesh)
    for model in (target, draft):
        got = sh.check_sharded(model, mesh)
        for name, (per, total) in got.items():
            split = not name.endswith("/weight") and name != "fc"
            assert per * (tp if split else 1) == total, name
    assert "fc" in sh.check_sharded(draft, mesh) and "embed" in sh.check_sharded(target, mesh)
    with pytest.raises(ValueError, match="no partition rule matches parameter 'layers/0/extra'"):
        sh.spec_for("layers/0/extra")


@child
def test_indivisible_dims_are_refused():
    cfg = TargetConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"embed: dimension 0 .*\(100\) is not divisible by the mesh axis 'model' of size 8"):
        sh.shard_model(init_target(cfg, dtype="float32"), _mesh("1x8"))


@child
def test_cache_specs():
    from dflash_jax.cache import KVCache
    assert sh.cache_specs(2, _mesh("1x2"))[0] == P("data", "model", None, None)
    assert sh.cache_specs(2, _mesh("2x4"))[0] == P("data", None, None, None)  # replicated over model
    with pytest.raises(ValueError, match="batch 3 is not a multiple of the data axis size 2"):
        sh.cache_specs(2, _mesh("2x4"), batch=3)
    mesh = _mesh("2x4")
    c = sh.shard_cache(KVCache.zeros(2, 4, 4, 8, 16, jnp.float32), mesh)
    assert c.k[0].sharding.spec == P("data", "model", None, None) and c.lens.sharding.spec == P("data")
    assert sh._per_device_bytes(c.k[0]) * 8 == c.k[0].size * 4


def _ints(key, shape):
    # small integers: every dot product is exact in float32, so a reordering shows as any difference
    return jax.random.randint(jax.random.key(key), shape, -3, 4).astype(jnp.float32)


def _collectives(compiled_text: str) -> list[str]:
    return [op for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
            if op + "(" in compiled_text or op + "-start" in compiled_text]


@child
@pytest.mark.parametrize("hq,hkv,tp", [(4, 2, 1), (4, 2, 2), (8, 4, 2), (8, 2, 4), (8, 2, 8), (4, 4, 4)])
def test_fused_qkv_layout_is_exact_and_local(hq, hkv, tp):
    H, D = 32, 8
    x = _ints(0, (2, 3, H))                                                  # [B, T, H]
    w = _ints(1, (H, (hq + 2 * hkv) * D))                                    # [H, (Hq + 2 Hkv) D]
    q0, k0, v0 = sh.split_qkv(x @ w, hq, hkv, D)                             # the plain layout
    lay = sh.fused_layout(hq, hkv, D, tp)
    perm = sh.qkv_permutation(lay)
    assert lay.num_kv_heads == max(hkv, tp) and len(perm) == (hq + 2 * lay.num_kv_heads) * D
    if tp == 1:
        np.testing.assert_array_equal(perm, np.arange(w.shape[1]))
    mesh = _mesh(f"1x{tp}")
    wp = jax.device_put(w[:, perm], NamedSharding(mesh, P(None, "model")))
    split = jax.jit(lambda x, w: sh.split_qkv(x @ w, hq, lay.num_kv_heads, D, groups=tp))
    q, k, v = split(x, wp)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, jnp.repeat(k0, lay.kv_repeats, axis=2))
    np.testing.assert_array_equal(v, jnp.repeat(v0, lay.kv_repeats, axis=2))
    # each shard's q heads use the kv head the shard holds: q head h -> kv head h // (Hq / Hkv_layout)
    assert tp == 1 or k.sharding.spec[2] == "model"
    assert _collectives(split.lower(x, wp).compile().as_text()) == []


@child
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_gate_up_layout_is_exact_and_local(tp):
    H, I = 16, 32
    x, w = _ints(2, (2, 3, H)), _ints(3, (H, 2 * I))
    g0, u0 = jnp.split(x @ w, 2, axis=-1)
    mesh = _mesh(f"1x{tp}")
    wp = jax.device_put(w[:, sh.gate_up_permutation(I, tp)], NamedSharding(mesh, P(None, "model")))
    f = jax.jit(lambda x, w: sh.split_gate_up(x @ w, tp))
    g, u = f(x, wp)
    np.testing.assert_array_equal(g, g0)
    np.testing.assert_array_equal(u, u0)
    assert _collectives(f.lower(x, wp).compile().as_text()) == []


def _on(x, mesh):
    spec = P("data" if x.shape[0] % sh.data_axis_size(mesh) == 0 else None, *([None] * (x.ndim - 2)), "model")
    return jax.device_put(x, NamedSharding(mesh, spec))


@child
@pytest.mark.parametrize("spec", ["1x8", "2x4", "1x2"])
def test_sharded_argmax_equals_jnp_argmax(spec):
    mesh = _mesh(spec)
    V = 64
    cases = [jax.random.normal(jax.random.key(0), (4, 3, V)),
             jnp.round(jax.random.normal(jax.random.key(1), (4, 3, V)))]      # many ties
    tie = jnp.zeros((4, V)).at[:, [7, 8, 40]].set(5.0)                        # ties across shard boundaries
    tie = tie.at[1, :].set(1.0).at[2, :].set(-jnp.inf).at[3, 33].set(jnp.nan).at[3, 50].set(jnp.nan)
    cases += [tie, tie.at[0, 63].set(jnp.nan), jnp.full((2, V), jnp.nan)]
    for x in cases:
        got = jax.jit(lambda z: sh.sharded_argmax(z, mesh))(_on(x, mesh))
        np.testing.assert_array_equal(got, jnp.argmax(x, axis=-1))
    # the logits are never gathered: the only collectives are the all-gathers of [B, S, TP]
    hlo = jax.jit(lambda z: sh.sharded_argmax(z, mesh)).lower(_on(cases[0], mesh)).compile().as_text()
    assert _collectives(hlo) == ["all-gather"]
    with pytest.raises(ValueError, match="vocabulary of 63 is not divisible"):
        sh.sharded_argmax(jnp.zeros((2, 63)), _mesh("1x2"))


SAMPLING = [(0.8, 5, 1.0), (1.0, 0, 1.0), (0.9, 0, 0.8), (1.2, 7, 0.6), (0.5, 1, 1.0)]


def _sampling_on_shards(spec, settings):
    """sampling.select and sampling.accept under the mesh (vocab-sharded logits) against one device,
    same keys: identical tokens and acceptance. Returns the compiled HLO of each sharded accept."""
    from dflash_jax import sampling
    mesh = _mesh(spec)
    V, B, S = 256, 8, 4
    logits = jax.random.normal(jax.random.key(0), (B, S, V)) * 3.0                 # [B, S, V]
    logits = logits.at[1].set(jnp.round(logits[1]))                                # ties
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(B))
    block = jax.random.randint(jax.random.key(2), (B, S), 0, V)
    block = block.at[:, 1].set(jnp.argmax(logits[:, 0], -1))                       # some accepted
    on = jax.device_put(logits, NamedSharding(mesh, P("data", None, "model")))
    hlos = []
    for t, k, p in settings:
        mode, args = sampling.mode_for(t, p, k), (jnp.float32(t), jnp.int32(k), jnp.float32(p))

        def sel(l, kk, mesh=None):
            with sh.active(mesh):
                return sampling.select(l, kk, *args, mode)

        def acc(b, l, kk, mesh=None):
            with sh.active(mesh):
                return sampling.accept(b, l, kk, *args, mode)
        np.testing.assert_array_equal(jax.jit(lambda l, kk: sel(l, kk, mesh))(on[:, 0], keys),
                                      jax.jit(sel)(logits[:, 0], keys), err_msg=f"{spec} {mode}")
        f = jax.jit(lambda b, l, kk: acc(b, l, kk, mesh))
        for got, want in zip(f(block, on, keys), jax.jit(acc)(block, logits, keys)):
            np.testing.assert_array_equal(got, want, err_msg=f"{spec} {mode}")
        hlos.append(f.lower(block, on, keys).compile().as_text())
    # the logits never travel: all-gathers only of the argmaxes' [B, S, TP] (value, index) pairs,
    # all-reduces only of the searches' [B·S, 16] per-pass sums and smaller
    dp, tp = sh.parse_mesh(spec)
    for hlo in hlos:
        ops = _collective_ops(hlo, largest=True)      # XLA combines collectives: each operand alone
        assert {op for op, _, _ in ops} <= {"all-reduce", "all-gather"}, ops
        assert all(n <= B // dp * S * tp for op, n, _ in ops if op == "all-gather"), sorted(set(ops))
        assert all(n <= B // dp * S * 16 for op, n, _ in ops if op == "all-reduce"), sorted(set(ops))
        assert V // tp * B // dp * S > B // dp * S * 16                 # a per-shard logits slab is larger


@child
@pytest.mark.parametrize("spec", ["1x2", "1x8", "2x4"])
def test_sampling_on_vocab_shards_matches_one_device(spec):
    _sampling_on_shards(spec, [SAMPLING[3]])                             # top-k then top-p


@child
@pytest.mark.slow
def test_sampling_on_vocab_shards_matches_one_device_all_modes():
    """The other four modes on the 2x4 mesh (the top-k-then-top-p one runs on every mesh below)."""
    _sampling_on_shards("2x4", SAMPLING[:3] + SAMPLING[4:])


@child
@pytest.mark.parametrize("fused", [False, True])
def test_load_reads_only_local_slices(tmp_path, monkeypatch, fused):
    from flax import nnx
    from tests import checkpoints as ck
    from dflash_jax import weights as wl
    from dflash_jax.weights import load_target
    path = ck.write_target(str(tmp_path / "t"), num_layers=2, num_heads=8, num_kv_heads=2, seed=3)
    reads = []
    orig = wl._Checkpoint.read
    def spy(self, name, index):
        out = orig(self, name, index)
        reads.append((name, out.shape, self.shape(name)))
        return out
    monkeypatch.setattr(wl._Checkpoint, "read", spy)
    mesh = _mesh("2x4")
    got = wl.load_target_sharded(path, mesh, "float32", fused_layout=fused)
    want = sh.shard_model(load_target(path, "float32"), mesh, fused_layout=fused)
    sh.check_sharded(got, mesh)
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(got, nnx.Param)), nnx.to_flat_state(nnx.state(want, nnx.Param))):
        a, b = a.get_value(), b.get_value()
        assert a.sharding == b.sharding, p
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    if fused:
        assert got.layers[0].qkv_groups == 4 and got.layers[0].num_kv_heads == 4
    # no read is larger than one device's block of the parameter it feeds (the norms, replicated,
    # are read whole), and no sharded tensor is read whole unless one block holds all of it
    params = dict(nnx.to_flat_state(nnx.state(got, nnx.Param)))
    feeds = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp/gate_up",
             "up_proj": "mlp/gate_up", "o_proj": "o", "down_proj": "mlp/down"}
    for n, shape, full in reads:
        if n.endswith("norm.weight"):
            continue
        leaf = n.split(".")[-2]
        param = f"layers/{n.split('.')[2]}/{feeds[leaf]}" if leaf in feeds else {
            "embed_tokens": "embed", "lm_head": "lm_head"}[n.split(".")[-2]]
        block = params[tuple(int(x) if x.isdigit() else x for x in param.split("/"))].get_value()
        assert np.prod(shape) <= block.addressable_shards[0].data.size, (n, shape)
        if leaf in ("q_proj", "gate_proj", "up_proj", "o_proj", "down_proj", "embed_tokens", "lm_head"):
            assert shape != full, n
    assert any("q_proj" in n for n, _, _ in reads)


# ------------------------------------------------------------------------------ the loop, sharded

if CHILD:
    # 8 q / 2 kv heads: the fused layout fits every mesh here, and 1x8 replicates each kv head 4x
    TINY8 = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                         num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    DRAFT8 = DraftConfig.for_target(TINY8, num_layers=2, block_size=4)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3], [9, 10, 11, 12], [5], [6, 7], [8], [100, 101]]
KW = dict(max_new_tokens=10, attention_impl="xla", capacity=64)


def _models(mesh):
    target, draft = init_target(TINY8, dtype="float32"), init_draft(DRAFT8, dtype="float32")
    if mesh is not None:
        sh.shard_model(target, mesh)
        sh.shard_model(draft, mesh)
    return target, draft


def _truth(prompts):
    from dflash_jax import decode
    plain = decode.generate(_models(None)[0], None, prompts, **KW)
    truth = np.zeros((len(prompts), 64), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
        truth[i, :len(p) + len(t)] = p + t
    return plain, truth


def _same_on_mesh(spec, prompts, proposers, **kw):
    """generate on one device and on `spec` (fused layout, mesh= given) for each proposer kind:
    None (plain), "draft" (the random draft), "truth" (a double that errs at draft slot 1, so
    acceptance lengths vary); the mesh's results must be identical."""
    from dflash_jax import decode
    from tests.doubles import truth_proposer
    plain, truth = _truth(prompts)
    mesh = _mesh(spec)
    for kind in proposers:
        out = []
        for m in (None, mesh):
            target, draft = _models(m)
            prop = None if kind is None else draft if kind == "draft" else truth_proposer(draft, truth, 1, 128)
            out.append(decode.generate(target, prop, prompts, mesh=m, **{**KW, **kw}, verify_width="block"))
        one, many = out
        if kw.get("temperature", 0) == 0:
            assert one.tokens == plain.tokens, kind
        assert many.tokens == one.tokens, (spec, kind)
        assert many.acceptance_lengths == one.acceptance_lengths, (spec, kind)
        if kind == "truth" and kw.get("temperature", 0) == 0:
            assert max(max(a) for a in many.acceptance_lengths) > 1      # acceptance really varies
    if spec == "1x8":
        assert target.layers[0].num_kv_heads == 8 and target.layers[0].qkv_groups == 8   # kv copies
    return many


@child
@pytest.mark.parametrize("spec", ["2x4", "1x8"])
def test_generate_on_mesh_matches_one_device(spec):
    _same_on_mesh(spec, PROMPTS, (None, "truth"))


@child
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["8x1"])
def test_generate_on_mesh_matches_one_device_all_meshes(spec):
    """The data-only mesh test_generate_on_mesh_matches_one_device leaves out (it runs 2x4 and 1x8),
    speculative with the truth double (rows accept different lengths on different data shards).
    (Two-way model axes: the fused-kernel and sampling cases' 2x2 / 1x2.) Plain decoding on 8x1 is
    test_one_prompt_is_padded_to_the_data_axis's; the random draft runs the same draft pass as the
    truth double (which wraps it), and runs on a mesh in test_streaming_on_mesh."""
    _same_on_mesh(spec, PROMPTS, ("truth",))


@child
def test_one_prompt_is_padded_to_the_data_axis():
    from dflash_jax import decode
    many = _same_on_mesh("8x1", PROMPTS[:1], (None,))
    st, *_ = decode._static_and_params(*_models(_mesh("8x1")), PROMPTS[:1], stream=False,
                                       **decode._generate_defaults(KW))
    assert st.batch == 8 and len(many.tokens) == 1


@child
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 5, 1.0)])
def test_sampled_tokens_on_mesh_match_one_device(temperature, top_k, top_p):
    # One sampled mode through the loop on a mesh: the loop only tells greedy from sampled and hands
    # the mode to sampling.select / sampling.accept, whose every mode (top-p (0.9, 0, 0.8) and plain
    # temperature too) runs on vocab shards against one device in
    # test_sampling_on_vocab_shards_matches_one_device(_all_modes); a loop-level top-p case here
    # (13 s of CI) proved nothing more.
    _same_on_mesh("2x4", PROMPTS, ("truth",), temperature=temperature, top_k=top_k, top_p=top_p, seed=5)


@child
def test_mesh_errors_are_one_line():
    from dflash_jax import decode
    target, draft = _models(_mesh("1x2"))
    with pytest.raises(ValueError, match=r"the target's parameters are on mesh data=1,model=2, generate was given mesh data=2,model=4"):
        decode.generate(target, draft, PROMPTS, mesh="2x4", **KW, verify_width="block")
    with pytest.raises(ValueError, match=r"the draft's parameters are on one device"):
        decode.generate(target, _models(None)[1], PROMPTS, **KW, verify_width="block")
    with pytest.raises(ValueError, match="needs 16 devices, there are 8"):
        decode.generate(target, draft, PROMPTS, mesh="data=4,model=4", **KW, verify_width="block")


def _collective_ops(hlo: str, largest: bool = False):
    """[(op, result element count, result bytes)] of every collective in compiled HLO text (largest:
    of its largest operand alone, where XLA combined several into one tuple)."""
    import re
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
        if not m:
            continue
        n = b = 0
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            k = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
            n, b = (max(n, k), max(b, k * sizes.get(dt, 4))) if largest else (n + k, b + k * sizes.get(dt, 4))
        out.append((m.group(2), n, b))
    return out


@child
@pytest.mark.parametrize("spec,quantize", [("1x8", None), ("2x4", None), ("1x8", "int8")])
def test_sharded_iteration_collectives(spec, quantize):
    """One compiled loop iteration: two all-reduces of the [B, S, H] residual stream per layer
    (target and draft) and one per embedding lookup, a few scalar ones, the argmaxes' small
    all-gathers, and nothing else: no weight all-gather,
    no all-to-all or collective-permute. An int8 target (ahead of time: sharding.abstract_on_mesh
    places each Int8Weight's scales with its columns) adds no collective either."""
    from dflash_jax import decode
    dp, tp = sh.parse_mesh(spec)
    B, S, H = 8, DRAFT8.block_size, TINY8.hidden_size
    low = decode.lower_iteration(TINY8, DRAFT8, batch=B, prompt_len=16, capacity=64, dtype="float32",
                                 attention_impl="xla", mesh=_mesh(spec), quantize=quantize)
    ops = _collective_ops(low.compile().as_text())
    kinds = {op for op, _, _ in ops}
    assert kinds <= {"all-reduce", "all-gather"}, ops
    residual = B // dp * S * H                               # the compiled HLO's shapes are per shard
    reduces = [n for op, n, _ in ops if op == "all-reduce"]
    layers = TINY8.num_layers + DRAFT8.num_layers
    # + one per embedding lookup (the vocab-sharded table: each shard's rows, summed), the draft's
    # block and the verify block
    assert sum(n == residual for n in reduces) == 2 * layers + 2, ops
    assert all(n <= residual for n in reduces), ops          # nothing bigger than the residual
    # the argmaxes' (value, index) gathers of [B, S, TP]: never a weight or the logits
    assert all(n <= B // dp * S * tp for op, n, _ in ops if op == "all-gather"), ops


@child
@pytest.mark.slow
def test_streaming_on_mesh():
    from dflash_jax import decode
    target, draft = _models(_mesh("2x4"))
    seen = []
    res = decode.generate(target, draft, PROMPTS[:2], on_commit=lambda rows: seen.append(rows), **KW, verify_width="block")
    assert [sum((r[i] for r in seen), []) for i in range(2)] == res.tokens
    assert res.tokens == decode.generate(*_models(None), PROMPTS[:2], **KW, verify_width="block").tokens


if CHILD:
    # head_dim 64 and hidden 64: shapes the fused GPU kernels take (prologue, add + RMSNorm)
    TINY64 = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=64, rope_theta=10000.0)
    DRAFT64 = DraftConfig.for_target(TINY64, num_layers=1, block_size=4)


@child
@pytest.mark.slow
@pytest.mark.parametrize("spec", ["2x2"])
def test_fused_gpu_kernels_on_mesh_match_one_device(spec, monkeypatch):
    """The GPU path in the interpreter with the fused layer kernels on: on a mesh the prologue and
    the add + RMSNorm run per shard (shard_map), not the XLA fallback, and greedy tokens and
    acceptance lengths equal one device's (and the XLA path's)."""
    from dflash_jax import KernelConfig, attention, decode
    from pallas_kernels import fused_layer
    from tests.doubles import truth_proposer
    kernels = KernelConfig(attention="pallas_gpu_interpret")
    prompts, kw = PROMPTS[:2], dict(max_new_tokens=8, capacity=64)
    mesh = _mesh(spec)

    def models(m):
        target, draft = init_target(TINY64, seed=1, dtype="float32"), init_draft(DRAFT64, seed=2, dtype="float32")
        if m is not None:
            sh.shard_model(target, m)
            sh.shard_model(draft, m)
        return target, draft

    plain = decode.generate(models(None)[0], None, prompts, kernels=KernelConfig(attention="xla"), **kw)
    truth = np.zeros((len(prompts), 64), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain.tokens)):
        truth[i, :len(p) + len(t)] = p + t
    calls = []
    for name in ("qk_norm_rope_write", "add_rmsnorm"):
        real = getattr(fused_layer, name)
        monkeypatch.setattr(fused_layer, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    out = []
    for m in (None, mesh):
        calls.clear()
        target, draft = models(m)
        res = [decode.generate(target, prop, prompts, kernels=kernels, mesh=m, **kw, verify_width="block")
               for prop in (None, truth_proposer(draft, truth, 1, 128))]
        if m is not None:   # (the one-device program may be compiled already, by another spec)
            assert {"qk_norm_rope_write", "add_rmsnorm"} <= set(calls), (spec, calls)
        out.append(res)
    (one_plain, one_spec), (many_plain, many_spec) = out
    assert one_plain.tokens == plain.tokens and one_spec.tokens == plain.tokens
    assert many_plain.tokens == one_plain.tokens and many_spec.tokens == one_spec.tokens, spec
    assert many_spec.acceptance_lengths == one_spec.acceptance_lengths, spec
    assert max(max(a) for a in many_spec.acceptance_lengths) > 1          # acceptance really varies
    with sh.active(mesh):                                                 # the dispatch on a mesh
        assert attention.fused_prologue(kernels.resolve(), 4, 64, groups=2)
        assert not attention.fused_prologue(kernels.resolve(), 4, 64, groups=1)   # plain layout split


@child
@pytest.mark.slow
def test_sharded_gpu_loop_exports_for_cuda():
    """The speculative loop on a 1x2 mesh exports for CUDA with the fused kernels inside shard_map."""
    from dflash_jax import KernelConfig, decode
    exp = decode.export_generate(TINY64, DRAFT64, batch=2, prompt_len=16, max_new_tokens=16,
                                 dtype="bfloat16", platforms=("cuda",), mesh=_mesh("1x2"),
                                 kernels=KernelConfig(attention="pallas_gpu"))
    assert exp.platforms == ("cuda",) and exp.nr_devices == 2
    mlir = exp.mlir_module()
    for name in ("dflash_qk_norm_rope_write", "dflash_add_rmsnorm", "dflash_block_attention_gpu"):
        assert name in mlir, name
