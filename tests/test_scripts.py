"""The GPU benchmark scripts run end to end on CPU with tiny shapes (their --smoke modes).

Device time is scarce (30 minutes a session): a script that breaks here would waste a GPU call. These
run each script as a user would (a subprocess, `python scripts/...`) and check that it finishes and
prints its table; the numbers themselves mean nothing on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# subprocess runs of whole scripts: .ci/run runs them, a plain `pytest` skips them
pytestmark = pytest.mark.slow


def _run(args, tmp_path, timeout=600, **extra_env):
    env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), **extra_env)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_attention_ab_device_time_smoke(tmp_path):
    """--ab with --device-time: the kernels' time from a profiler trace (interpret mode on CPU)."""
    out = _run(["scripts/bench_attention.py", "--smoke", "--ab", "--device-time",
                "--json", str(tmp_path / "a.json")], tmp_path)
    assert "ab        default" in out and "ab        xla" in out and "read-only ceiling" in out
    assert (tmp_path / "a.json").exists()


def test_bench_attention_table_device_time_smoke(tmp_path):
    """The main table with --device-time: every impl timed from a trace, plus the read-only ceiling."""
    out = _run(["scripts/bench_attention.py", "--smoke", "--device-time", "--budget-s", "5",
                "--json", str(tmp_path / "t.json")], tmp_path)
    assert "read-only (ceiling)" in out and "# kernel checks" in out


def test_bench_attention_read_sweep_smoke(tmp_path):
    """--read-sweep: streaming-read kernels over a row's K/V bytes next to the attention, best named."""
    out = _run(["scripts/bench_attention.py", "--smoke", "--read-sweep", "--json", str(tmp_path / "r.json")], tmp_path)
    assert "attention (default config)" in out and "read-only ceiling (XLA sum)" in out
    assert "read dot splits=2" in out and "read sum splits=2" in out and "BEST streaming read" in out


def test_bench_w8a8_rows_smoke(tmp_path):
    """bench_w8a8_rows.py: both W8A8 forms and the bf16 dot timed at many rows, one row each."""
    out = _run(["scripts/bench_w8a8_rows.py", "--shapes", "tiny", "--rows", "130", "--reps", "1", "--tpu", ""], tmp_path)
    for form in ("fp8 dots (matmul_xla)", "dequantized, one dot (matmul_dequant)", "bf16 x @ w"):
        assert f"| tiny 256x384 | 130 | {form} |" in out, out


def test_bench_w8a8_chain_smoke(tmp_path):
    """bench_w8a8_chain.py: every form's chained layers timed at one and 16 rows, the Pallas W8A8 kernel
    interpreted (its one-row form too, which the model path leaves to XLA)."""
    out = _run(["scripts/bench_w8a8_chain.py", "--cpu-smoke"], tmp_path)
    for form in ("bf16", "fp8 weight-only", "w8a8 model", "w8a8 xla", "w8a8 pallas", "w8a8 dequant", "w8a8 channel"):
        for m in (1, 16):
            assert f"| {m} | {form} | " in out and f"| {m} | {form} | failed" not in out, out


def test_bench_gpu_gemms_smoke(tmp_path):
    """The gemms section times the four matmul-only programs and the report prints them."""
    out = _run(["scripts/bench_gpu.py", "--smoke", "--sections", "gemms", "--out", str(tmp_path)], tmp_path)
    for key in ("plain_bare", "plain_glue", "dflash_bare", "dflash_glue"):
        assert f"gemms {key}: " in out
    assert "their matmuls alone" in out


def test_bench_gpu_b1_profile_smoke(tmp_path):
    out = _run(["scripts/bench_gpu.py", "--smoke", "--sections", "b1,profile", "--out", str(tmp_path)], tmp_path)
    assert "dflash-jax GPU benchmark" in out
    assert (tmp_path / "bench_gpu.json").exists()


def test_bench_gpu_quant_w8a8_smoke(tmp_path):
    """The quant section (issue 57) with an FP8 target run W8A8 and its LM head int8 (--quantize
    fp8-w8a8+head: to_w8a8 after quantize_target): plain step and DFlash iteration against bf16 in
    one process, the quantized bytes its floor; --profile-quantize traces its DFlash loop."""
    q = "fp8-w8a8+head"
    out = _run(["scripts/bench_gpu.py", "--smoke", "--sections", "quant,profile", "--quantize", q,
                "--profile-quantize", q, "--quant-batches", "1", "--out", str(tmp_path)], tmp_path)
    d = __import__("json").loads((tmp_path / "bench_gpu.json").read_text())
    assert not d["errors"], d["errors"]
    row, = d["summary_quant"]
    assert row["quant"] == q and row[f"plain_{q}_ms"] > 0 and row[f"dflash_{q}_ms"] > 0, row
    # (the smoke target's bytes read: 0.551x bf16 with the FP8 linears alone, 0.503x with the head int8)
    assert d["model_bytes_quantized"][q]["target_read"] < 0.53 * d["model_bytes"]["target_read"], out[-2000:]
    # --profile-quantize: the profile section traced the quantized target's DFlash loop
    assert f"Profile: DFlash B=1 prompt 32 {q}:" in out and d["sections"]["profile"]["top"], out[-2000:]


def test_bench_gpu_quant_kinds_dflash_only(tmp_path):
    """--quant-kinds dflash: only the DFlash rows are planned (a call whose compiles cannot fit the
    plain ones too); a kind that is none is one CLI line."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_gpu_mod", os.path.join(REPO, "scripts", "bench_gpu.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m.parse_quant_kinds("dflash") == ("dflash",)
    assert m.parse_quant_kinds("dflash,plain") == ("plain", "dflash")
    with pytest.raises(ValueError, match="names no row kind"):
        m.parse_quant_kinds("decode")
    r = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--smoke", "--quantize", "int8", "--quant-kinds",
                        "decode", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--quant-kinds: 'decode' names no row kind" in r.stderr, r.stderr[-800:]
    assert "Traceback" not in r.stderr


def test_bench_gpu_longctx_pallas_only_smoke(tmp_path):
    """BENCH_LONG_IMPLS=pallas: the long-context section times our kernel's row and skips XLA's."""
    out = _run(["scripts/bench_gpu.py", "--smoke", "--sections", "longctx", "--out", str(tmp_path)],
               tmp_path, BENCH_LONG_IMPLS="pallas")
    rows = {line.split()[3]: line for line in out.splitlines() if line.startswith("DFlash B=1 p") and
            len(line.split()) > 4 and line.split()[3] in ("pallas", "xla")}
    assert "(not run)" not in rows["pallas"] and "(not run)" in rows["xla"]


def test_bench_engine_table_and_breakdown_smoke(tmp_path):
    """bench_engine.py: the static row and one engine row per refill setting (and per KV cache: fixed
    rows, paged), float32 tokens the same in every row, no compile in a timed run; --breakdown prints the programs against generate's loop
    (and, with --trace, their traced device timelines).

    CI time (compiles are most of it): a one-layer tiny target (--tiny-layers 1), and the four runs
    share one persistent XLA compilation cache in this test's directory, so a program the table and
    the breakdown both use (generate's, the step's, the inserts') is compiled once (every run still
    traces and counts its own programs: the timed runs' compile count is unchanged). The adaptive runs
    use block 4 (widths 0, 1, 3, one verify body fewer than block 8's 0, 1, 3, 7); the breakdown's
    forced width is the full block, as 7 was at block 8."""
    cache = dict(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    tiny = ["scripts/bench_engine.py", "--tiny", "--tiny-layers", "1", "--slots", "2", "--steps", "2",
            "--max-prompt", "24"]
    out = _run([*tiny, "--prompts", "6", "--min-new", "4", "--max-new", "12", "--refill-ahead", "off,on"], tmp_path,
               **cache)
    rows = [line for line in out.splitlines() if line.startswith("| engine, K=2")]
    assert "| static batches of 2 |" in out and len(rows) == 2, out
    assert all(line.rstrip().endswith("| 0 |") and "DIFFER" not in line for line in rows), out
    # the driving thread of each engine row: 6 prefills (one per prompt), at most 2 rows a step
    threads = [line.split("|") for line in out.splitlines() if line.startswith("| K=2, pipeline 1")]
    assert len(threads) == 2, out
    for cells in threads:
        assert int(cells[2]) > 0 and 1.0 <= float(cells[4]) <= 2.0 and int(cells[5]) == 6, cells
    out = _run([*tiny, "--breakdown", "--prompts", "2", "--trace", str(tmp_path / "trace")], tmp_path, **cache)
    assert "| engine step, full width | 2 |" in out and "| insert (prefill of 1" in out, out
    # --trace: both programs traced, their device timelines and the kernels that differ
    assert "| generate's loop |" in out and "kernels whose time differs most" in out, out
    assert "jit__slots_step" in out, out
    # adaptive programs: the engine at a simulated acceptance, and the breakdown of one step bucket
    # ... beside the paged engine (--kv-pages off,auto: a pool of the fixed rows' positions): the same tokens
    out = _run([*tiny, "--block", "4", "--prompts", "4", "--min-new", "4", "--max-new", "12", "--verify-width", "auto",
                "--simulated-tau", "2.5", "--kv-pages", "off,auto"], tmp_path, **cache)
    assert "SIMULATED ACCEPTANCE (geometric survival at tau 2.5), verify width auto" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| engine, K=2")]
    assert len(rows) == 2 and "KV paged" not in rows[0] and "KV paged" in rows[1], out
    assert all(line.rstrip().endswith("| 0 |") and "DIFFER" not in line for line in rows), out
    out = _run([*tiny, "--block", "4", "--breakdown", "--breakdown-rows", "1", "--verify-width", "3", "--prompts", "2"],
               tmp_path, **cache)
    assert "| engine step, bucket 1 | 1 |" in out, out


def test_bench_http_smoke(tmp_path):
    """bench_http.py: the server's own app over its null engine, streamed to by load_test's clients; every
    request gets its max_tokens (the script exits non-zero otherwise) and the row prints its host cost
    (enough tokens that the run spans many of /proc's 10 ms CPU ticks: 360 tokens took ~17 ms and could
    read 0 ticks)."""
    out = _run(["scripts/bench_http.py", "--http", "h11", "--loop", "asyncio", "--concurrency", "4",
                "--requests", "64", "--max-tokens", "64", "--tokens-per-step", "7"], tmp_path, timeout=300)
    row = [ln for ln in out.splitlines() if ln.startswith("| h11 | asyncio | 4 |")]
    assert len(row) == 1, out
    tok_s, chunks_s, cpu_per_1k = (float(c.replace(",", "")) for c in row[0].split("|")[4:7])
    assert tok_s > 0 and chunks_s > 0 and cpu_per_1k > 0


def test_probe_dispatch_smoke(tmp_path):
    """probe_dispatch.py: every setting's row (step alone, its call on an idle device with the last outputs
    freed and held, and behind a running step, the pipelined step, a prefill's call behind a step) and the step's while census (none in command
    buffers on CPU); the JSON holds the rows. --lower-cuda counts the loops of the step lowered for CUDA."""
    out = _run(["scripts/probe_dispatch.py", "--tiny", "--tiny-layers", "1", "--slots", "2", "--capacity", "256",
                "--prompt", "24", "--reps", "2", "--verify-width", "block", "--while-graphs", "off",
                "--json", str(tmp_path / "p.json")], tmp_path)
    rows = [ln.split("|")[1:-1] for ln in out.splitlines() if ln.startswith("| block | False |")]
    assert len(rows) == 1, out
    cells = [c.strip() for c in rows[0]]
    assert all(float(x) > 0 for x in cells[3:9]), cells           # alone .. insert behind, ms
    whiles, known, graphed, host = (int(x) for x in cells[9:13])
    assert whiles == known + host and graphed == 0, cells
    import json
    assert json.loads((tmp_path / "p.json").read_text())["rows"][0]["verify_width"] == "block"
    # --lower-cuda: the adaptive step lowered for CUDA here; its per-width loops hold the Pallas attention
    # kernels, none does with XLA attention
    out = _run(["scripts/probe_dispatch.py", "--tiny", "--tiny-layers", "1", "--slots", "2", "--capacity", "256",
                "--prompt", "24", "--lower-cuda", "--settings", "auto/on/auto,auto/on/xla"], tmp_path)
    pallas = [ln.split("|")[3:5] for ln in out.splitlines() if ln.startswith("| auto | pallas_gpu |")]
    xla = [ln.split("|")[3:5] for ln in out.splitlines() if ln.startswith("| auto | xla |")]
    assert len(pallas) == len(xla) == 1, out
    assert int(pallas[0][1]) >= 1 and int(xla[0][0]) >= 1 and int(xla[0][1]) == 0, out


def test_probe_dispatch_while_census_reads_command_buffers():
    """while_census on optimized-HLO text of XLA:GPU's shape: a loop of known trip count, one inside a
    command_buffer computation, and one of neither, whose custom calls are named as its blockers."""
    sys.path.insert(0, str(REPO / "scripts"))
    from probe_dispatch import while_census
    hlo = """HloModule m

%body.1 (p: (s32[])) -> (s32[]) {
  %c = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="__gpu$xla.gpu.triton"
}

%cond.1 (p: (s32[])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %a, s32[] %b), direction=LT
}

%body.2 (p: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(s32[] %a)
}

%command_buffer.7 (p: (s32[])) -> (s32[]) {
  ROOT %while.2 = (s32[]) while((s32[]) %p), condition=%cond.1, body=%body.2
}

ENTRY %main.9 (a: s32[]) -> (s32[]) {
  %while.1 = (s32[]) while((s32[]) %t0), condition=%cond.1, body=%body.1
  %while.3 = (s32[]) while((s32[]) %t0), condition=%cond.1, body=%body.2, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %call.4 = (s32[]) call((s32[]) %t0), to_apply=%command_buffer.7
}
"""
    census = while_census(hlo)
    assert census == dict(whiles=3, known=1, graphed=1, host=1, blockers="__gpu$xla.gpu.triton"), census


def test_bench_moe_smoke(tmp_path):
    """scripts/bench_moe.py (issue 36's H200 run) with tiny MoE shapes: every section prints its rows."""
    out = _run(["scripts/bench_moe.py", "--smoke", "--out", str(tmp_path)], tmp_path)
    for line in ("bw        copy", "touched   B=1   verify", "loop      B=1   plain", "loop      B=1   dflash",
                 "widths    B=1   w=4", "layer     T=4    pallas_gpu_interpret", "### (a) one expert layer",
                 "### (b) loop", "### (c) verify width", "loop      B=1   dflash pallas_gpu_interpret"):
        assert line in out, line
    assert (tmp_path / "bench_moe.json").exists()


def test_profile_step_smoke(tmp_path):
    """scripts/profile_step.py (session 33's per-kernel profiles): tiny MoE shapes, both programs, each
    kernel named from the compiled program's HLO, the table written as JSON; the target int8 (--quantize:
    bench_gpu's quantized targets, the same build path for every method)."""
    out = _run(["scripts/profile_step.py", "--smoke", "--top", "5", "--quantize", "int8", "--out", str(tmp_path)],
               tmp_path)
    for kind in ("plain", "dflash"):
        assert f"smoke {kind} B=1:" in out, kind
        data = __import__("json").loads((tmp_path / f"profile_step_smoke_{kind}_B1.json").read_text())
        assert data["top"] and any(row["hlo"] != "?" for row in data["top"])


def test_bench_hybrid_smoke(tmp_path):
    """scripts/bench_hybrid.py (issue 38's H200 rows) with tiny hybrid shapes: both rows of a batch,
    the DFlash floor counting the draft's pass over the LM head."""
    out = _run(["scripts/bench_hybrid.py", "--smoke", "--paths", "kernel-bv32", "--models", "9b", "--batches", "1",
                "--out", str(tmp_path / "h.jsonl")], tmp_path)
    rows = [__import__("json").loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert [r["block"] for r in rows] == [16, 1] and all(r["ms_per_iteration"] > 0 for r in rows), out[-2000:]
    assert {r["timing"] for r in rows} <= {"difference", "whole-call"}
    assert rows[0]["floor_bytes"]["draft_head"] > 0 and rows[1]["floor_bytes"]["draft_head"] == 0


def test_bench_hybrid_tpu_aot_smoke(tmp_path):
    """--tpu-aot: tiny hybrid shapes compiled for a v6e chip on this CPU host; each row carries the
    compiler's bytes and the per-op HBM traffic (tpu_bytes' accounting, never above the compiler's
    count, which charges VMEM-prefetched operands several times) against the floor."""
    _run(["scripts/bench_hybrid.py", "--smoke", "--tpu-aot", "v6e", "--forms", "chunk", "--batches", "1",
          "--out", str(tmp_path / "t.jsonl")], tmp_path)
    rows = [__import__("json").loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["block"] for r in rows] == [1, 16]
    for r in rows:
        assert 0 < r["hbm_bytes"] <= r["bytes_accessed"] and r["x_floor_hbm"] > 0.5, r


def test_bench_pages_smoke(tmp_path):
    """scripts/bench_pages.py (issue 56's requests in flight at a fixed KV budget), --smoke: both
    distributions, the fixed-slot engine run for real next to the paged one over the same workload,
    every request finishing with its forced length and every page given back (the script checks both),
    and the paged engine holding more requests than the fixed slots while the queue is non-empty."""
    out = _run(["scripts/bench_pages.py", "--smoke", "--json", str(tmp_path / "p.json")], tmp_path, timeout=120)
    rows = __import__("json").loads((tmp_path / "p.json").read_text())
    assert [(r["dist"], r["engine"]) for r in rows] == [("loguniform", "fixed-slot"), ("loguniform", "paged"),
                                                        ("uniform", "fixed-slot"), ("uniform", "paged")], out
    for fixed, paged in (rows[:2], rows[2:]):
        assert fixed["measured"] and fixed["slots"] == 2 and fixed["peak_inflight"] <= 2, out
        assert fixed["tokens"] == paged["tokens"] > 0 and paged["kv_pages_total"] == 15, out
    assert rows[1]["peak_inflight"] > rows[0]["peak_inflight"], out    # the log-uniform run: seconds of samples
    assert out.count("paged / fixed-slot, requests in flight:") == 2 and "| paged | 8 |" in out, out


def test_bench_quant_tau_smoke(tmp_path):
    """bench_quant_tau.py on the embedded pair: the target as loaded and W8A8 per channel, one prompt, a row
    each with DFlash lossless against the same target's plain greedy."""
    out = _run(["scripts/bench_quant_tau.py", "--max-samples", "1", "--max-new-tokens", "6",
                "--forms", "none,fp8-w8a8-channel"], tmp_path)
    assert "| none | " in out and "| 1.000 | 1 / 1 | 1.000 | 1 / 1 |" in out, out
    row = next(line for line in out.splitlines() if line.startswith("| fp8-w8a8-channel | "))
    assert row.split(" | ")[3] == "1 / 1", row
