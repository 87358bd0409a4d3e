"""The paged KV cache and prefix caching in the slot engine (dflash_jax.cache.PagedKVCache,
dflash_jax.serving.pages.PageAllocator, Slots(kv_pages=...)): a paged run gives one-shot generate's tokens and
acceptance lengths; a prefix hit (ending on a page boundary and inside a page) gives the cold run's
tokens and acceptance lengths exactly, so the draft's context K/V came back with the target's; pages
running out makes requests wait or be preempted, and they finish identical; the served multi-turn
chat hits turn 1's prefix. Greedy, float32, the trained vocab-32 pair (acceptance >= 3)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dflash_jax import generate, load_draft, load_target
from dflash_jax.serving.engine import Request, SlotEngine, Tokens
from dflash_jax.serving.pages import WindowPages
from dflash_jax.serving.slots import PagesShort, RowRequest, Slots
from tests.test_serve import tiny  # noqa: F401  (fixture)

CAP, PAGE, K = 96, 4, 3


@pytest.fixture(scope="module")
def pair(trained_small_vocab_pair):
    p = trained_small_vocab_pair
    target = load_target(p["target_path"], dtype="float32")
    return target, load_draft(p["draft_path"], target=target, dtype="float32")


def one_shot(target, draft, prompt, n):
    res = generate(target, draft, [list(prompt)], max_new_tokens=n, capacity=CAP, verify_width="block")
    return res.tokens[0], res.acceptance_lengths[0]


def prompt_of(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, 32, n))


def test_paged_slots_equal_one_shot_and_give_every_page_back(pair):
    target, draft = pair
    reqs = [RowRequest(prompt=prompt_of(i, 5 + 3 * i), max_new=9 + 4 * i) for i in range(4)]
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=40, page_size=PAGE)
    out = eng.run(reqs)
    for r, res in zip(reqs, out):
        toks, acc = one_shot(target, draft, r.prompt, r.max_new)
        assert res.tokens == toks and res.acceptance_lengths == acc
    assert max(a for res in out for a in res.acceptance_lengths) >= 3
    eng.pages.check()
    assert eng.pages.used() == 0 and eng.pages.available() == 39


def test_the_servers_paged_engine_compiles_nothing_after_warmup(pair):
    """The server's paged Slots (table_widths "full", as SlotEngine builds it): after warmup, requests
    whose rows hold 3 to 24 pages (so "pow2" would want table widths 4, 8, 16 and 32) and a prefix
    hit compile nothing, and give one-shot generate's tokens and acceptance lengths. (The CPU load
    test found the "pow2" server compiling 5-8 programs while serving: session 44, docs/perf-log.md.)"""
    from dflash_jax import decode
    target, draft = pair
    ps = [prompt_of(20 + i, n) for i, n in enumerate((5, 30, 12, 50))]
    ps.append(ps[3][:40] + prompt_of(30, 6))                                  # a 10-page prefix hit
    ns = [6, 40, 20, 30, 9]
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=80, page_size=PAGE, table_widths="full")
    eng.warmup([len(p) for p in ps], ["greedy"])
    n0 = decode.compile_count()
    out = eng.run([RowRequest(prompt=p, max_new=n) for p, n in zip(ps, ns)])
    assert decode.compile_count() == n0
    assert eng.pages.stats()["prefix_hits_tokens"] >= 40
    for p, n, res in zip(ps, ns, out):
        assert (res.tokens, res.acceptance_lengths) == one_shot(target, draft, p, n)
    with pytest.raises(ValueError, match="table_widths must be 'auto', 'pow2' or 'full', got 'pow3'"):
        Slots(target, draft, slots=2, capacity=CAP, kv_pages=80, page_size=PAGE, table_widths="pow3")
    # "auto" (the default): one width where the kernels read the pages, one per width where XLA gathers
    assert Slots(target, draft, slots=2, capacity=CAP, kv_pages=80, page_size=PAGE,
                 attention_impl="pallas_interpret").table_widths == "full"
    assert Slots(target, draft, slots=2, capacity=CAP, kv_pages=80, page_size=PAGE,
                 attention_impl="xla").table_widths == "pow2"


def test_sampled_requests_run_in_a_warmed_superset_mode_with_the_same_tokens(pair):
    """Warmed with greedy and filtered (serve --warmup-modes greedy,filtered), sampled requests of
    the modes left out (temperature alone, top-p, top-k) run in the warmed filtered programs: nothing
    compiles, and each row's seeded tokens equal those of an engine that compiled its exact mode."""
    from dflash_jax import decode
    target, draft = pair
    reqs = [RowRequest(prompt=prompt_of(40 + i, 9 + 2 * i), max_new=10 + i, temperature=0.8, seed=7 + i, **kw)
            for i, kw in enumerate([{}, dict(top_p=0.9), dict(top_k=5), {}])]
    assert [r.mode for r in reqs] == ["sample", "topp", "topk", "sample"]
    make = lambda: Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=80, page_size=PAGE,  # noqa: E731
                         table_widths="full")
    warm = make()
    warm.warmup([len(r.prompt) for r in reqs], ["greedy", "filtered"])
    n0 = decode.compile_count()
    got = warm.run(reqs)
    assert decode.compile_count() == n0
    assert {k[2] if k[0] == "insert" else k[0] for k in warm._programs} == {"greedy", "filtered"}
    want = make().run(reqs)                    # (compiles each exact mode on first use)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in want]


@pytest.mark.parametrize("shared", [8, 10], ids=["on_a_page", "inside_a_page"])
def test_a_prefix_hit_gives_the_cold_tokens_and_acceptance(pair, shared):
    """Request 2 shares `shared` tokens with request 1 (2 full pages of 4, then 0 or 2 more): it
    prefills only its tail, and its tokens and acceptance lengths equal a cold run's."""
    target, draft = pair
    first = prompt_of(1, 13)
    second = first[:shared] + prompt_of(2, 7)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE)
    eng.run([RowRequest(prompt=first, max_new=12)])
    hits = eng.pages.stats()["prefix_hits_tokens"]
    res = eng.run([RowRequest(prompt=second, max_new=15)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] - hits == 8            # the 2 full shared pages
    toks, acc = one_shot(target, draft, second, 15)
    assert res.tokens == toks and res.acceptance_lengths == acc
    assert max(acc) >= 3
    # and a request whose whole prompt is a cached prefix of an earlier output (a multi-turn chat)
    turn2 = first + tuple(eng.run([RowRequest(prompt=first, max_new=12)])[0].tokens) + prompt_of(3, 3)
    hits = eng.pages.stats()["prefix_hits_tokens"]
    res = eng.run([RowRequest(prompt=turn2, max_new=10)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] - hits >= 16
    toks, acc = one_shot(target, draft, turn2, 10)
    assert res.tokens == toks and res.acceptance_lengths == acc


def test_offline_pages_short_waits_then_runs_identical(pair):
    """A pool that holds one request at a time: the second waits for the first's pages."""
    target, draft = pair
    reqs = [RowRequest(prompt=prompt_of(10 + i, 9), max_new=20) for i in range(2)]
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=12, page_size=PAGE, prefix_cache=False)
    out = eng.run(reqs)
    for r, res in zip(reqs, out):
        assert (res.tokens, res.acceptance_lengths) == one_shot(target, draft, r.prompt, r.max_new)
    with pytest.raises(PagesShort, match="kv_pages=3"):
        Slots(target, draft, slots=1, capacity=CAP, steps=K, kv_pages=3, page_size=PAGE).run(reqs[:1])


def test_served_preemption_and_queueing_change_no_token(pair):
    """Four requests on a pool too small for them together: they queue, the newest running one is
    preempted when the others cannot grow, and every request's tokens equal one-shot generate's."""
    target, draft = pair
    reqs = [(prompt_of(20 + i, 6 + i), 60) for i in range(4)]
    eng = SlotEngine(target, draft, slots=4, capacity=CAP, steps=K, kv_pages=22, page_size=PAGE,
                     prefix_cache=False)
    try:
        hs = [eng.submit(Request(prompt=p, max_tokens=n, ignore_eos=True)) for p, n in reqs]
        got = [[t for ev in h.events() if isinstance(ev, Tokens) for t in ev.ids] for h in hs]
    finally:
        eng.shutdown(timeout=10)
    for (p, n), toks in zip(reqs, got):
        assert toks == one_shot(target, draft, p, n)[0]
    assert eng.slots.preemptions > 0
    eng.slots.pages.check()
    assert eng.slots.pages.used() == 0


def test_sampled_rows_with_a_prefix_hit_draw_what_the_cold_run_draws(pair):
    """A row's randomness is keyed by (seed, stream, position), never by its slot or by where its
    prefill started: sampled with a prefix hit, it draws the cold run's tokens (so the hit keeps its
    distribution: the cold run's is the target's, test_sampling.py)."""
    target, draft = pair
    first = prompt_of(30, 12)
    second = first[:8] + prompt_of(31, 5)
    kw = dict(max_new=14, temperature=0.9, top_p=0.95, seed=7)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE)
    eng.run([RowRequest(prompt=first, max_new=10)])
    hot = eng.run([RowRequest(prompt=second, **kw)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] == 8
    cold = Slots(target, draft, slots=2, capacity=CAP, steps=K).run([RowRequest(prompt=second, **kw)])[0]
    assert hot.tokens == cold.tokens and hot.acceptance_lengths == cold.acceptance_lengths


@pytest.fixture(scope="module")
def windowed_dflash2(trained_pair, tmp_path_factory):
    """test_dflash2.py's trained DFlash2 draft (the trained pair's draft with a perturbed conv, a
    selector and window-6 sliding layers), without its reference runs."""
    from tests.test_dflash2 import _write_reference_draft
    tp = trained_pair["target_path"]
    path, _ = _write_reference_draft(str(tmp_path_factory.mktemp("d2") / "d2"), tp, dflash2=True,
                                     layer_types=["sliding_attention"] * 2, is_causal=False, window=6, seed=13,
                                     init_from=trained_pair["draft_path"], scale=0.1)
    target = load_target(tp, dtype="float32")
    return dict(target=target, draft=load_draft(path, target=target, dtype="float32"),
                prompts=trained_pair["eval_prompts"][:2])


def test_windowed_dflash2_prefix_hit_gives_the_cold_tokens_and_acceptance(windowed_dflash2):
    """The DFlash2 draft with window-6 sliding layers and a selector, without a window pool
    (window_pages=0, `--kv-window-pages 0`): in the main pages its sliding layers keep every row (the
    window a mask), so a hit restores their context as well. (The window pool, the default: the
    next test.)"""
    d = windowed_dflash2
    target, draft = d["target"], d["draft"]
    first = tuple(d["prompts"][0])
    second = first[:8] + tuple(d["prompts"][1][:6])
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE, window_pages=0)
    assert eng.wpages is None
    eng.run([RowRequest(prompt=first, max_new=12)])
    res = eng.run([RowRequest(prompt=second, max_new=20)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] >= 8
    want = generate(target, draft, [list(second)], max_new_tokens=20, capacity=CAP, verify_width="block")
    assert res.tokens == want.tokens[0] and res.acceptance_lengths == want.acceptance_lengths[0]
    assert max(want.acceptance_lengths[0]) >= 3


def test_windowed_dflash2_frees_the_pages_behind_its_window(windowed_dflash2):
    """The window-6 DFlash2 draft's sliding layers in a window pool of their own (pages.WindowPages):
    a row whose output runs far past the window holds window pages only around its window and reach
    (its peak below the main pages it holds), gives one-shot generate's tokens and acceptance
    lengths, and a prefix hit on its pages (ending on a page and inside one) is one too: the window
    pages of the hit's last window came back with the main pages."""
    d = windowed_dflash2
    target, draft = d["target"], d["draft"]
    cap = 192
    eng = Slots(target, draft, slots=2, capacity=cap, steps=K, kv_pages=120, page_size=PAGE)
    win = eng.wpages
    assert win is not None and win.window == 6 and win.behind == max(6 - 1, eng.block_size)
    first = tuple(d["prompts"][0])
    peak_main = []
    eng.grow = (lambda grow: lambda busy: (peak_main.append(eng.pages.used()), grow(busy))[1])(eng.grow)
    res = eng.run([RowRequest(prompt=first, max_new=120)])[0]
    want = generate(target, draft, [list(first)], max_new_tokens=120, capacity=cap, verify_width="block")
    assert res.tokens == want.tokens[0] and res.acceptance_lengths == want.acceptance_lengths[0]
    assert max(want.acceptance_lengths[0]) >= 3
    # the shared-table design held a window page for every main page; here the window pool's peak
    # is what one row's live window + reach needs, well under the row's main pages
    assert win.peak < max(peak_main) and win.peak <= WindowPages.live_pages(6, eng.block_size, PAGE,
                                                                             (2 * K + 1) * eng.block_size)
    assert win.alloc.stats()["evictions"] == 0 and win.used() == 0 and eng.pages.used() == 0
    win.check()
    eng.pages.check()
    turn = first + tuple(res.tokens)
    for extra in (0, 2):          # a hit ending on a page boundary / inside a page
        cut = (len(turn) - eng.block_size) // PAGE * PAGE - 3 * PAGE + extra
        second = turn[:cut] + tuple(d["prompts"][1][:5])
        hits = eng.pages.stats()["prefix_hits_tokens"]
        got = eng.run([RowRequest(prompt=second, max_new=20)])[0]
        assert eng.pages.stats()["prefix_hits_tokens"] - hits == cut - extra     # every full shared page
        want = generate(target, draft, [list(second)], max_new_tokens=20, capacity=cap, verify_width="block")
        assert got.tokens == want.tokens[0] and got.acceptance_lengths == want.acceptance_lengths[0]
    # a prefix whose window pages are gone (behind the first row's window when it ended) is capped
    early = turn[:4 * PAGE] + tuple(d["prompts"][1][:5])
    hits = eng.pages.stats()["prefix_hits_tokens"]
    got = eng.run([RowRequest(prompt=early, max_new=8)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] - hits < 4 * PAGE
    want = generate(target, draft, [list(early)], max_new_tokens=8, capacity=cap, verify_width="block")
    assert got.tokens == want.tokens[0] and got.acceptance_lengths == want.acceptance_lengths[0]
    win.check()


def test_windowed_dflash2_auto_window_pool_with_a_small_main_pool(windowed_dflash2):
    """window_pages='auto' (the default) with a main pool smaller than one row's live window + reach:
    a row's window pages are a subset of its main pages, so a window pool as large as the main pool
    always holds one row (the shared design's case); the engine must not refuse it, and its tokens
    and acceptance lengths are one-shot generate's."""
    d = windowed_dflash2
    target, draft = d["target"], d["draft"]
    live = WindowPages.live_pages(6, draft.config.block_size, PAGE, (2 * K + 1) * draft.config.block_size)
    kv_pages = live            # (live - 1 usable pages: less than one row's live window)
    eng = Slots(target, draft, slots=1, capacity=CAP, steps=K, kv_pages=kv_pages, page_size=PAGE)
    assert eng.wpages is not None and eng.wpages.alloc.num_pages == kv_pages
    prompt = tuple(d["prompts"][0][:10])
    res = eng.run([RowRequest(prompt=prompt, max_new=40)])[0]
    want = generate(target, draft, [list(prompt)], max_new_tokens=40, capacity=CAP, verify_width="block")
    assert res.tokens == want.tokens[0] and res.acceptance_lengths == want.acceptance_lengths[0]
    eng.wpages.check()
    assert eng.wpages.used() == 0 and eng.pages.used() == 0


def test_a_hybrid_target_is_refused_in_one_line(tmp_path):
    """Qwen3.5's Gated DeltaNet layers keep per-row recurrent state, which pages (and a prefix hit)
    do not restore: the paged engine refuses the target and names the fixed-slot engine."""
    pytest.importorskip("torch")
    from tests.test_qwen3_5 import write_qwen3_5
    target = load_target(write_qwen3_5(str(tmp_path / "q35")), dtype="float32")
    with pytest.raises(ValueError, match="paged KV cache is not supported for the qwen3_5 target"):
        Slots(target, None, slots=2, capacity=32, kv_pages=8)


def test_served_multi_turn_chat_hits_turn_1_and_equals_a_cold_server(tiny):
    """Through the OpenAI client: turn 2 (turn 1's messages, its answer, a new question) hits turn 1's
    pages (the prefix-cache counters show it) and answers what a server that never saw turn 1
    answers; the speculative counters give the served tau (1 + accepted / drafts)."""
    from tests.test_serve import CAPACITY, NAME, PROMPT, client, serving
    from dflash_jax.serving.server import build_app
    import httpx

    def metric(text, name):
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def engine():
        return SlotEngine(tiny.target, tiny.draft, slots=2, capacity=CAPACITY, eos_token_ids=tiny.eos,
                          attention_impl="xla", kv_pages=96, page_size=8)
    turn1 = [{"role": "user", "content": PROMPT}]
    eng = engine()
    try:
        with serving(build_app(eng, tiny.tok, model_name=NAME)) as url:
            c = client(url)
            a1 = c.chat.completions.create(model=NAME, messages=turn1, max_tokens=12, temperature=0)
            turn2 = turn1 + [{"role": "assistant", "content": a1.choices[0].message.content},
                             {"role": "user", "content": "and what did the dog do then"}]
            before = metric(httpx.get(url + "/metrics").text, "vllm:prefix_cache_hits_total")
            a2 = c.chat.completions.create(model=NAME, messages=turn2, max_tokens=12, temperature=0)
            text = httpx.get(url + "/metrics").text
    finally:
        eng.shutdown(timeout=10)
    assert metric(text, "vllm:prefix_cache_hits_total") - before >= 8
    drafts, accepted = metric(text, "vllm:spec_decode_num_drafts_total"), metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    tau = metric(text, "dflash_acceptance_length_sum") / metric(text, "dflash_acceptance_length_count")
    assert drafts > 0 and abs(1 + accepted / drafts - tau) < 1e-9
    cold = engine()
    try:
        with serving(build_app(cold, tiny.tok, model_name=NAME)) as url:
            b2 = client(url).chat.completions.create(model=NAME, messages=turn2, max_tokens=12, temperature=0)
    finally:
        cold.shutdown(timeout=10)
    assert a2.choices[0].message.content == b2.choices[0].message.content


# The mesh case runs in the 4-device child of tests/test_quantize.py::test_int8_and_fp8_on_a_2x2_mesh_equal_one_device
# (one process for every 4-device case). Directly:
#     DFLASH_PAGED_CHILD=1 XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest tests/test_paged.py -m slow -k mesh_child
CHILD = os.environ.get("DFLASH_PAGED_CHILD") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not CHILD, reason="runs in the 4-device child (tests/test_quantize.py's mesh parent)")
def test_paged_mesh_child_prefix_hit_equals_one_device():
    """Pages on a 2x2 mesh (pools by kv head on 'model', every page on each data shard; slots and
    their table rows on 'data'): requests with and without prefix hits give one device's tokens
    and acceptance lengths."""
    import jax
    from dflash_jax import sharding as sh
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.weights import init_draft, init_target

    cfg = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    dcfg = DraftConfig.for_target(cfg, num_layers=1, block_size=4)

    def models(mesh):
        t, d = init_target(cfg, dtype="float32"), init_draft(dcfg, dtype="float32")
        if mesh is not None:
            sh.shard_model(t, mesh)
            sh.shard_model(d, mesh)
        return t, d

    base = prompt_of(40, 12)
    reqs = [RowRequest(prompt=base, max_new=9), RowRequest(prompt=base[:9] + prompt_of(41, 4), max_new=11),
            RowRequest(prompt=prompt_of(42, 6), max_new=7), RowRequest(prompt=base[:5] + prompt_of(43, 3), max_new=8)]
    kw = dict(slots=2, capacity=CAP, steps=2, attention_impl="xla", kv_pages=64, page_size=PAGE)
    runs = []
    for mesh in (None, sh.make_mesh("2x2", devices=jax.devices()[:4])):
        eng = Slots(*models(mesh), **kw)
        runs.append([eng.run([r])[0] for r in reqs])          # one at a time: hits on earlier requests
        assert eng.pages.stats()["prefix_hits_tokens"] == 8 + 4
    assert [o.tokens for o in runs[1]] == [o.tokens for o in runs[0]]
    assert [o.acceptance_lengths for o in runs[1]] == [o.acceptance_lengths for o in runs[0]]


def test_serve_flags_size_the_pool(pair, capsys):
    """--kv-pages / --kv-cache-memory / --page-size / --prefix-cache reach the engine; bad ones are
    one-line CLI errors."""
    from dflash_jax.serving import server as serve
    target, draft = pair
    p = serve.build_parser()
    a = p.parse_args(["--slots", "4", "--kv-pages", "64", "--prefix-cache", "off"])
    assert serve.paged_args(p, a, target, draft) == dict(kv_pages=64, page_size=16, prefix_cache=False)
    a = p.parse_args(["--slots", "4", "--kv-cache-memory", "0.001", "--page-size", "8"])
    per_page = serve.page_bytes(target, draft, 8)
    c = target.config
    assert per_page == 2 * 8 * c.head_dim * 4 * (c.num_layers * c.num_kv_heads
                                                  + draft.config.num_layers * draft.config.num_kv_heads)
    assert serve.paged_args(p, a, target, draft)["kv_pages"] == int(0.001 * 2**30 // per_page)
    assert serve.paged_args(p, p.parse_args(["--slots", "4"]), target, draft) == {}
    for bad, msg in ((["--kv-pages", "64", "--kv-cache-memory", "1"], "not both"), (["--kv-pages", "1"], "at least 2"),
                     (["--kv-cache-memory", "-1"], "must be > 0")):
        with pytest.raises(SystemExit):
            serve.paged_args(p, p.parse_args(["--slots", "4"] + bad), target, draft)
        assert msg in capsys.readouterr().err


def test_serve_flags_size_the_window_pool(windowed_dflash2, capsys):
    """--kv-window-pages reaches the engine (auto, N, 0: off); with --kv-cache-memory the window pool's
    bytes (the draft's sliding layers) come out of the budget first and a main page no longer counts
    them."""
    from dflash_jax.serving import server as serve
    target, draft = windowed_dflash2["target"], windowed_dflash2["draft"]
    p = serve.build_parser()
    a = p.parse_args(["--slots", "4", "--kv-pages", "64"])
    assert serve.paged_args(p, a, target, draft)["window_pages"] == "auto"
    a = p.parse_args(["--slots", "4", "--kv-cache-memory", "0.001", "--page-size", "8", "--kv-window-pages", "40"])
    main, window = serve.page_bytes(target, draft, 8, windowed=False), serve.page_bytes(None, draft, 8, windowed=True)
    assert main + window == serve.page_bytes(target, draft, 8) and window > 0
    got = serve.paged_args(p, a, target, draft)
    assert got["window_pages"] == 40 and got["kv_pages"] == (int(0.001 * 2**30) - 40 * window) // main
    a = p.parse_args(["--slots", "4", "--kv-cache-memory", "0.001", "--kv-window-pages", "0"])
    assert serve.paged_args(p, a, target, draft)["kv_pages"] == int(0.001 * 2**30 // serve.page_bytes(target, draft, 16))
    for bad in ("1", "-2", "many"):
        with pytest.raises(SystemExit):
            serve.paged_args(p, p.parse_args(["--slots", "4", "--kv-pages", "64", "--kv-window-pages", bad]), target, draft)
        assert "--kv-window-pages" in capsys.readouterr().err
    # auto with a budget of a few pages: the pools Slots accepts (a window pool below one row's live
    # window must be at least the main pool), within the budget
    w8, live = serve.page_bytes(None, draft, 8, windowed=True), WindowPages.live_pages(6, draft.config.block_size, 8,
                                                                                       9 * draft.config.block_size)
    main8 = serve.page_bytes(target, draft, 8, windowed=False)
    for budget in (5 * (main8 + w8) + main8, 5 * (main8 + w8) + main8 + w8 - 1, (live + 3) * (main8 + w8) + main8):
        got = serve.paged_args(p, p.parse_args(["--slots", "4", "--page-size", "8", "--kv-cache-memory",
                                                repr(budget / 2**30)]), target, draft)
        assert got["window_pages"] - 1 >= min(live, 4096 // 8, got["kv_pages"] - 1)
        assert got["window_pages"] * w8 + got["kv_pages"] * main8 <= budget
        assert got["kv_pages"] >= budget // (main8 + w8)          # never fewer than the shared design's


@pytest.mark.slow
@pytest.mark.parametrize("attention, impl", [("pallas_interpret", "tpu"), ("pallas_gpu_interpret", "gpu")])
def test_pallas_kernels_read_the_pages_and_change_no_token(monkeypatch, caplog, attention, impl):
    """On the Pallas paths (the TPU kernels, the GPU ones, each in interpret mode) the layers write
    their rows into the pools with the path's page-write kernel and the attention kernel reads them
    through the page table (no gathered view): a paged run with a prefix hit gives one-shot
    generate's tokens and acceptance lengths. TPU: a random pair with the kernel's head_dim 64. GPU:
    the embedded trained pair (head_dim 64) on a HumanEval prompt, whose acceptance (>= 3 on the hit)
    also proves the draft's context rows that the kernel wrote."""
    from pallas_kernels.attention import gpu_cache_write, tpu_cache_write
    import pallas_kernels
    from dflash_jax import KernelConfig
    from dflash_jax.config import DraftConfig, TargetConfig
    from dflash_jax.weights import init_draft, init_target
    if impl == "gpu":
        from dflash_jax.assets import default_pair
        if default_pair() is None:
            pytest.skip("this checkout carries no embedded pair")
        from transformers import AutoTokenizer
        tdir, ddir = default_pair()
        target = load_target(tdir, dtype="float32")
        draft = load_draft(ddir, target=target, dtype="float32")
        with open(os.path.join(os.path.dirname(__file__), "..", "dflash_jax", "datasets", "humaneval.jsonl")) as f:
            text = json.loads(f.readlines()[3])["prompt"]
        first = tuple(AutoTokenizer.from_pretrained(tdir)(text)["input_ids"])      # 132 tokens
        second, cap, new = first[:-5], 256, 48
    else:
        cfg = TargetConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=64, rope_theta=10000.0)
        target = init_target(cfg, dtype="float32")
        draft = init_draft(DraftConfig.for_target(cfg, num_layers=1, block_size=4), dtype="float32", target=target)
        first = prompt_of(50, 20)
        second, cap, new = first[:17] + prompt_of(51, 5), 64, 12
    kernels = KernelConfig(attention=attention)
    calls, real = [], pallas_kernels.block_attention_paged
    monkeypatch.setattr(pallas_kernels, "block_attention_paged",
                        lambda *a, **kw: calls.append(kw["impl"]) or real(*a, **kw))
    writer = {"tpu": tpu_cache_write, "gpu": gpu_cache_write}[impl]
    writes, real_write = [], writer.write_kv_pages
    monkeypatch.setattr(writer, "write_kv_pages", lambda *a, **kw: writes.append(a[2].shape) or real_write(*a, **kw))
    eng = Slots(target, draft, slots=2, capacity=cap, steps=K, kv_pages=2 * cap // 16 + 1, page_size=16,
                kernels=kernels)
    eng.run([RowRequest(prompt=first, max_new=8)])
    res = eng.run([RowRequest(prompt=second, max_new=new)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] == (len(second) - 1) // 16 * 16
    want = generate(target, draft, [list(second)], max_new_tokens=new, capacity=cap, verify_width="block")
    assert res.tokens == want.tokens[0] and res.acceptance_lengths == want.acceptance_lengths[0]
    if impl == "gpu":
        assert np.mean(res.acceptance_lengths) >= 3          # 3.92: the drafts read their context rows
    assert calls and set(calls) == {impl}                        # every layer's attention read pages
    assert writes                                                # the layers wrote them with the kernel
    assert "cannot take" not in caplog.text                      # and no kernel fell back to the gather


def test_host_arrays_go_to_the_device_as_copies(pair):
    """On CPU jnp.asarray aliases a large aligned numpy array instead of copying it; the page table
    and the release flags change on the host while a program dispatched with them may not have run
    yet, so Slots hands the device copies."""
    target, draft = pair
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=8, page_size=PAGE)
    host = np.zeros((1024, 1024), np.int32)
    dev = eng._table_arg(host)
    host[5, 5] = 7
    assert int(dev[5, 5]) == 0


def test_an_admission_retried_while_pages_are_short_counts_one_query(pair):
    target, draft = pair
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=14, page_size=PAGE)
    first = prompt_of(60, 13)
    eng.run([RowRequest(prompt=first, max_new=8)])
    held, _ = eng.pages.match(first, count=False)               # the prefix's pages stay (not evicted)
    hog = eng.pages.allocate(eng.pages.available() - 1)          # leave one page: admissions fail
    before = eng.pages.stats()
    for _ in range(3):
        assert not eng.admit(0, RowRequest(prompt=first[:8] + prompt_of(61, 4), max_new=4))
    assert eng.pages.stats()["prefix_queries_tokens"] == before["prefix_queries_tokens"]
    eng.pages.release(hog + held)
    assert eng.admit(0, RowRequest(prompt=first[:8] + prompt_of(61, 4), max_new=4))
    after = eng.pages.stats()
    assert (after["prefix_queries_tokens"] - before["prefix_queries_tokens"],
            after["prefix_hits_tokens"] - before["prefix_hits_tokens"]) == (12, 8)
    eng.release(0)
    eng.pages.check()


def test_a_resumed_penalised_row_hits_only_its_prompt(pair):
    """A resumed row (the preempted case, built directly): its prompt ends with `resumed` generated
    tokens whose pages are cached from its first run. Its hit stops before them, so the penalties
    count them and it continues exactly as the uninterrupted run."""
    target, draft = pair
    pen = dict(presence=1.5, frequency=1.0)
    prompt = prompt_of(80, 9)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE)
    full = eng.run([RowRequest(prompt=prompt, max_new=40, **pen)])[0].tokens
    cut = 20
    hits = eng.pages.stats()["prefix_hits_tokens"]
    rest = eng.run([RowRequest(prompt=prompt + tuple(full[:cut]), max_new=40 - cut, resumed=cut, **pen)])[0].tokens
    assert eng.pages.stats()["prefix_hits_tokens"] - hits == 8       # the prompt's 2 full pages, not the tail's
    assert full[cut:] == rest


def test_auto_width_paged_with_a_prefix_hit_equals_one_shot(pair):
    """The server's default width choice ("auto") on the paged engine with the prefix cache on: a
    request with a hit gives one-shot generate's tokens, and its blocks still accept >= 3."""
    target, draft = pair
    first = prompt_of(90, 12)
    second = first[:8] + prompt_of(91, 5)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=60, page_size=PAGE, verify_width="auto")
    eng.run([RowRequest(prompt=first, max_new=10)])
    res = eng.run([RowRequest(prompt=second, max_new=20)])[0]
    assert eng.pages.stats()["prefix_hits_tokens"] == 8
    want = generate(target, draft, [list(second)], max_new_tokens=20, capacity=CAP, verify_width="block")
    assert res.tokens == want.tokens[0] and max(res.acceptance_lengths) >= 3


def test_n_choices_of_one_prompt_share_its_pages(pair):
    """A request's n choices (the same prompt submitted together) share the prompt's full pages:
    the first prefills them, the others hit them one engine turn later, and every choice's tokens
    equal one-shot generate's."""
    target, draft = pair
    p = prompt_of(41, 4 * PAGE + 2)                    # 4 full pages + 2 tokens
    eng = SlotEngine(target, draft, slots=4, capacity=CAP, steps=K, kv_pages=64, page_size=PAGE)
    try:
        hs = [eng.submit(Request(prompt=p, max_tokens=24, ignore_eos=True)) for _ in range(3)]
        got = [[t for ev in h.events() if isinstance(ev, Tokens) for t in ev.ids] for h in hs]
        stats = eng.slots.pages.stats()
    finally:
        eng.shutdown(timeout=10)
    want = one_shot(target, draft, p, 24)[0]
    assert got == [want] * 3
    assert stats["prefix_hits_tokens"] >= 2 * 4 * PAGE - 2 * PAGE     # choices 2 and 3 hit (up to the last full page)


class _Banned:
    """A grammar (the slot engine's duck type: mask, walk, consume) that refuses a set of tokens:
    small enough to check against a plain oracle, and binding wherever the model would pick one."""

    def __init__(self, vocab: int, banned):
        bits = np.ones(-(-vocab // 32) * 32, bool)
        bits[list(banned)] = False
        bits[vocab:] = False
        self.banned, self.row = set(banned), np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(
            np.uint32).view(np.int32).reshape(-1)

    def mask(self):
        return self.row.copy()

    def walk(self, drafts):
        out = np.full((len(drafts) + 1, self.row.size), -1, np.int32)
        out[0] = self.row
        for i, d in enumerate(drafts):
            if int(d) in self.banned:
                break
            out[i + 1] = self.row
        return out

    def consume(self, tokens):
        pass


def test_constrained_rows_on_the_default_served_path_equal_plain_constrained_decoding(pair, trained_small_vocab_pair):
    """A constrained row on the served engine's default path (adaptive verify width, paged cache with
    the prefix cache on, a prefix hit) with the trained pair (acceptance >= 3) gives transformers'
    greedy decoding with the grammar's refused tokens masked, token for token."""
    import torch
    from transformers import Qwen3ForCausalLM

    target, draft = pair
    p = prompt_of(55, 3 * PAGE + 1)
    free = one_shot(target, draft, p, 40)[0]
    counts = {t: free.count(t) for t in set(free)}
    banned = {min(counts, key=counts.get)}                  # a token the free run emits: the mask binds
    hf = Qwen3ForCausalLM.from_pretrained(trained_small_vocab_pair["target_path"], dtype=torch.float32).eval()
    seq, want = list(p), []
    for _ in range(40):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].numpy()
        logits[list(banned)] = -np.inf
        want.append(int(logits.argmax()))
        seq.append(want[-1])
    eng = SlotEngine(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=64, page_size=PAGE,
                     verify_width="auto")
    try:
        list(eng.submit(Request(prompt=p, max_tokens=8, ignore_eos=True)).events())     # its pages: a hit next
        h = eng.submit(Request(prompt=p, max_tokens=40, ignore_eos=True,
                               grammar=_Banned(target.config.vocab_size, banned)))
        got = [t for ev in h.events() if isinstance(ev, Tokens) for t in ev.ids]
        stats, hits = h._stats, eng.slots.pages.stats()["prefix_hits_tokens"]
    finally:
        eng.shutdown(timeout=10)
    assert got == want and got != free
    assert hits > 0 and max(stats.acceptance_lengths) >= 3, (hits, stats.acceptance_lengths)


def test_lower_slot_step_with_a_window_pool_moves_the_sliding_layers_out_of_the_main_pages():
    """decode.lower_slot_step(window_pages=N) lowers the paged step with the draft's sliding layers in
    a window pool of N pages read through a second table: the program's arguments shrink by exactly
    the sliding layer's main pages less its window pages, plus the window table."""
    import dataclasses

    from dflash_jax import DraftConfig, TargetConfig
    from dflash_jax.decode import lower_slot_step
    cfg = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=10000.0)
    draft = dataclasses.replace(DraftConfig.for_target(cfg, num_layers=2, block_size=4),
                                layer_types=("sliding_attention", "full_attention"), sliding_window=16)
    kw = dict(slots=4, capacity=128, steps=2, page_size=16, dtype="float32", attention_impl="xla")
    size = lambda **k: lower_slot_step(cfg, draft, **kw, **k).compile().memory_analysis().argument_size_in_bytes  # noqa: E731
    main_pages, window_pages, page_bytes = 4 * 128 // 16 + 1, 12, 2 * 2 * 16 * 16 * 4      # k and v, Hkv 2, D 16
    assert size() - size(window_pages=window_pages) == (main_pages - window_pages) * page_bytes - 4 * 8 * 4
    with pytest.raises(ValueError, match="page_size"):
        lower_slot_step(cfg, draft, slots=4, capacity=128, window_pages=12, dtype="float32", attention_impl="xla")


def test_a_failed_insert_publishes_no_page_it_never_wrote(pair, monkeypatch):
    """An insert that fails after its row was started (its program could not be built or run) is
    released by the engine: nothing of its prompt beyond a prefix hit may become findable, since its
    prefill never wrote those pages; the same prompt then runs cold and equals one-shot."""
    target, draft = pair
    prompt = prompt_of(41, 13)
    eng = Slots(target, draft, slots=2, capacity=CAP, steps=K, kv_pages=40, page_size=PAGE)
    real = eng._insert_program

    def broken(*a, **k):
        raise RuntimeError("no program")
    monkeypatch.setattr(eng, "_insert_program", broken)
    with pytest.raises(RuntimeError, match="no program"):
        eng.insert([(0, RowRequest(prompt=prompt, max_new=8))])
    eng.release(0)
    pages, covered = eng.pages.match(prompt, count=False)
    eng.pages.release(pages)
    assert covered == 0
    monkeypatch.setattr(eng, "_insert_program", real)
    res = eng.run([RowRequest(prompt=prompt, max_new=8)])[0]
    assert (res.tokens, res.acceptance_lengths) == one_shot(target, draft, prompt, 8)
    eng.pages.check()
