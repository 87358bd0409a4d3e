#!/usr/bin/env python
"""GPU benchmark of dflash-jax: every number of the H200 report in ONE device call (< 8 min).

    python scripts/bench_gpu.py                     # the full run (H200; about 6-8 minutes)
    python scripts/bench_gpu.py --smoke             # tiny shapes on CPU: proves every section runs
    python scripts/bench_gpu.py --sections floors,b1,profile
    python scripts/bench_gpu.py --out DIR           # JSON + trace go to DIR (default: $OUT if set)

Sections, in run order (a section that fails prints its error and the rest go on; a section that
would not fit the time budget is skipped and named at the end, so `--sections` can rerun it):

  reference  the PyTorch reference (dflash 0.1.0 `dflash_generate` + transformers) at the same shapes,
             random bf16 weights, prompt 512, block 16 and block 1: ms per iteration. It runs FIRST
             and in a SUBPROCESS, before this process lets JAX touch the GPU, so JAX's preallocation
             cannot starve torch and torch's memory is gone (process exit) when JAX starts.
  floors     device copy bandwidth (bytes read + written), XLA bf16 GEMV bandwidth, bf16 GEMM rate;
             then the byte floors from the parameter bytes of the models actually built.
  b1         batch 1, prompt 512: DFlash ms per iteration and plain ms per token vs their floors.
  gemms      (only when named) the matmuls of a plain step and of a DFlash iteration alone, on the
             same weight buffers in a while_loop: what XLA's GEMM chain costs with nothing else.
  compile    compile time of the whole generation, and a second call in the same bucket (other
             prompt length / max_new_tokens) that must not compile (compile_time_s == 0).
  sampling   DFlash iteration time at T=1 (and T=1, top-p 0.95, top-k 20) vs greedy.
  profile    jax.profiler trace of two short B=1 generations; per-kernel device time per loop
             iteration from the difference of the two traces (prefill cancels). Trace saved.
  batch      DFlash at B 8, 32, 64 and plain at B 8, 32, 64; batch-scaling table, projected
             speed-up at the paper's tau, and where DFlash stops paying.
  longctx    prompt 32k, B=1: DFlash ms per iteration with attention "pallas" and "xla" vs the floor
             (weights + KV bytes at 32k).
  quant      (only when named, with --quantize int8[,...]) plain step and DFlash iteration at B =
             --quant-batches (1, 8, 32), the bf16 target and the same random target quantized
             (init_target(quantize=...): the same weights rounded), same draft, same process; then a
             table of both times, their ratio and each row against its byte floor (the weight bytes
             as stored + the KV read, over the copy bandwidth: --floor-tbs, else the floors section's
             probe, else 4.23 TB/s).
  dflash2    (only when named) B=1, prompt 512: a DFlash2 draft (5 layers, block 8, conv 2 x 16,
             selector rank 256 / top-k 16, every layer sliding with window 2048, non-causal), the same
             without windows (conv + selector alone), against a DFlash-1 draft at block 8 and 16;
             then without its selector and without its convs (each one's share of the iteration).

How a loop iteration is timed: `generate` is one dispatch (prefill + while_loop), so the time of one
iteration is a difference: the same compiled program (same `capacity=`) runs max_new_tokens=N1 and
N2, and ms/iter = (median t2 - median t1) / (iters2 - iters1). Random weights make the draft accept
~nothing, so iterations ~ new tokens; iteration time does not depend on acceptance (fixed shapes).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

T0 = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python scripts/bench_gpu.py` from anywhere finds dflash_jax
ALL_SECTIONS = ("reference", "check", "floors", "b1", "gemms", "compile", "sampling", "profile", "batch", "longctx",
                "quant", "dflash2")
DEFAULT_SECTIONS = ("reference", "floors", "b1", "compile", "sampling", "profile", "batch", "longctx")
PAPER_TAU = {"GSM8K": 6.54, "HumanEval": 6.50, "MT-Bench": 4.24}
GOALS = {"plain_b1_ms": 3.9, "dflash_b1_ms": 5.0, "longctx_x_floor": 1.25, "sampling_overhead": 0.05,
         "speedup_vs_ref": 20.0,
         "quant_b1_ratio": 0.6, "quant_x_byte_floor": 1.3}   # issue 57: quantized / bf16 at B = 1; x floor
MASK_ID = 151669
# (name, sampling settings) of the sampling section: temperature alone ("sample" mode), Qwen3's
# recommended setting ("filtered": the top-k and the top-p threshold searches), top-p alone
# ("topp": the top-p search only) and top-k alone ("topk").
SAMPLING_VARIANTS = (("t1", dict(temperature=1.0, top_p=1.0, top_k=0)),
                     ("t06_p095_k20", dict(temperature=0.6, top_p=0.95, top_k=20)),
                     ("t1_p095", dict(temperature=1.0, top_p=0.95, top_k=0)),
                     ("t1_k20", dict(temperature=1.0, top_p=1.0, top_k=20)))


def long_impls() -> list:
    """The attention paths of the longctx section; BENCH_LONG_IMPLS=pallas times only our kernel
    (an A/B of a kernel setting, without the slow XLA row)."""
    return [x for x in os.environ.get("BENCH_LONG_IMPLS", "pallas,xla").split(",") if x]


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def short_err(e: BaseException, n: int = 400) -> str:
    s = f"{type(e).__name__}: {e}"
    s = s.replace("\n", " | ")
    return s if len(s) <= n else s[:n] + " ..."


def kernel_check(out: dict, name: str, run) -> None:
    """out[name] = the record of run() -> (record with "ok", detail text), logged as one
    "check: kernel NAME: ... -> OK|FAIL|ERROR" line (gpu_call.sh greps these); an exception becomes
    an "error" record."""
    try:
        rec, detail = run()
        out[name] = rec
        log(f"check: kernel {name}: {detail} -> {'OK' if rec['ok'] else 'FAIL'}")
    except Exception as ex:
        out[name] = {"error": short_err(ex)}
        log(f"check: kernel {name}: ERROR {short_err(ex)}")


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


def fmt(x, nd=2):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    return f"{x:.{nd}f}"


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------

class Settings:
    def __init__(self, smoke: bool, preset: str = "qwen3-8b"):
        self.smoke = smoke
        self.preset = preset
        if smoke:
            self.prompt = 32
            self.n1, self.n2 = 4, 12            # new tokens of the two timed runs (B=1 .. 64)
            self.reps = 2
            self.batches_dflash = (1, 2, 4)
            self.batches_plain = (1, 2, 4)
            self.long_prompt = 256
            self.long_n1, self.long_n2 = 4, 12
            self.block = 8
            self.copy_bytes = 1 << 24
            self.gemv_n = 1024
            self.gemm_n = 256
            self.ref_new = 8
            self.prof_n1, self.prof_n2 = 3, 7
            self.same_bucket_prompt, self.same_bucket_new = 30, 6
        else:
            self.prompt = 512
            self.n1, self.n2 = 64, 256
            self.reps = 3
            self.batches_dflash = (1, 8, 32, 64)
            self.batches_plain = (1, 8, 32, 64)
            self.long_prompt = 32768
            self.long_n1, self.long_n2 = 16, 112
            self.block = 16
            self.copy_bytes = 1 << 32           # 4 GiB (x + 1 on bf16: 4 GiB read + 4 GiB written)
            self.gemv_n = 16384                 # 512 MiB weight: far past the 50 MB L2
            self.gemm_n = 8192
            self.ref_new = 128
            self.prof_n1, self.prof_n2 = 8, 40
            self.same_bucket_prompt, self.same_bucket_new = 500, 100

    def target_config(self):
        import dataclasses
        from dflash_jax import TargetConfig
        if self.smoke:
            tiny = TargetConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=8,
                                num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6)
            real = TargetConfig.preset(self.preset)   # the preset's family and RoPE at tiny shapes
            if hasattr(real, "num_experts"):           # an MoE family: its own config class, 8 tiny experts
                return dataclasses.replace(real, **{f: getattr(tiny, f) for f in (
                    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim")}, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
            return dataclasses.replace(tiny, model_type=real.model_type, rope_scaling=real.rope_scaling,
                                       rms_norm_eps=real.rms_norm_eps, rope_theta=real.rope_theta)
        return TargetConfig.preset(self.preset)

    def draft_config(self, tcfg):
        from dflash_jax import DraftConfig
        if self.smoke:
            return DraftConfig.for_target(tcfg, num_layers=2, block_size=self.block,
                                          mask_token_id=tcfg.vocab_size - 1)
        if self.preset != "qwen3-8b":   # z-lab's shape for other targets: 5 layers, the default taps
            return DraftConfig.for_target(tcfg, num_layers=5, block_size=self.block)
        return DraftConfig.for_target(tcfg, num_layers=5, block_size=self.block, mask_token_id=MASK_ID,
                                      target_layer_ids=(1, 9, 17, 25, 33))


# ----------------------------------------------------------------------------------------------
# The reference (PyTorch), in a child process
# ----------------------------------------------------------------------------------------------

def reference_child(out_path: str, smoke: bool, n_new: int, prompt: int) -> None:
    """Times dflash 0.1.0's `dflash_generate` (random bf16 weights, same shapes), as the reference was
    timed for DESIGN's numbers: tokens per iteration from its acceptance lengths, CUDA-synchronised."""
    import torch
    import dflash.model as dm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    res = {"torch": torch.__version__}
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # the reference synchronises CUDA in its timer
        dm._cuda_time = time.perf_counter
    res["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    if smoke:
        common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=40960, tie_word_embeddings=False)
        n_target, n_draft, taps, mask, block = 8, 2, [1, 5], 1023, 8
    else:
        common = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                      max_position_embeddings=40960, tie_word_embeddings=False)
        n_target, n_draft, taps, mask, block = 36, 5, [1, 9, 17, 25, 33], MASK_ID, 16
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t = time.perf_counter()
    with torch.device(dev):
        target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=n_target, **common)).eval()
        dcfg = Qwen3Config(num_hidden_layers=n_draft, **common)
        dcfg.num_target_layers = n_target
        dcfg.block_size = block
        dcfg.dflash_config = {"mask_token_id": mask, "target_layer_ids": taps}
        draft = dm.DFlashDraftModel(dcfg).eval()
    res["init_s"] = time.perf_counter() - t
    res["target_params_B"] = sum(p.numel() for p in target.parameters()) / 1e9
    res["draft_params_B"] = sum(p.numel() for p in draft.parameters()) / 1e9
    ids = torch.randint(0, common["vocab_size"] - 2, (1, prompt), device=dev)
    for bs in (block, 1):
        dm.dflash_generate(draft, target, ids, 16, None, block_size=bs)  # warm-up
        r = dm.dflash_generate(draft, target, ids, n_new, None, block_size=bs, return_stats=True)
        iters = len(r.acceptance_lengths)
        decode_s = r.time_per_output_token * r.num_output_tokens  # prefill excluded by the reference
        res[f"block{bs}_ms_per_iter"] = 1000 * decode_s / iters
        res[f"block{bs}_mean_produced"] = sum(r.acceptance_lengths) / iters
        res[f"block{bs}_iters"] = iters
        res[f"block{bs}_ttft_ms"] = 1000 * r.time_to_first_token
        print(f"  reference block {bs}: {res[f'block{bs}_ms_per_iter']:.2f} ms/iter over {iters} iters, "
              f"mean produced {res[f'block{bs}_mean_produced']:.2f}", flush=True)
    res["block_size"] = block
    if cuda:
        res["max_mem_GB"] = torch.cuda.max_memory_allocated() / 1e9
    del target, draft
    if cuda:
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.s = Settings(args.smoke, args.preset)
        if args.batches:   # the batch section's sizes (B=1 is the b1 section's)
            self.s.batches_dflash = self.s.batches_plain = tuple(int(b) for b in args.batches.split(","))
        from dflash_jax import KernelConfig
        # the kernel settings of every program this run times (--no-fused-layer, ...): the compile key
        self.kernels = KernelConfig(fused_layer=args.fused_layer, sampling_kernels=args.sampling_kernels,
                                    attention_tuning=KernelConfig.parse_tuning(args.gpu_attn))
        self.out_dir = args.out
        self.R = {"settings": {k: v for k, v in vars(self.s).items()}, "sections": {}, "errors": {},
                  "skipped": [], "compile_s": {}, "curves": {}}
        self.budget = args.budget_s
        self.compile_est = 60.0 if not args.smoke else 10.0   # updated after the first compile
        self.models = None
        self.floor_params = None
        self.bw = None        # copy bandwidth (bytes/s) for floors
        self.gemm_rate = None  # FLOP/s
        if getattr(args, "floor_tbs", 0):   # a copy figure measured elsewhere in the call (env probe)
            self.bw = args.floor_tbs * 1e12
        # --quantize int8[,...]: the quantized copies of the target (built with the bf16 one) and the
        # parameter bytes of each as stored
        self.quant, self.quant_only = parse_quantize(getattr(args, "quantize", "") or "")
        self.qtargets, self.qfloor = {}, {}
        self.quant_batches = tuple(int(b) for b in (getattr(args, "quant_batches", "") or "1,8,32").split(",") if b)
        if args.smoke and not getattr(args, "quant_batches", ""):
            self.quant_batches = (1, 2)
        self.quant_kinds = parse_quant_kinds(getattr(args, "quant_kinds", "") or "plain,dflash")
        if getattr(args, "loop_n", ""):      # N1,N2 of every loop row (fewer tokens: a shorter call)
            self.s.n1, self.s.n2 = (int(x) for x in args.loop_n.split(","))
        if getattr(args, "reps", 0):
            self.s.reps = args.reps

    # -- bookkeeping --
    def elapsed(self):
        return time.perf_counter() - T0

    def fits(self, what: str, est_s: float) -> bool:
        left = self.budget - self.elapsed()
        if est_s > left:
            log(f"SKIP {what}: needs ~{est_s:.0f}s, {left:.0f}s of the budget left")
            self.R["skipped"].append(what)
            return False
        return True

    def save(self):
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        self.R["elapsed_s"] = self.elapsed()
        with open(os.path.join(self.out_dir, self.args.json), "w") as f:
            json.dump(self.R, f, indent=1, default=str)

    # -- models --
    def build(self):
        if self.models is not None:
            return self.models
        import jax
        from dflash_jax import init_target, init_draft
        s = self.s
        tcfg = s.target_config()
        dcfg = s.draft_config(tcfg)
        t = time.perf_counter()
        target = init_target(tcfg, seed=0, dtype="bfloat16")
        draft = init_draft(dcfg, seed=0, dtype="bfloat16")
        jax.block_until_ready(jax.tree.leaves(_params(target)) + jax.tree.leaves(_params(draft)))
        log(f"models built in {time.perf_counter() - t:.1f}s on {jax.devices()[0]}")
        self.models = (target, draft, tcfg, dcfg)
        self.floor_params = model_bytes(target, draft, tcfg, dcfg)
        self.R["model_bytes"] = self.floor_params
        fp = self.floor_params
        log(f"target {fp['target_total_GB']:.3f} GB (read per step {fp['target_read_GB']:.3f} GB, embedding "
            f"{fp['embed_GB']:.3f} GB, LM head {fp['lm_head_GB']:.3f} GB); draft {fp['draft_GB']:.3f} GB; "
            f"KV/token target {fp['kv_target_per_token']} B, draft {fp['kv_draft_per_token']} B")
        for q in self.quant:
            # the same random weights (same seed), the layers' linears quantized at build
            t = time.perf_counter()
            qt = quantized_target(init_target, tcfg, q)
            jax.block_until_ready(jax.tree.leaves(_params(qt)))
            self.qtargets[q] = qt
            self.qfloor[q] = qf = model_bytes(qt, draft, tcfg, dcfg)
            self.R.setdefault("model_bytes_quantized", {})[q] = qf
            log(f"target {q}: {qf['target_total_GB']:.3f} GB (read per step {qf['target_read_GB']:.3f} GB, "
                f"{qf['target_read'] / fp['target_read']:.3f}x bf16's), built in {time.perf_counter() - t:.1f}s")
        return self.models

    def target_for(self, kw: dict):
        """The target a row runs: kw["quant"] names a quantized copy (--quantize), else the bf16 one."""
        q = kw.get("quant")
        return self.qtargets[q] if q else self.models[0]

    def prompts(self, batch: int, length: int, seed: int = 0):
        import numpy as np
        tcfg = self.build()[2]
        rng = np.random.default_rng(seed)
        return rng.integers(0, min(tcfg.vocab_size - 2, 150000), size=(batch, length)).tolist()

    def capacity(self, prompt_len: int, n_new: int) -> int:
        # a multiple of 512 keeps every Pallas tiling happy; the same capacity for N1 and N2 runs
        return round_up(prompt_len + n_new + 2 * self.s.block + 8, 512)

    def with_kernels(self, kw: dict) -> dict:
        """kw with this run's KernelConfig (a row's attention_impl replaces its backend)."""
        import dataclasses
        kw = dict(kw)
        kw.pop("quant", None)   # picks the target (target_for), not a generate() option
        kw["kernels"] = dataclasses.replace(self.kernels, attention=kw.pop("attention_impl", self.kernels.attention),
                                            while_graphs=kw.pop("while_graphs", self.kernels.while_graphs))
        return kw

    def gen(self, draft, prompts, n_new, capacity, **kw):
        from dflash_jax import generate
        target = self.target_for(kw)
        kw = self.with_kernels(kw)
        kw.setdefault("temperature", 0.0)
        kw.setdefault("block_size", self.s.block if draft is not None else None)
        try:
            return generate(target, draft, prompts, max_new_tokens=n_new, capacity=capacity,
                            stop_token_ids=None, seed=0, **kw, verify_width="block")
        except TypeError as e:
            if "capacity" not in str(e):
                raise
            log("generate() takes no capacity=: timing without it (N1/N2 may compile apart)")
            return generate(target, draft, prompts, max_new_tokens=n_new, stop_token_ids=None, seed=0, **kw, verify_width="block")

    def time_loop(self, key: str, *, dflash: bool, batch: int, prompt_len: int, n1: int, n2: int,
                  reps: int | None = None, **kw) -> dict:
        """ms per loop iteration by the N1/N2 difference, on one compiled program."""
        target, draft, tcfg, dcfg = self.build()
        d = draft if dflash else None
        reps = reps or self.s.reps
        prompts = self.prompts(batch, prompt_len)
        cap = self.capacity(prompt_len, n2)
        t = time.perf_counter()
        r0 = self.gen(d, prompts, n1, cap, **kw)
        first_wall = time.perf_counter() - t
        comp = float(getattr(r0, "compile_time_s", float("nan")) or 0.0)
        pre = self.R.get("precompile_s", {}).get(key)
        if comp == 0.0 and pre:
            comp = pre  # compiled ahead (see precompile); generate found it cached
        self.R["compile_s"][key] = {"compile_time_s": comp, "first_call_wall_s": first_wall,
                                    "precompiled": pre is not None}
        if comp > 0 and pre is None:
            # (a precompiled program's time says nothing of what is left to compile: taken as the estimate,
            # it skips rows whose programs are compiled already)
            self.compile_est = max(self.compile_est * 0.5, comp * 1.1)
        t1, t2, i1, i2, taus = [], [], [], [], []
        for _ in range(reps):
            for n, ts, its in ((n1, t1, i1), (n2, t2, i2)):
                r = self.gen(d, prompts, n, cap, **kw)
                c = float(getattr(r, "compile_time_s", 0.0) or 0.0)
                if c > 0:
                    log(f"  note: {key} N={n} compiled again ({c:.1f}s): capacity not honoured?")
                ts.append(float(r.run_time_s))
                its.append(_iters(r))
                if n == n2:
                    taus.append(float(getattr(r, "mean_tau", float("nan"))))
        mt1, mt2, mi1, mi2 = median(t1), median(t2), median(i1), median(i2)
        ms = 1000 * (mt2 - mt1) / (mi2 - mi1) if mi2 > mi1 else float("nan")
        timing = "difference"
        if mi2 > mi1 and mt2 <= mt1:
            # the longer run was not slower: the host's noise is above the work (a loaded CPU, a smoke's
            # few iterations). The long run whole over its iterations, its call's cost included: an upper bound
            ms, timing = 1000 * mt2 / mi2, "whole-call"
        out = dict(batch=batch, prompt=prompt_len, capacity=cap, n1=n1, n2=n2, t1_s=t1, t2_s=t2, timing=timing,
                   iters1=i1, iters2=i2, ms_per_iter=ms, compile_time_s=comp, first_call_wall_s=first_wall,
                   prefill_est_ms=1000 * mt1 - ms * mi1 if ms == ms else float("nan"),
                   mean_tau=median(taus), ctx_mean=prompt_len + (n1 + n2) / 2, **{k: v for k, v in kw.items()})
        log(f"  {key}: {fmt(ms, 3)} ms/iter{' (whole call: the N2 run was not slower)' if timing != 'difference' else ''} "
            f"(iters {mi1:.0f}->{mi2:.0f}, t {mt1:.3f}->{mt2:.3f}s, "
            f"compile {comp:.1f}s, tau {out['mean_tau']:.2f}, prefill~{fmt(out['prefill_est_ms'], 1)} ms)")
        return out

    def loop_cost_est(self, batch, prompt_len, n1, n2, ms_guess):
        runs = (1 + 2 * self.s.reps) * 0.5 * (n1 + n2) * ms_guess / 1000
        return self.compile_est + runs + 5

    # -- sections --
    def start_reference(self):
        """Start the PyTorch reference in a child process (it runs while this process compiles)."""
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [sys.executable, os.path.abspath(__file__), "--_reference-child", path,
               "--_ref-new", str(self.s.ref_new), "--_ref-prompt", str(self.s.prompt)]
        if self.s.smoke:
            cmd.append("--smoke")
        log("reference: starting " + " ".join(cmd[1:]))
        errf = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=errf, text=True)
        self.ref_proc = proc
        return (proc, path, errf, time.perf_counter())

    def finish_reference(self, handle):
        proc, path, errf, t0 = handle
        timeout = max(30.0, min(300.0, self.budget - self.elapsed() - 60))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"reference child killed after {time.perf_counter() - t0:.0f}s (timeout)")
        if rc != 0:
            errf.seek(0)
            raise RuntimeError(f"reference child rc={rc}: {errf.read()[-1500:]}")
        with open(path) as f:
            ref = json.load(f)
        os.unlink(path)
        ref["wall_s"] = time.perf_counter() - t0
        self.R["sections"]["reference"] = ref
        blk = ref["block_size"]
        log(f"reference: block {blk} {ref['block%d_ms_per_iter' % blk]:.2f} ms/iter, "
            f"block 1 {ref['block1_ms_per_iter']:.2f} ms/iter ({ref['wall_s']:.0f}s)")

    # -- compile ahead, in threads (XLA compiles release the GIL; the device is idle meanwhile) --
    def planned(self, sections) -> list:
        """(key, dflash, batch, prompt_len, n2, kw) of every timed program, in run order."""
        s = self.s
        plan = []
        if "b1" in sections or "compile" in sections or "profile" in sections:
            plan += [("dflash_b1", True, 1, s.prompt, s.n2, {}), ("plain_b1", False, 1, s.prompt, s.n2, {})]
        if "sampling" in sections:
            plan += [(f"dflash_b1_{name}", True, 1, s.prompt, s.n2, kw) for name, kw in SAMPLING_VARIANTS]
        if "batch" in sections:
            for kind, b in self.batch_order():
                plan.append((f"{kind}_b{b}", kind == "dflash", b, s.prompt, s.n2, {}))
        if "longctx" in sections:
            for impl in long_impls():
                plan.append((f"dflash_long_{impl}", True, 1, s.long_prompt, s.long_n2, dict(attention_impl=impl)))
        if "quant" in sections:
            for key, dflash, b, q in self.quant_order():
                plan.append((key, dflash, b, s.prompt, s.n2, dict(quant=q) if q else {}))
        seen, out = set(), []
        for item in plan:          # a key planned twice (b1 and quant share the bf16 rows) compiles once
            if item[0] not in seen:
                seen.add(item[0])
                out.append(item)
        return out

    def _generate_args(self, dflash, batch, prompt_len, n2, kw):
        target, draft = self.target_for(kw), self.models[1]
        return (target, draft if dflash else None, self.prompts(batch, prompt_len)), dict(
            max_new_tokens=n2, block_size=self.s.block if dflash else None, seed=0,
            capacity=self.capacity(prompt_len, n2), **self.with_kernels(kw))

    def precompile(self, sections, workers: int):
        """Compile every planned program into the library's cache before timing anything.

        The first (DFlash B=1) alone, so its compile time is clean; the rest in a thread pool."""
        import concurrent.futures as cf
        import jax
        from dflash_jax import decode
        self.build()
        plan = self.planned(sections)
        if not plan:
            return

        def one(item):
            key, dfl, b, pl, n2, kw = item
            args, kwargs = self._generate_args(dfl, b, pl, n2, kw)
            return key, decode.precompile(*args, **kwargs, verify_width="block")

        res = {}
        t0 = time.perf_counter()
        first, rest = plan[0], plan[1:]
        try:
            k, dt = one(first)
            res[k] = dt
            self.compile_est = dt
            log(f"precompile: {k} {dt:.1f}s (alone)")
        except Exception as e:
            self.err(f"precompile_{first[0]}", e)
        with cf.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
            futs = {ex.submit(one, it): it[0] for it in rest}
            for f in cf.as_completed(futs):
                try:
                    k, dt = f.result()
                    res[k] = dt
                    log(f"precompile: {k} {dt:.1f}s ({workers} in parallel)")
                except Exception as e:
                    self.err(f"precompile_{futs[f]}", e)
        self.R["precompile_s"] = res
        self.R["precompile_wall_s"] = time.perf_counter() - t0
        self.compile_est = 1.0   # what is left to compile was either done or failed
        log(f"precompile: {len(res)} programs in {time.perf_counter() - t0:.1f}s")

    def sec_check(self):
        """Correctness on this device, tiny float32 models: Pallas vs XLA attention give the same greedy
        tokens, and DFlash greedy equals plain greedy (lossless), over a ragged batch of 2."""
        import jax
        from dflash_jax import DraftConfig, TargetConfig, generate, init_draft, init_target
        tcfg = TargetConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=128, rope_theta=1e6)
        dcfg = DraftConfig.for_target(tcfg, num_layers=2, block_size=16, mask_token_id=2047)
        target = init_target(tcfg, seed=1, dtype="float32")
        draft = init_draft(dcfg, seed=2, dtype="float32")
        import numpy as np
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, 2000, 100).tolist(), rng.integers(0, 2000, 37).tolist()]
        n = 48 if not self.s.smoke else 12
        outs = {}
        impls = ("xla", "pallas") if jax.default_backend() != "cpu" else ("xla",)
        for impl in impls:
            for name, d in (("plain", None), ("dflash", draft)):
                r = generate(target, d, prompts, max_new_tokens=n, capacity=1024,
                             **self.with_kernels(dict(attention_impl=impl)), verify_width="block")
                outs[(name, impl)] = r.tokens
        res = {}

        def cmp(a, b):
            ta, tb = outs[a], outs[b]
            rows = []
            for x, y in zip(ta, tb):
                m = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                rows.append({"match_prefix": m, "len": [len(x), len(y)], "equal": x == y})
            return rows

        pairs = [(("dflash", i), ("plain", i)) for i in impls]
        if len(impls) == 2:
            pairs += [(("plain", "pallas"), ("plain", "xla")), (("dflash", "pallas"), ("dflash", "xla"))]
        ok = True
        for a, b in pairs:
            rows = cmp(a, b)
            key = f"{a[0]}_{a[1]}_vs_{b[0]}_{b[1]}"
            res[key] = rows
            eq = all(r["equal"] for r in rows)
            ok &= eq
            log(f"check: {key}: {'SAME tokens' if eq else 'DIFFERENT'} "
                + ", ".join(f"row {i}: {r['match_prefix']}/{r['len'][0]}" for i, r in enumerate(rows)))
        res["all_equal"] = ok
        if jax.default_backend() != "cpu":
            res["fused"] = self.check_fused()
            res["kernels"] = self.check_kernels()
        self.R["sections"]["check"] = res

    def check_kernels(self):
        """The GPU attention paths against the XLA reference at Qwen3-8B heads: plain decode (T=1,
        masked 16-row tiles), verify/draft (T=16) with and without KV splits, f32, and the cuDNN
        prefill route (attend_prefill). Max error relative to the output's max |value|."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from dflash_jax import attention
        from dflash_jax.kernel_config import resolved
        Hq, Hkv, D = 32, 8, 128
        out = {}
        cases = [("decode C1024", 2, 1, 1024, jnp.bfloat16), ("decode C32768 split", 1, 1, 32768, jnp.bfloat16),
                 ("verify C1024", 1, 16, 1024, jnp.bfloat16), ("verify C32768 split", 1, 16, 32768, jnp.bfloat16),
                 ("verify B4 C8192 f32", 4, 16, 8192, jnp.float32), ("prefill T512", 1, 512, 1024, jnp.bfloat16),
                 ("prefill T4096 cudnn", 1, 4096, 4096, jnp.bfloat16)]
        def run(name, B, T, C, dt):
                ks = jax.random.split(jax.random.key(len(name)), 3)
                q = jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32).astype(dt)
                kc = jax.random.normal(ks[1], (B, Hkv, C, D), jnp.float32).astype(dt)
                vc = jax.random.normal(ks[2], (B, Hkv, C, D), jnp.float32).astype(dt)
                if name.startswith("prefill"):
                    e = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 1, (B, T))
                    kn = kc[:, :, :T].transpose(0, 2, 1, 3)
                    vn = vc[:, :, :T].transpose(0, 2, 1, 3)
                    f = jax.jit(lambda q, kn, vn, kc, vc, e: attention.attend_prefill(q, kn, vn, kc, vc, e, resolved("pallas")))
                    args = (q, kn, vn, kc, vc, e)
                    hlo = f.lower(*args).compile().as_text()
                    route = "cudnn" if "cudnn" in hlo else "pallas"
                else:
                    lens = C // 2 + 17 + np.arange(B)
                    e = jnp.asarray(lens[:, None] + np.arange(T)[None] + 1, jnp.int32)
                    f = jax.jit(lambda q, kc, vc, e: attention.attend(q, kc, vc, e, resolved("pallas")))
                    args = (q, kc, vc, e)
                    route = "pallas"
                got = np.asarray(f(*args).astype(jnp.float32))
                with jax.default_matmul_precision("highest"):  # XLA:GPU's f32 default is TF32
                    ref = np.asarray(attention.attend(q.astype(jnp.float32), kc.astype(jnp.float32),
                                                      vc.astype(jnp.float32), e, resolved("xla")))
                rel = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))
                tol = 1e-4 if dt == jnp.float32 else 2e-2
                rec = {"rel_err": rel, "ok": bool(rel <= tol and np.isfinite(got).all()), "route": route}
                return rec, f"rel err {rel:.2e} via {route}"
        for case in cases:
            kernel_check(out, case[0], lambda: run(*case))
        return out

    def check_fused(self):
        """The fused GPU kernels (prologue, add + RMSNorm) against the layer's XLA ops."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        out = {}
        out.update(self.check_prologue())

        def run():
            from pallas_kernels import fused_layer as gpu
            from dflash_jax.models.layers import RMSNorm
            norm = RMSNorm(4096, 1e-6, jnp.bfloat16)
            norm.weight[...] = jnp.linspace(0.5, 1.5, 4096).astype(jnp.bfloat16)
            kx, ky = jax.random.split(jax.random.key(9))
            x = (jax.random.normal(kx, (2, 16, 4096)) * 4).astype(jnp.bfloat16)
            y = jax.random.normal(ky, (2, 16, 4096)).astype(jnp.bfloat16)
            s_, n_ = jax.jit(lambda x, y: gpu.add_rmsnorm(x, y, norm.weight[...], norm.eps))(x, y)
            ws, wn = jax.jit(lambda x, y: (x + y, norm(x + y)))(x, y)
            f = lambda a: np.asarray(a.astype(jnp.float32))
            errs = [float(np.abs(f(a) - f(b)).max() / max(np.abs(f(b)).max(), 1e-6)) for a, b in ((s_, ws), (n_, wn))]
            rec = {"rel_err": max(errs), "ok": all(e <= 1e-2 for e in errs), "route": "pallas"}
            return rec, f"rel err sum {errs[0]:.2e} norm {errs[1]:.2e}"
        kernel_check(out, "add_rmsnorm B2 T16", run)

        out.update(self.check_sampling_kernel())
        return out

    def check_sampling_kernel(self):
        """The threshold search with its count kernel against XLA's search (top-k 20's key on
        16 x 151,936 logits), and the support of top-k 20 + top-p 0.95 through both paths."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from dflash_jax import KernelConfig, sampling
        out = {}
        gpu_kernels = KernelConfig(attention="pallas_gpu").resolve()

        def run():
            logits = jax.random.normal(jax.random.key(11), (16, 151936), jnp.float32) * 4
            keys = sampling._score_key(logits)
            zero = jnp.zeros((16,), jnp.float32)
            k20 = jnp.full((16,), 20.0, jnp.float32)
            # top-k 20's score threshold: counts are exact on both paths, so the keys must be equal
            got = jax.jit(lambda k: sampling._kernel_min_passing(k, None, zero, k20, 32, gpu_kernels))(keys)
            want = jax.jit(lambda k: sampling._min_passing(
                lambda c: sampling._masked_sums(k, c, None) < k20[:, None], 16, 32))(keys)
            same_key = bool(np.array_equal(np.asarray(got), np.asarray(want)))
            # supports through the GPU path (gathered top-k candidates, fallback to the full
            # searches past GATHER_MAX) and XLA's full searches: top-k + top-p, top-k alone, a tie
            # of 30 at the top across the top-k cut, top-k 300 (the fallback), top-p alone
            tied = logits.at[:, :30].set(jnp.max(logits, axis=1, keepdims=True))
            supports = {}
            for name, x, (t, k, p) in (("t06_p095_k20", logits, (0.6, 20, 0.95)), ("k20", logits, (1.0, 20, 1.0)),
                                       ("tie_k20_p09", tied, (1.0, 20, 0.9)), ("k300_p095", logits, (1.0, 300, 0.95)),
                                       ("p095", logits, (1.0, 0, 0.95))):
                mode = sampling.mode_for(t, p, k)
                lp = [np.asarray(jax.jit(lambda x, kc=kc: sampling.log_probs(
                          x, t, k, p, mode, kc))(x)) for kc in (gpu_kernels, None)]
                supports[name] = bool(np.array_equal(np.isfinite(lp[0]), np.isfinite(lp[1])))
            same_support = all(supports.values())
            rec = {"same_topk_key": same_key, "same_support": same_support, "supports": supports,
                   "ok": same_key and same_support}
            return rec, (f"top-k key {'same' if same_key else 'DIFFERENT'}, supports (top-k/top-p, top-k, tie, "
                         f"top-k 300 fallback, top-p) {'same' if same_support else 'DIFFERENT: ' + str(supports)}")
        kernel_check(out, "sampling_count", run)
        return out

    def check_prologue(self):
        """The fused q/k norm + RoPE + cache-write kernel against the layer's XLA ops (8B heads)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from flax import nnx
        from dflash_jax.cache import write_rows
        from dflash_jax.config import TargetConfig
        from dflash_jax.models.layers import DecoderLayer, rope, rope_tables
        from pallas_kernels import fused_layer as gpu
        Hq, Hkv, D, C = 32, 8, 128, 2048
        cfg = TargetConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=1, num_heads=Hq,
                           num_kv_heads=Hkv, head_dim=D)
        layer = DecoderLayer(cfg, jnp.bfloat16, nnx.Rngs(0))
        layer.q_norm.weight[...] = jnp.linspace(0.5, 1.5, D).astype(jnp.bfloat16)
        layer.k_norm.weight[...] = jnp.linspace(1.5, 0.5, D).astype(jnp.bfloat16)
        out = {}
        def run(B, T, Tc=0):
                # Tc > 0: the draft's form, Tc context rows first, written at ctx_start (5 rows
                # before the block, so the block's rows must win the overlap) then the block's
                ks = jax.random.split(jax.random.key(T + Tc), 3)
                qkv = (jax.random.normal(ks[0], (B, Tc + T, (Hq + 2 * Hkv) * D)) * 3).astype(jnp.bfloat16)
                kc = jax.random.normal(ks[1], (B, Hkv, C, D)).astype(jnp.bfloat16)
                vc = jax.random.normal(ks[2], (B, Hkv, C, D)).astype(jnp.bfloat16)
                start = jnp.asarray((np.arange(B) * 37 + 500) % (C - T), jnp.int32)
                ctx_start = start - 5
                pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)
                all_pos = jnp.concatenate([ctx_start[:, None] + jnp.arange(Tc, dtype=jnp.int32), pos], axis=1)

                def xla(qkv, kc, vc):
                    q, k, v = layer._split_heads(qkv)
                    k = rope(layer.k_norm(k), all_pos, layer.rope_theta)
                    if Tc:
                        kc, vc = write_rows(kc, k[:, :Tc], ctx_start), write_rows(vc, v[:, :Tc], ctx_start)
                    return (rope(layer.q_norm(q[:, Tc:]), pos, layer.rope_theta),
                            write_rows(kc, k[:, Tc:], start), write_rows(vc, v[:, Tc:], start))

                def fused(qkv, kc, vc):
                    cos, sin = rope_tables(all_pos, D, layer.rope_theta)
                    return gpu.qk_norm_rope_write(qkv, cos, sin, layer.q_norm.weight[...], layer.k_norm.weight[...],
                                                  layer.q_norm.eps, kc, vc, start, num_heads=Hq,
                                                  ctx_rows=Tc, ctx_start=ctx_start if Tc else None)
                want = [np.asarray(a.astype(jnp.float32)) for a in jax.jit(xla)(qkv, kc, vc)]
                got = [np.asarray(a.astype(jnp.float32)) for a in jax.jit(fused)(qkv, kc, vc)]
                errs = [float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-6)) for g, w in zip(got, want)]
                rec = {"rel_err": max(errs), "ok": all(e <= 1e-2 for e in errs), "route": "pallas"}
                return rec, f"rel err q {errs[0]:.2e} k {errs[1]:.2e} v {errs[2]:.2e}"
        for B, T, Tc in ((1, 1, 0), (1, 16, 0), (4, 16, 0), (2, 16, 16)):
            kernel_check(out, f"prologue B{B} T{T}" + (f" ctx{Tc}" if Tc else ""), lambda: run(B, T, Tc))
        return out

    def sec_floors(self):
        import jax
        import jax.numpy as jnp
        s = self.s
        res = {"devices": str(jax.devices()), "backend": jax.default_backend()}
        # copy: one dispatch a pass (no loop for XLA to fuse), every byte read and written once
        probe = copy_probe(s.copy_bytes)
        res["copy_probe"] = probe
        res["copy_TBps"] = probe["copy_TBps"]
        log(f"floors: copy {res['copy_TBps']:.3f} TB/s ({probe['copy_from']}; "
            + ", ".join(f"{k} {v:.3f}" for k, v in probe["TBps"].items()) + ")")
        # GEMV: a bf16 weight read once per product
        k = s.gemv_n
        W = jax.random.normal(jax.random.key(0), (k, k), jnp.bfloat16)
        for b in (1, 16, 64):
            v = jax.random.normal(jax.random.key(b), (b, k), jnp.bfloat16)
            g = jax.jit(lambda v, W: v @ W)
            dt = _bench(lambda: g(v, W), inner=20)
            res[f"gemv_b{b}_TBps"] = W.nbytes / dt / 1e12
        del W
        log("floors: GEMV " + ", ".join(f"B={b} {res[f'gemv_b{b}_TBps']:.3f} TB/s" for b in (1, 16, 64)))
        m = s.gemm_n
        A = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
        Bm = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
        g = jax.jit(lambda a, b: a @ b)
        dt = _bench(lambda: g(A, Bm), inner=10)
        res["gemm_TFLOPs"] = 2 * m**3 / dt / 1e12
        del A, Bm
        log(f"floors: GEMM {m}^3 bf16 {res['gemm_TFLOPs']:.1f} TFLOP/s")
        if not self.args.floor_tbs:    # a --floor-tbs figure (the call's env probe) stays the floors'
            self.bw = res["copy_TBps"] * 1e12
        self.gemm_rate = res["gemm_TFLOPs"] * 1e12
        self.R["sections"]["floors"] = res
        self.save()
        self.build()
        fp = self.floor_params
        res["plain_floor_ms_b1_short"] = 1000 * self.floor(False, 1, s.prompt + (s.n1 + s.n2) / 2)["floor_s"]
        res["dflash_floor_ms_b1_short"] = 1000 * self.floor(True, 1, s.prompt + (s.n1 + s.n2) / 2)["floor_s"]
        res["dflash_floor_ms_b1_long"] = 1000 * self.floor(True, 1, s.long_prompt + (s.long_n1 + s.long_n2) / 2)["floor_s"]
        log(f"floors: plain step {res['plain_floor_ms_b1_short']:.3f} ms, DFlash iteration "
            f"{res['dflash_floor_ms_b1_short']:.3f} ms (B=1, prompt {s.prompt}); DFlash at {s.long_prompt}: "
            f"{res['dflash_floor_ms_b1_long']:.3f} ms")

    def ensure_rates(self):
        if self.bw is None or self.gemm_rate is None:
            # no floors section: the H200's copy and GEMM rates from an earlier floors run (a copy
            # figure given with --floor-tbs stays)
            self.bw = self.bw or (4.23e12 if not self.s.smoke else 20e9)
            self.gemm_rate = 780e12 if not self.s.smoke else 50e9
            self.R.setdefault("assumed_rates", {"copy_Bps": self.bw, "gemm_FLOPs": self.gemm_rate,
                                                "copy_from": "--floor-tbs" if self.args.floor_tbs else "assumed"})
        self.build()

    def floor(self, dflash: bool, batch: int, ctx: float, quant: str | None = None) -> dict:
        """Bytes and FLOP floors of one plain step / one DFlash iteration at mean context `ctx` (quant:
        the quantized target's bytes as stored, --quantize)."""
        self.ensure_rates()
        fp = self.qfloor[quant] if quant else self.floor_params
        tcfg, dcfg = self.models[2], self.models[3]
        S = self.s.block
        L, Ld, Hq, D = tcfg.num_layers, dcfg.num_layers, tcfg.num_heads, tcfg.head_dim
        if dflash:
            byts = (fp["target_read"] + fp["draft"] + fp["lm_head"]
                    + batch * (ctx + S) * (fp["kv_target_per_token"] + fp["kv_draft_per_token"]))
            tok = batch * S
            flops = (2 * tok * (fp["target_read_params"] + fp["draft_params"]) + 2 * batch * (S - 1) * fp["lm_head_params"]
                     + 4 * tok * (ctx + S) * (L + Ld) * Hq * D)
        else:
            byts = fp["target_read"] + batch * ctx * fp["kv_target_per_token"]
            flops = 2 * batch * fp["target_read_params"] + 4 * batch * ctx * L * Hq * D
        tb, tf = byts / self.bw, flops / self.gemm_rate
        return {"bytes": byts, "flops": flops, "bytes_s": tb, "flops_s": tf, "floor_s": max(tb, tf),
                "bound": "bytes" if tb >= tf else "flops"}

    def record_loop(self, key, r, dflash):
        fl = self.floor(dflash, r["batch"], r["ctx_mean"], r.get("quant"))
        r["floor_ms"] = 1000 * fl["floor_s"]
        r["floor_bound"] = fl["bound"]
        r["bytes_floor_ms"] = 1000 * fl["bytes_s"]
        r["flops_floor_ms"] = 1000 * fl["flops_s"]
        r["x_floor"] = r["ms_per_iter"] / r["floor_ms"]
        self.R["curves"][key] = r

    def timed_row(self, key: str, dflash: bool, batch: int, guess_ms: float):
        """Time one prompt-512 loop (if the budget allows), record it against its floor, save."""
        s = self.s
        self.time_and_record(key, self.loop_cost_est(batch, s.prompt, s.n1, s.n2, guess_ms),
                             "{bound}-bound", dflash=dflash, batch=batch, prompt_len=s.prompt, n1=s.n1, n2=s.n2)

    def time_and_record(self, key: str, est_s: float, note: str, *, dflash: bool, **loop_kw):
        """If est_s fits the budget: time_loop(key, ...), record it, log it against its floor with
        `note` ({bound}: the floor's bound), save. A failure is recorded as an error."""
        if not self.fits(key, est_s):
            return
        try:
            r = self.time_loop(key, dflash=dflash, **loop_kw)
            self.record_loop(key, r, dflash)
            log(f"  {key}: {r['ms_per_iter']:.3f} ms vs floor {r['floor_ms']:.3f} ms ({r['x_floor']:.2f}x, "
                f"{note.format(bound=r['floor_bound'])})")
        except Exception as e:
            self.err(key, e)
        self.save()

    def sec_dflash2(self):
        import dataclasses
        from dflash_jax import init_draft
        target, v1, tcfg, dcfg = self.build()
        s = self.s
        L = dcfg.num_layers
        rank, window = (16, 16) if s.smoke else (256, 2048)
        d2 = dict(architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16, selector_rank=rank,
                  selector_top_k=16)
        variants = {   # the share's two rows first, then its split, then the windowed and block-16 rows
            "dflash2_b8_nowindow": dataclasses.replace(dcfg, block_size=8, **d2),
            "v1_b8": dataclasses.replace(dcfg, block_size=8),
            # the share split: DFlash2 without its selector (argmax drafts), without its convs
            "dflash2_b8_noselector": dataclasses.replace(dcfg, block_size=8, **dict(d2, selector_top_k=0)),
            "dflash2_b8_noconv": dataclasses.replace(dcfg, block_size=8, **dict(d2, conv_kernel_size=0)),
            "dflash2_b8": dataclasses.replace(dcfg, block_size=8, layer_types=("sliding_attention",) * L,
                                              sliding_window=window, is_causal=False, **d2),
            "v1_b16": dataclasses.replace(dcfg, block_size=16),
        }
        res = {}
        saved = self.models
        try:
            for name, cfg in variants.items():
                key = f"dflash2:{name}"
                if not self.fits(key, self.loop_cost_est(1, s.prompt, s.n1, s.n2, 6.0)):
                    continue
                try:
                    draft = init_draft(cfg, seed=0, dtype="bfloat16")
                    self.models = (target, draft, tcfg, cfg)
                    r = self.time_loop(key, dflash=True, batch=1, prompt_len=s.prompt, n1=s.n1, n2=s.n2,
                                       block_size=cfg.block_size)
                    res[name] = r["ms_per_iter"]
                except Exception as e:
                    self.err(key, e)
                finally:
                    self.models = saved
        finally:
            self.models = saved
        if "dflash2_b8" in res and "v1_b8" in res:
            res["dflash2_over_v1_b8"] = res["dflash2_b8"] / res["v1_b8"]
        if "dflash2_b8_nowindow" in res and "v1_b8" in res:
            res["conv_selector_share"] = 1 - res["v1_b8"] / res["dflash2_b8_nowindow"]
            for part, without in (("selector", "noselector"), ("conv", "noconv")):
                if f"dflash2_b8_{without}" in res:
                    res[f"{part}_share"] = 1 - res[f"dflash2_b8_{without}"] / res["dflash2_b8_nowindow"]
        log(f"  dflash2 section (ms/iter): {res}")
        self.R["sections"]["dflash2"] = res
        self.save()

    def sec_b1(self):
        self.timed_row("dflash_b1", True, 1, 5.0)
        self.timed_row("plain_b1", False, 1, 4.0)

    def sec_gemms(self):
        """The matmuls of a plain step and of a DFlash iteration alone, on the built models' own weight
        buffers, in a while_loop: what XLA's GEMM chain costs before any attention, norm, RoPE, cache
        write or sampling; the b1 rows' goals are measured against it in the same run.

        "bare": each product feeds the next (a slice where the widths differ), the LM head's argmax
        picks the next embeddings. "glue": plus the residual adds and the SwiGLU, the least elementwise
        work a Qwen3 layer needs (a synthetic decode step). DFlash: the target over the
        block's rows and its LM head, the draft's fc over the five taps, five draft layers (q/k/v
        over context + block rows in one product, as the fused path runs it), the draft's LM head over
        S - 1 rows."""
        import functools

        import jax
        import jax.numpy as jnp
        from jax import lax
        target, draft, tcfg, dcfg = self.build()
        s = self.s
        I, QD = tcfg.intermediate_size, tcfg.num_heads * tcfg.head_dim
        lw = lambda l: (l.qkv[...], l.o[...], l.mlp.gate_up[...], l.mlp.down[...])
        W = dict(t=[lw(l) for l in target.layers], d=[lw(l) for l in draft.layers], fc=draft.fc[...],
                 embed=target.embed[...],
                 head=target.lm_head[...] if target.lm_head is not None else target.embed[...].T)
        taps = tuple(dcfg.target_layer_ids)

        def layer(x, w, glue, ctx=None):
            qkv, o, gu, dn = w
            h = (x if ctx is None else jnp.concatenate([ctx, x], axis=0)) @ qkv
            y = h[-x.shape[0]:, :QD] @ o
            x = x + y if glue else y
            g = x @ gu
            m = jax.nn.silu(g[:, :I]) * g[:, I:] if glue else g[:, :I]
            y = m @ dn
            return x + y if glue else y

        def make(rows, dflash, glue):
            def body(W, _, x):                                # x [rows, H] bf16; W as an argument, not
                tapped = []                                   # closed over (16 GB of constants)
                for i, w in enumerate(W["t"]):
                    x = layer(x, w, glue)
                    if i in taps:
                        tapped.append(x)
                tok = jnp.argmax(jnp.dot(x, W["head"], preferred_element_type=jnp.float32), axis=-1)
                if dflash:
                    ctx = jnp.concatenate(tapped, axis=-1) @ W["fc"]
                    d = jnp.take(W["embed"], tok, axis=0)
                    for w in W["d"]:
                        d = layer(d, w, glue, ctx=ctx)
                    dtok = jnp.argmax(jnp.dot(d[1:], W["head"], preferred_element_type=jnp.float32), axis=-1)
                    tok = jnp.concatenate([tok[:1], dtok])
                return jnp.take(W["embed"], tok, axis=0)
            return jax.jit(lambda x, n, W: lax.fori_loop(0, n, functools.partial(body, W), x))

        n1, n2 = (4, 12) if s.smoke else (10, 50)
        res = {}
        for dflash, rows in ((False, 1), (True, s.block)):
            for glue in (False, True):
                key = f"{'dflash' if dflash else 'plain'}_{'glue' if glue else 'bare'}"
                if not self.fits(f"gemms {key}", 30 if not s.smoke else 5):
                    continue
                try:
                    f = make(rows, dflash, glue)
                    x = jnp.take(W["embed"], jnp.arange(rows) % 1000, axis=0)
                    t = time.perf_counter()
                    jax.block_until_ready(f(x, 1, W))
                    comp = time.perf_counter() - t
                    t1, t2 = [], []
                    for _ in range(5):
                        for n, ts in ((n1, t1), (n2, t2)):
                            t = time.perf_counter()
                            jax.block_until_ready(f(x, n, W))
                            ts.append(time.perf_counter() - t)
                    ms = 1000 * (median(t2) - median(t1)) / (n2 - n1)
                    res[key] = ms
                    log(f"  gemms {key}: {ms:.3f} ms/iter ({rows} rows, compile {comp:.1f}s)")
                except Exception as e:
                    self.err(f"gemms {key}", e)
        self.R["sections"]["gemms"] = res

    def sec_compile(self):
        """Compile of the whole loop, and no compile for a call in the same bucket."""
        s = self.s
        target, draft, tcfg, dcfg = self.build()
        res = {"first_compile_s": dict(self.R["compile_s"])}
        for key, dfl in (("dflash", True), ("plain", False)):
            d = draft if dfl else None
            cap = self.capacity(s.prompt, s.n2)
            if f"{key}_b1" not in self.R["compile_s"]:  # b1 did not run: compile here
                r = self.gen(d, self.prompts(1, s.prompt), s.n1, cap)
                res[f"{key}_compile_s"] = float(r.compile_time_s)
            else:
                res[f"{key}_compile_s"] = self.R["compile_s"][f"{key}_b1"]["compile_time_s"]
            events = []
            try:
                import jax
                jax.monitoring.register_event_duration_secs_listener(
                    lambda ev, dur, **kw: events.append(ev) if ev == "/jax/core/compile/backend_compile_duration" else None)
            except Exception:
                pass
            t = time.perf_counter()
            r = self.gen(d, self.prompts(1, s.same_bucket_prompt, seed=1), s.same_bucket_new, cap)
            res[f"{key}_backend_compiles_in_same_bucket_call"] = len(events)
            events.append("sentinel")  # the listener stays registered: later compiles no longer count here
            res[f"{key}_same_bucket_call"] = {"prompt": s.same_bucket_prompt, "max_new_tokens": s.same_bucket_new,
                                              "compile_time_s": float(r.compile_time_s),
                                              "wall_s": time.perf_counter() - t, "run_s": float(r.run_time_s),
                                              "tokens": len(r.tokens[0])}
            ok = float(r.compile_time_s) == 0.0 and res[f"{key}_backend_compiles_in_same_bucket_call"] == 0
            res[f"{key}_no_recompile"] = ok
            log(f"compile: {key} whole generation {res[f'{key}_compile_s']:.1f}s; same-bucket call "
                f"(prompt {s.same_bucket_prompt}, {s.same_bucket_new} new) compile_time_s="
                f"{float(r.compile_time_s):.3f} -> {'OK' if ok else 'RECOMPILED'}")
        self.R["sections"]["compile"] = res

    def sec_sampling(self):
        import jax
        s = self.s
        base = self.R["curves"].get("dflash_b1")
        res = {}
        if jax.default_backend() != "cpu":   # the search kernel on this device, before timing it
            res["check"] = self.check_sampling_kernel()
        variants = [("greedy", dict(temperature=0.0))] if base is None else []
        variants += list(SAMPLING_VARIANTS)
        for name, kw in variants:
            key = f"dflash_b1_{name}"
            if not self.fits(key, self.loop_cost_est(1, s.prompt, s.n1, s.n2, 5.0)):
                continue
            try:
                r = self.time_loop(key, dflash=True, batch=1, prompt_len=s.prompt, n1=s.n1, n2=s.n2, **kw)
                self.record_loop(key, r, True)
                res[name] = r
                if name == "greedy":
                    base = r
            except Exception as e:
                self.err(key, e)
        if base is not None:
            for name, _ in SAMPLING_VARIANTS:
                if name in res:
                    res[f"{name}_overhead"] = res[name]["ms_per_iter"] / base["ms_per_iter"] - 1
                    log(f"sampling: {name} {res[name]['ms_per_iter']:.3f} ms vs greedy {base['ms_per_iter']:.3f} ms "
                        f"-> {100 * res[f'{name}_overhead']:+.1f}% (goal <= +{100 * GOALS['sampling_overhead']:.0f}%)")
        self.R["sections"]["sampling"] = {k: (v if not isinstance(v, dict) or "ms_per_iter" not in v else v["ms_per_iter"])
                                          for k, v in res.items()}

    def sec_profile(self):
        import jax
        s = self.s
        target, draft, tcfg, dcfg = self.build()
        prompts = self.prompts(1, s.prompt)
        cap = self.capacity(s.prompt, s.n2)  # the b1 program: already compiled when b1 ran
        # --profile-sampling <a SAMPLING_VARIANTS name>: profile that sampling setting instead
        samp = self.args.profile_sampling
        kw = dict(SAMPLING_VARIANTS).get(samp, {})
        if samp and not kw:
            raise ValueError(f"--profile-sampling {samp!r}: not one of {[n for n, _ in SAMPLING_VARIANTS]}")
        curve = f"dflash_b1_{samp}" if kw else "dflash_b1"
        # the loop's kernels inside a CUDA graph are invisible to the profiler (a trace holds the prefill
        # alone): while loops as XLA's own, as scripts/profile_step.py runs them (the same kernels; the
        # measured iteration, with graphs, still gives the gaps). --profile-quantize <a --quantize method>
        # (checked in main): the quantized target instead (the quant section's DFlash B = 1 row gives its gaps)
        pq = getattr(self.args, "profile_quantize", "") or ""
        prof_kw = dict(while_graphs=False, **(dict(quant=pq) if pq else {}))
        kw = dict(kw, **prof_kw)
        if pq:
            curve = f"dflash_b1_{pq}" if not samp else curve + f"_{pq}"
        self.gen(draft, prompts, s.prof_n1, cap, **kw)  # compile / warm
        root = tempfile.mkdtemp(prefix="dflash_prof_")
        summaries = []
        for i, n in enumerate((s.prof_n1, s.prof_n2)):
            d = os.path.join(root, f"t{i}")
            with jax.profiler.trace(d, create_perfetto_trace=True):
                r = self.gen(draft, prompts, n, cap, **kw)
            iters = _iters(r)
            path = _find_trace(d)
            if path is None:
                raise RuntimeError(f"no *.trace.json.gz under {d}: {glob.glob(d + '/**', recursive=True)[:10]}")
            summ = summarize_trace(path)
            summ["iters"], summ["run_ms"], summ["path"] = iters, 1000 * float(r.run_time_s), path
            summaries.append(summ)
            log(f"profile: trace {i}: {iters} iterations, {summ['n_events']} device events "
                f"({summ['source']}), busy {summ['busy_ms']:.2f} ms of {summ['run_ms']:.2f} ms run")
        a, b = summaries
        di = b["iters"] - a["iters"]
        if di <= 0:
            raise RuntimeError(f"profiled runs have iterations {a['iters']} and {b['iters']}")
        rows = []
        for name in set(a["by_name"]) | set(b["by_name"]):
            ta, ca = a["by_name"].get(name, (0.0, 0))
            tb, cb = b["by_name"].get(name, (0.0, 0))
            rows.append((name, (tb - ta) / di, (cb - ca) / di))
        rows.sort(key=lambda r: -r[1])
        per_iter_busy = (b["busy_ms"] - a["busy_ms"]) / di * 1000
        if per_iter_busy <= 0:  # inconsistent traces (seen on CPU): fall back to the longer one alone
            log("profile: the difference of the traces is not positive; using the longer trace alone "
                "(per-iteration numbers include the prefill)")
            a = {"by_name": {}, "by_scope": {}, "by_hlo": {}, "busy_ms": 0.0, "iters": 0}
            di = b["iters"]
            per_iter_busy = b["busy_ms"] / di * 1000
        total = sum(max(r[1], 0) for r in rows) or float("nan")
        ms_iter = self.R["curves"].get(curve, {}).get("ms_per_iter")
        print(f"\nProfile: DFlash B=1 prompt {s.prompt}{' ' + samp if samp else ''}{' ' + pq if pq else ''}: device time per loop iteration by kernel "
              f"(difference of a {a['iters']}- and a {b['iters']}-iteration trace; prefill cancels)", flush=True)
        print(f"  device busy per iteration {per_iter_busy / 1000:.3f} ms"
              + (f"; measured iteration {ms_iter:.3f} ms -> idle/launch gaps {ms_iter - per_iter_busy / 1000:.3f} ms"
                 if ms_iter else ""), flush=True)
        print(f"  {'us/iter':>9} {'%':>6} {'calls/iter':>10}  kernel", flush=True)
        for name, us, cnt in rows[:25]:
            print(f"  {us:9.1f} {100 * us / total:6.1f} {cnt:10.1f}  {name[:110]}", flush=True)
        fam = {}
        for name, us, cnt in rows:
            k = _family(name)
            f0 = fam.setdefault(k, [0.0, 0.0])
            f0[0] += us
            f0[1] += cnt
        frows = sorted(fam.items(), key=lambda kv: -kv[1][0])
        print(f"  by kernel family (digits stripped):", flush=True)
        for k, (us, cnt) in frows[:15]:
            print(f"  {us:9.1f} {100 * us / total:6.1f} {cnt:10.1f}  {k[:110]}", flush=True)
        scope_rows = []
        if a["by_scope"] or b["by_scope"]:
            for name in set(a["by_scope"]) | set(b["by_scope"]):
                ta = a["by_scope"].get(name, 0.0)
                tb = b["by_scope"].get(name, 0.0)
                scope_rows.append((name, (tb - ta) / di))
            scope_rows.sort(key=lambda r: -r[1])
            print(f"  by named scope (layer numbers stripped):", flush=True)
            for name, us in scope_rows[:25]:
                print(f"  {us:9.1f} {100 * us / total:6.1f}             {name[:110]}", flush=True)
        # named scopes through the compiled HLO's op_name metadata (kernel -> HLO instruction -> scope)
        phase_rows, hscope_rows = [], []
        try:
            from dflash_jax import decode
            args, kwargs = self._generate_args(True, 1, s.prompt, s.n2, prof_kw)
            names = hlo_op_names(decode.compiled_program(*args, **kwargs, verify_width="block")[0].as_text())
            ph, sc, unmapped = {}, {}, 0.0
            for hlo in set(a["by_hlo"]) | set(b["by_hlo"]):
                us = (b["by_hlo"].get(hlo, 0.0) - a["by_hlo"].get(hlo, 0.0)) / di
                op = _lookup_hlo(names, hlo)
                if op is None:
                    unmapped += us
                    continue
                scope, phase = _scope_of(op)
                ph[phase] = ph.get(phase, 0.0) + us
                sc[scope] = sc.get(scope, 0.0) + us
            if unmapped:
                ph["(no HLO metadata)"] = unmapped
            phase_rows = sorted(ph.items(), key=lambda kv: -kv[1])
            hscope_rows = sorted(sc.items(), key=lambda kv: -kv[1])
            print("  by phase (named scope, from the compiled HLO's op_name metadata):", flush=True)
            for name, us in phase_rows:
                print(f"  {us:9.1f} {100 * us / total:6.1f}             {name[:110]}", flush=True)
            print("  by scope/primitive (layer numbers stripped), top 25:", flush=True)
            for name, us in hscope_rows[:25]:
                print(f"  {us:9.1f} {100 * us / total:6.1f}             {name[:110]}", flush=True)
        except Exception as e:
            log(f"profile: no HLO scope mapping ({short_err(e, 200)})")
        res = {"iters": [a["iters"], b["iters"]], "busy_us_per_iter": per_iter_busy,
               "phases": [dict(name=n, us_per_iter=u) for n, u in phase_rows],
               "hlo_scopes": [dict(name=n, us_per_iter=u) for n, u in hscope_rows[:60]],
               "source": b["source"], "top": [dict(name=n, us_per_iter=u, calls_per_iter=c) for n, u, c in rows[:60]],
               "families": [dict(name=k, us_per_iter=v[0], calls_per_iter=v[1]) for k, v in frows[:30]],
               "scopes": [dict(name=n, us_per_iter=u) for n, u in scope_rows[:40]]}
        if self.out_dir:  # the longer trace only ($OUT returns at most 8 files, 16 MiB each)
            summ = summaries[-1]
            sz = os.path.getsize(summ["path"])
            if sz <= 15 * 2**20:
                dst = os.path.join(self.out_dir, f"profile_dflash_b1_{int(summ['iters'])}iters.trace.json.gz")
                shutil.copy(summ["path"], dst)
                res["saved"] = dst
                log(f"profile: trace saved to {dst} ({sz / 2**20:.1f} MiB; open in ui.perfetto.dev)")
            else:
                log(f"profile: trace is {sz / 2**20:.1f} MiB > 15 MiB: not saved")
        shutil.rmtree(root, ignore_errors=True)
        self.R["sections"]["profile"] = res

    def batch_order(self):
        s = self.s
        order = []
        for b in sorted(set(s.batches_dflash) | set(s.batches_plain)):
            if b == 1:
                continue
            if b in s.batches_dflash:
                order.append(("dflash", b))
            if b in s.batches_plain:
                order.append(("plain", b))
        return order

    def sec_batch(self):
        for kind, b in self.batch_order():
            guess = (5.0 + 0.15 * b) if kind == "dflash" else (4.0 + 0.01 * b)
            self.timed_row(f"{kind}_b{b}", kind == "dflash", b, 5.0 if self.s.smoke else guess)

    def quant_order(self):
        """(key, dflash, batch, quant) of the quant section's rows in run order: B = 1 first (the
        issue's goal), within a batch plain bf16, plain quantized, DFlash bf16, DFlash quantized."""
        order = []
        for b in self.quant_batches:
            for kind in self.quant_kinds:
                for q in [None] + [q for q in self.quant if b in self.quant_only.get(q, (b,))]:
                    order.append((f"{kind}_b{b}" + (f"_{q}" if q else ""), kind == "dflash", b, q))
        return order

    def sec_quant(self):
        if not self.quant:
            raise ValueError("the quant section needs --quantize (e.g. --quantize int8)")
        s = self.s
        for key, dflash, b, q in self.quant_order():
            if key in self.R["curves"]:
                continue          # measured already (b1 / batch sections)
            guess = (5.0 + 0.15 * b) if dflash else (4.0 + 0.01 * b)
            est = self.loop_cost_est(b, s.prompt, s.n1, s.n2, 5.0 if s.smoke else guess)
            self.time_and_record(key, est, "{bound}-bound", dflash=dflash, batch=b, prompt_len=s.prompt,
                                 n1=s.n1, n2=s.n2, **(dict(quant=q) if q else {}))

    def quant_table(self, P):
        """The --quantize comparison: per batch and quantization, bf16 and quantized ms, their ratio,
        and each against its byte floor (weights as stored + KV read, over the copy bandwidth)."""
        C, out = self.R["curves"], []
        if not self.quant:
            return out
        bw = (self.bw or 0) / 1e12
        for q in self.quant:
            P("")
            P(f"quantized target ({q}) against bf16, prompt {self.s.prompt}, ms per plain step / DFlash iteration; "
              f"x fl = ms over the byte floor at {bw:.2f} TB/s (weights as stored + KV read); goals at B = 1: "
              f"{q}/bf16 <= {GOALS['quant_b1_ratio']}, {q} x fl <= {GOALS['quant_x_byte_floor']}")
            P(f"| B | bf16 plain ms | {q} plain ms | ratio | bf16 DFlash ms | {q} DFlash ms | ratio | "
              f"plain x fl bf16 / {q} | DFlash x fl bf16 / {q} | byte floors ms plain bf16 / {q}, DFlash bf16 / {q} |")
            P("|---|---|---|---|---|---|---|---|---|---|")
            for b in self.quant_batches:
                row = dict(batch=b, quant=q)
                cells = [str(b)]
                xf, fl = [], []
                for kind in ("plain", "dflash"):
                    r0, r1 = C.get(f"{kind}_b{b}"), C.get(f"{kind}_b{b}_{q}")
                    m0 = r0["ms_per_iter"] if r0 else None
                    m1 = r1["ms_per_iter"] if r1 else None
                    ratio = m1 / m0 if m0 and m1 else None
                    row.update({f"{kind}_bf16_ms": m0, f"{kind}_{q}_ms": m1, f"{kind}_ratio": ratio})
                    cells += [fmt(m0, 3), fmt(m1, 3), fmt(ratio, 3)]
                    xs = []
                    for tag, r in (("bf16", r0), (q, r1)):
                        x = r["ms_per_iter"] / r["bytes_floor_ms"] if r else None
                        row[f"{kind}_{tag}_x_byte_floor"] = x
                        row[f"{kind}_{tag}_byte_floor_ms"] = r["bytes_floor_ms"] if r else None
                        row[f"{kind}_{tag}_bound"] = r["floor_bound"] if r else None
                        xs.append(fmt(x, 2) + ("" if not r or r["floor_bound"] == "bytes" else "*"))
                        fl.append(fmt(r["bytes_floor_ms"], 3) if r else "-")
                    xf.append(" / ".join(xs))
                cells += xf + [f"{fl[0]} / {fl[1]}, {fl[2]} / {fl[3]}"]
                P("| " + " | ".join(cells) + " |")
                out.append(row)
            P("(* the FLOP floor at the GEMM rate is higher than the byte floor there: compute-bound)")
            b1 = next((r for r in out if r["batch"] == 1 and r["quant"] == q), None)
            if b1:
                for kind in ("plain", "dflash"):
                    ratio, x = b1[f"{kind}_ratio"], b1[f"{kind}_{q}_x_byte_floor"]
                    if ratio is None or x is None:
                        continue
                    P(f"  B=1 {kind}: {q}/bf16 {ratio:.3f} (goal <= {GOALS['quant_b1_ratio']}: "
                      f"{'OK' if ratio <= GOALS['quant_b1_ratio'] else 'MISS'}), {q} x byte floor {x:.2f} "
                      f"(goal <= {GOALS['quant_x_byte_floor']}: {'OK' if x <= GOALS['quant_x_byte_floor'] else 'MISS'})")
        return out

    def sec_longctx(self):
        s = self.s
        for impl in long_impls():
            key = f"dflash_long_{impl}"
            est = self.compile_est + (1 + 2 * s.reps) * (3.0 + 0.5 * (s.long_n1 + s.long_n2) * 0.012) + 10
            if s.smoke:
                est = self.compile_est + 10
            self.time_and_record(key, est, f"goal <= {GOALS['longctx_x_floor']}x", dflash=True, batch=1,
                                 prompt_len=s.long_prompt, n1=s.long_n1, n2=s.long_n2, attention_impl=impl)

    def err(self, key, e):
        log(f"ERROR in {key}: {short_err(e)}")
        self.R["errors"][key] = short_err(e, 2000)
        if self.args.verbose:
            traceback.print_exc()

    # -- the report --
    def report(self):
        s, C = self.s, self.R["curves"]
        ref = self.R["sections"].get("reference", {})
        fl = self.R["sections"].get("floors", {})
        lines = []
        P = lines.append
        P("")
        P("=" * 100)
        P(f"dflash-jax GPU benchmark  ({'SMOKE: tiny shapes, numbers mean nothing' if s.smoke else s.preset + ' shapes, random bf16 weights'})")
        P(f"device: {fl.get('devices', self.R.get('device', '?'))}   elapsed {self.elapsed():.0f}s")
        if fl:
            P(f"ceilings: copy {fl['copy_TBps']:.3f} TB/s (read+write) | XLA GEMV B1 {fl['gemv_b1_TBps']:.3f} "
              f"B16 {fl['gemv_b16_TBps']:.3f} B64 {fl['gemv_b64_TBps']:.3f} TB/s | GEMM {fl['gemm_TFLOPs']:.0f} TFLOP/s")
        elif "assumed_rates" in self.R:
            P(f"ceilings: not measured; floors assume copy {self.bw / 1e12:.2f} TB/s, GEMM {self.gemm_rate / 1e12:.0f} TFLOP/s")
        mb = self.R.get("model_bytes")
        if mb:
            P(f"bytes: target read/step {mb['target_read_GB']:.3f} GB (of {mb['target_total_GB']:.3f}; embedding not read), "
              f"draft {mb['draft_GB']:.3f} GB, LM head for S-1 slots {mb['lm_head_GB']:.3f} GB, "
              f"KV/token {mb['kv_target_per_token'] / 1024:.0f} KiB target + {mb['kv_draft_per_token'] / 1024:.0f} KiB draft")
        P("")
        P(f"{'measurement':34} {'ms/iter':>9} {'floor ms':>9} {'x floor':>8} {'bound':>6} {'goal':>10} {'tau':>5} {'compile s':>9}")

        def row(label, key, goal=None, goal_kind="ms"):
            r = C.get(key)
            if r is None:
                why = self.R["errors"].get(key)
                P(f"{label:34} {'-':>9}   ({'error: ' + why[:60] if why else 'not run'})")
                return
            g = ""
            if goal is not None:
                ok = r["ms_per_iter"] <= goal if goal_kind == "ms" else r["x_floor"] <= goal
                g = f"{'<=' + str(goal) + ('' if goal_kind == 'ms' else 'x'):>7} {'OK' if ok else 'MISS'}"
            P(f"{label:34} {fmt(r['ms_per_iter'], 3):>9} {fmt(r['floor_ms'], 3):>9} {fmt(r['x_floor'], 2):>8} "
              f"{r['floor_bound'][:5]:>6} {g:>10} {fmt(r.get('mean_tau'), 2):>5} {fmt(r['compile_time_s'], 1):>9}")

        row(f"plain B=1 p{s.prompt} (ms/token)", "plain_b1", GOALS["plain_b1_ms"])
        row(f"DFlash B=1 p{s.prompt}", "dflash_b1", GOALS["dflash_b1_ms"])
        gm = self.R["sections"].get("gemms")
        if gm:
            P(f"{'  their matmuls alone':34} plain {fmt(gm.get('plain_bare'), 3)} / {fmt(gm.get('plain_glue'), 3)} ms, "
              f"DFlash {fmt(gm.get('dflash_bare'), 3)} / {fmt(gm.get('dflash_glue'), 3)} ms "
              "(bare / + residual adds and SwiGLU; section gemms)")
        row("DFlash B=1 T=1", "dflash_b1_t1")
        row("DFlash B=1 T=.6 top-p .95 top-k 20", "dflash_b1_t06_p095_k20")
        row("DFlash B=1 T=1 top-p .95 (no top-k)", "dflash_b1_t1_p095")
        for b in s.batches_plain:
            if b != 1:
                row(f"plain B={b} p{s.prompt}", f"plain_b{b}")
        for b in s.batches_dflash:
            if b != 1:
                row(f"DFlash B={b} p{s.prompt}", f"dflash_b{b}")
        row(f"DFlash B=1 p{s.long_prompt} pallas", "dflash_long_pallas", GOALS["longctx_x_floor"], "x")
        row(f"DFlash B=1 p{s.long_prompt} xla", "dflash_long_xla", GOALS["longctx_x_floor"], "x")

        # sampling overhead
        samp = self.R["sections"].get("sampling", {})
        for name, _ in SAMPLING_VARIANTS:
            if f"{name}_overhead" in samp:
                o = samp[f"{name}_overhead"]
                P(f"sampling overhead {name}: {100 * o:+.1f}% vs greedy (goal <= +5%: {'OK' if o <= GOALS['sampling_overhead'] else 'MISS'})")

        # compile
        comp = self.R["sections"].get("compile")
        if comp:
            for k in ("dflash", "plain"):
                if f"{k}_compile_s" in comp:
                    P(f"compile {k}: {comp[f'{k}_compile_s']:.1f}s for the whole generation; same-bucket call "
                      f"compile_time_s={comp[f'{k}_same_bucket_call']['compile_time_s']:.3f} "
                      f"({'no recompile: OK' if comp[f'{k}_no_recompile'] else 'RECOMPILED'})")

        # --quantize: bf16 against the quantized target
        qt = self.quant_table(P)
        if qt:
            self.R["summary_quant"] = qt

        # reference side by side
        blk = ref.get("block_size", s.block)
        ours_d, ours_p = C.get("dflash_b1"), C.get("plain_b1")
        summary = {}
        if ref:
            P("")
            P(f"PyTorch reference (dflash 0.1.0, {ref.get('device')}): block {blk} {ref[f'block{blk}_ms_per_iter']:.2f} ms/iter, "
              f"block 1 {ref['block1_ms_per_iter']:.2f} ms/iter (prompt {s.prompt}, torch {ref.get('torch')})")
            if ours_d:
                sp = ref[f"block{blk}_ms_per_iter"] / ours_d["ms_per_iter"]
                summary["speedup_vs_ref_dflash_iter"] = sp
                P(f"  ours/ref per DFlash iteration: {sp:.1f}x (goal >= {GOALS['speedup_vs_ref']:.0f}x: "
                  f"{'OK' if sp >= GOALS['speedup_vs_ref'] else 'MISS'})")
            if ours_p:
                sp = ref["block1_ms_per_iter"] / ours_p["ms_per_iter"]
                summary["speedup_vs_ref_plain_step"] = sp
                P(f"  ours/ref per plain step: {sp:.1f}x")

        # projected tokens/s at the paper's tau
        if ours_d or ref:
            P("")
            P(f"projected tokens/s at the paper's tau (B=1; tokens/s = tau / iteration time; plain = 1 / step time)")
            P(f"{'task':10} {'tau':>5} {'ours DFlash':>12} {'ours plain':>11} {'ours x':>7} {'ref DFlash':>11} {'ref plain':>10} {'ref x':>6}")
            proj = {}
            for task, tau in PAPER_TAU.items():
                od = 1000 * tau / ours_d["ms_per_iter"] if ours_d else None
                op = 1000 / ours_p["ms_per_iter"] if ours_p else None
                rd = 1000 * tau / ref[f"block{blk}_ms_per_iter"] if ref else None
                rp = 1000 / ref["block1_ms_per_iter"] if ref else None
                proj[task] = dict(tau=tau, ours_dflash=od, ours_plain=op, ref_dflash=rd, ref_plain=rp)
                P(f"{task:10} {tau:5.2f} {fmt(od, 1):>12} {fmt(op, 1):>11} {fmt(od / op if od and op else None, 2):>7} "
                  f"{fmt(rd, 1):>11} {fmt(rp, 1):>10} {fmt(rd / rp if rd and rp else None, 2):>6}")
            summary["projected_tokens_per_s"] = proj

        # batch scaling
        bs = sorted(set(s.batches_dflash) | set(s.batches_plain))
        if any(f"dflash_b{b}" in C and f"plain_b{b}" in C for b in bs):
            P("")
            P("batch scaling, prompt %d: projected speed-up = tau * plain_step / dflash_iter (tokens/s = B*tau/iter vs B/step)" % s.prompt)
            P(f"{'B':>4} {'plain ms':>9} {'x floor':>7} {'dflash ms':>10} {'x floor':>7} {'iter/step':>9} "
              + " ".join(f"{'x@' + str(t):>8}" for t in PAPER_TAU.values()) + f" {'tok/s@6.54':>11}")
            table = []
            for b in bs:
                d, p = C.get(f"dflash_b{b}"), C.get(f"plain_b{b}")
                if not (d and p):
                    continue
                ratio = d["ms_per_iter"] / p["ms_per_iter"]
                sps = [t / ratio for t in PAPER_TAU.values()]
                tps = 1000 * b * 6.54 / d["ms_per_iter"]
                table.append(dict(batch=b, plain_ms=p["ms_per_iter"], dflash_ms=d["ms_per_iter"], ratio=ratio,
                                  speedups={k: t / ratio for k, t in PAPER_TAU.items()}, tokens_per_s_gsm8k=tps))
                P(f"{b:4d} {p['ms_per_iter']:9.3f} {p['x_floor']:7.2f} {d['ms_per_iter']:10.3f} {d['x_floor']:7.2f} "
                  f"{ratio:9.2f} " + " ".join(f"{x:8.2f}" for x in sps) + f" {tps:11.0f}")
            summary["batch_scaling"] = table
            for task, tau in PAPER_TAU.items():
                be = _break_even(table, tau)
                summary.setdefault("break_even_batch", {})[task] = be
                P(f"  DFlash stops paying at tau {tau} ({task}): {be}")
        self.R["summary"] = summary
        if self.R["skipped"]:
            P("")
            P("SKIPPED (time budget): " + ", ".join(self.R["skipped"]) + "  -> rerun with --sections")
        if self.R["errors"]:
            P("")
            P("ERRORS:")
            for k, v in self.R["errors"].items():
                P(f"  {k}: {v[:300]}")
        P("=" * 100)
        print("\n".join(lines), flush=True)
        self.R["report"] = lines
        self.save()


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _params(obj):
    try:
        from flax import nnx
        if isinstance(obj, nnx.Module):
            return nnx.state(obj)
    except ImportError:
        pass
    for name in ("params", "weights", "variables"):
        p = getattr(obj, name, None)
        if p is not None:
            return p
    return obj


def _leaves_with_paths(tree):
    import jax
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "nbytes") and hasattr(leaf, "shape"):
            out.append((jax.tree_util.keystr(path), leaf))
    return out


def model_bytes(target, draft, tcfg, dcfg) -> dict:
    """Parameter bytes of the built models, and what one step must read of them."""
    tl = _leaves_with_paths(_params(target))
    dl = _leaves_with_paths(_params(draft)) if draft is not None else []
    t_total = sum(int(x.nbytes) for _, x in tl)
    t_params = sum(int(x.size) for _, x in tl)
    d_total = sum(int(x.nbytes) for _, x in dl)
    d_params = sum(int(x.size) for _, x in dl)
    vocab_h = tcfg.vocab_size * tcfg.hidden_size
    emb = [x for p, x in tl if "embed" in p.lower() and x.size == vocab_h]
    if not emb:  # no path names an embedding: one (vocab, hidden) table is it
        emb = [x for _, x in tl if x.size == vocab_h][:1]
    # the activations' / KV cache's dtype: the embedding's (not the widest leaf: an int8 target's
    # scales are float32)
    itemsize = emb[0].dtype.itemsize if emb else max((x.dtype.itemsize for _, x in tl), default=2)
    emb_bytes = int(emb[0].nbytes) if emb else vocab_h * itemsize
    tied = bool(getattr(tcfg, "tie_word_embeddings", False))
    # The embedding is a gather (B rows), not a read of the table; when tied it is also the LM head.
    read = t_total - (0 if tied else emb_bytes)
    read_params = t_params - (0 if tied else vocab_h)
    kv_t = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * itemsize
    kv_d = 2 * dcfg.num_layers * dcfg.num_kv_heads * dcfg.head_dim * itemsize if dcfg is not None else 0
    # draft-side leaves that alias the target (none expected: the draft holds no embedding / head)
    return {"target_total": t_total, "target_read": read, "target_read_params": read_params,
            "embed": emb_bytes, "lm_head": vocab_h * itemsize, "lm_head_params": vocab_h,
            "draft": d_total, "draft_params": d_params, "kv_target_per_token": kv_t, "kv_draft_per_token": kv_d,
            "target_total_GB": t_total / 1e9, "target_read_GB": read / 1e9, "embed_GB": emb_bytes / 1e9,
            "lm_head_GB": vocab_h * itemsize / 1e9, "draft_GB": d_total / 1e9,
            "n_target_leaves": len(tl), "n_draft_leaves": len(dl)}


def _iters(r) -> float:
    n = getattr(r, "num_iterations", None)
    if n is None:
        n = max(len(a) for a in r.acceptance_lengths)
    if hasattr(n, "__len__"):
        n = max(list(n))
    return float(n)


def _bench(fn, inner=20, outer=5) -> float:
    """Median seconds per call of fn (async dispatches, one sync per batch of `inner`)."""
    import jax
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    ts = []
    for _ in range(outer):
        t = time.perf_counter()
        for _ in range(inner):
            o = fn()
        jax.block_until_ready(o)
        ts.append((time.perf_counter() - t) / inner)
    return median(ts)


def parse_quantize(spec: str) -> tuple[list, dict]:
    """--quantize "int8,fp8@1/8" → (["int8", "fp8"], {"fp8": (1, 8)}): the methods, and the batches a
    method is limited to (none named: every batch). Methods: dflash_jax.quantize.QUANTIZE (int8),
    "fp8" (fp8_like_checkpoint), "fp8-w8a8" (the same weights run W8A8: quantize.to_w8a8) and
    "fp8-w8a8+head" (that, with the LM head int8 too: --w8a8 --quantize int8+head), "fp8-w8a8-channel" (the
    weights requantized per output channel: --w8a8 channel)."""
    names, only = [], {}
    for item in (x for x in spec.split(",") if x):
        name, _, bs = item.partition("@")
        names.append(name)
        if bs:
            only[name] = tuple(int(b) for b in bs.split("/") if b)
    return names, only


def parse_quant_kinds(spec: str) -> tuple:
    """--quant-kinds "dflash" -> ("dflash",): the quant section's row kinds, in run order."""
    kinds = tuple(k for k in ("plain", "dflash") if k in spec.split(","))
    bad = [k for k in spec.split(",") if k and k not in ("plain", "dflash")]
    if bad or not kinds:
        raise ValueError(f"--quant-kinds: {spec!r} names no row kind of plain, dflash")
    return kinds


def check_quantize_names(names) -> list:
    """The names of `names` that are no method (dflash_jax.quantize.QUANTIZE or FP8_METHODS)."""
    from dflash_jax.quantize import QUANTIZE
    return [q for q in names if q not in QUANTIZE and q not in FP8_METHODS]


FP8_METHODS = ("fp8", "fp8-w8a8", "fp8-w8a8+head", "fp8-w8a8-channel")


def quantized_target(init_target, cfg, q: str, dtype="bfloat16"):
    """The random target of `cfg` (seed 0: the bf16 rows' weights) quantized by method q: "fp8" as an
    FP8 checkpoint loads (fp8_like_checkpoint), "fp8-w8a8" that run W8A8 (load_target(w8a8=True)),
    else init_target(quantize=q)."""
    if q == "fp8":
        return fp8_like_checkpoint(init_target(cfg, seed=0, dtype=dtype))
    if q in ("fp8-w8a8", "fp8-w8a8+head", "fp8-w8a8-channel"):
        from dflash_jax.quantize import quantize_target, to_w8a8
        model = fp8_like_checkpoint(init_target(cfg, seed=0, dtype=dtype))
        return to_w8a8(quantize_target(model, "int8+head") if q.endswith("+head") else model,
                       "channel" if q.endswith("-channel") else "block")
    return init_target(cfg, seed=0, dtype=dtype, quantize=q)


def fp8_like_checkpoint(model, block=(128, 128)):
    """What load_target makes of an FP8 checkpoint (Qwen3-*-FP8: quant_method fp8, weight_block_size
    [128, 128]), from a float model: its layers' 2-D linears (quantize.LINEAR_NAMES) and stacked MoE
    experts [E, in, out] (quantize.EXPERT_NAMES) as quantize.Fp8BlockWeight (float8_e4m3fn, one
    float32 scale per 128 x 128 block: amax / 448), as the loader keeps them (weights.py), the rest as
    it is, the module marked "fp8" as the loader marks it. Random weights, so no checkpoint file is
    needed. (The experts once stayed bf16 here: fp8 MoE rows measured before 2975911 ran bf16 experts.)"""
    import jax.numpy as jnp
    from flax import nnx
    from dflash_jax import quantize as q8

    def fp8(w):
        *lead, K, N = w.shape
        bk, bn = block
        Kb, Nb = -(-K // bk), -(-N // bn)
        pad = [(0, 0)] * len(lead) + [(0, Kb * bk - K), (0, Nb * bn - N)]
        wf = jnp.pad(jnp.asarray(w, jnp.float32), pad)
        amax = jnp.max(jnp.abs(wf.reshape(*lead, Kb, bk, Nb, bn)), axis=(-3, -1))        # [.., Kb, Nb]
        scale = jnp.where(amax > 0, amax / 448.0, 1.0)
        full = jnp.repeat(jnp.repeat(scale, bk, axis=-2), bn, axis=-1)
        q = (wf / full).astype(jnp.float8_e4m3fn)[..., :K, :N]
        return q8.Fp8BlockWeight(q, scale, block)

    for _, node in nnx.iter_graph(model.layers):
        if not isinstance(node, nnx.Module):
            continue
        for name in q8.LINEAR_NAMES + q8.EXPERT_NAMES:
            p = getattr(node, name, None)
            ndim = 3 if name in q8.EXPERT_NAMES else 2
            if isinstance(p, nnx.Param) and not q8.is_quantized(p.get_value()) and p.get_value().ndim == ndim:
                p.set_value(fp8(p.get_value()))
    return q8.mark(model, "fp8")


def copy_probe(nbytes: int, reps: int = 5, inner: int = 10, max_plausible_tbps: float = 6.0) -> dict:
    """Device copy bandwidth (bytes read + bytes written over time) of an `nbytes` buffer into a new
    buffer, no donation, each pass its own dispatch (`inner` dispatches, one sync, median of `reps`):
    nothing for XLA to fuse or fold across passes (an earlier probe ran 20 passes inside one
    fori_loop, which XLA fused into one: 53.9 TB/s on an H100). Variants: x + 1 in bf16, x + 1 in uint32, and
    jnp.copy (XLA's copy); read-only: a float32 sum of the bf16 buffer (bytes read alone). copy_TBps
    is the fastest copy variant at or under `max_plausible_tbps` (an H200's HBM3e is 4.8 TB/s by its
    datasheet); a faster one is reported and left out as implausible."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    cols = 1 << 16
    rows = max(1, nbytes // (2 * cols))
    out = {"bytes": rows * cols * 2, "TBps": {}, "implausible": []}
    mk = jax.jit(lambda: (lax.broadcasted_iota(jnp.int32, (rows, cols), 1) % 1000
                          + lax.broadcasted_iota(jnp.int32, (rows, cols), 0) % 7).astype(jnp.bfloat16))
    variants = (
        ("add_bf16", lambda x: x, jax.jit(lambda x: x + jnp.asarray(1, x.dtype)), 2),
        ("add_u32", lambda x: lax.bitcast_convert_type(x.reshape(rows, cols // 2, 2), jnp.uint32),
         jax.jit(lambda x: x + jnp.uint32(1)), 2),
        ("jnp_copy", lambda x: x, jax.jit(lambda x: jnp.copy(x)), 2),
        ("read_sum", lambda x: x, jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), 1),
    )
    for name, view, f, passes in variants:
        try:
            x = view(mk())
            dt = _bench(lambda: f(x), inner=inner, outer=reps)
            out["TBps"][name] = passes * out["bytes"] / dt / 1e12
        except Exception as e:  # noqa: BLE001 - a variant that fails leaves the others
            out.setdefault("errors", {})[name] = short_err(e)
        finally:
            x = None
    copies = {k: v for k, v in out["TBps"].items() if k != "read_sum"}
    ok = {k: v for k, v in copies.items() if v <= max_plausible_tbps}
    out["implausible"] = sorted(set(copies) - set(ok))
    best = max(ok, key=ok.get) if ok else None
    out["copy_from"] = best or "none plausible"
    out["copy_TBps"] = ok[best] if best else float("nan")
    return out


def _break_even(table, tau) -> str:
    """The batch where tau * plain / dflash crosses 1 (log-linear interpolation in B)."""
    pts = [(t["batch"], tau / t["ratio"]) for t in table]
    if not pts:
        return "n/a"
    if all(sp >= 1 for _, sp in pts):
        b, sp = pts[-1]
        if len(pts) >= 2:
            (b0, s0), (b1, s1) = pts[-2], pts[-1]
            if s1 < s0 and b1 > b0:  # extrapolate the last segment in log B
                slope = (math.log(s1) - math.log(s0)) / (math.log(b1) - math.log(b0))
                if slope < 0:
                    bx = b1 * math.exp(-math.log(s1) / slope)
                    return f"beyond B={b} (still {sp:.2f}x there); extrapolated ~B={bx:.0f}"
        return f"beyond B={b} (still {sp:.2f}x there)"
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if s0 >= 1 > s1:
            f = (math.log(s0)) / (math.log(s0) - math.log(s1))
            bx = math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
            return f"~B={bx:.0f} (x{s0:.2f} at B={b0}, x{s1:.2f} at B={b1})"
    return f"already below 1x at B={pts[0][0]} (x{pts[0][1]:.2f})"


def _find_trace(d: str):
    c = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))
    c = [p for p in c if not os.path.basename(p).startswith("perfetto")] or c
    if not c:
        c = sorted(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True))
    return c[0] if c else None


_DIGITS = re.compile(r"\d+")


def _family(name: str) -> str:
    return _DIGITS.sub("#", name)


def _device_events(path: str):
    """(events, source) of a Chrome-format trace (jax.profiler): the device's kernel events as dicts.

    Device events: processes named /device:GPU:* or /device:TPU:* (their 'Stream' threads when present,
    else the 'XLA Ops' line); on a CPU backend, the XLA CPU client threads (smoke runs)."""
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    pname, tname = {}, {}
    for e in ev:
        if e.get("ph") == "M":
            if e.get("name") == "process_name":
                pname[e["pid"]] = e.get("args", {}).get("name", "")
            elif e.get("name") == "thread_name":
                tname[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    dev_pids = {p for p, n in pname.items() if re.match(r"/device:(GPU|TPU)", n or "")}
    source = ""
    sel = set()
    if dev_pids:
        threads = {k: n for k, n in tname.items() if k[0] in dev_pids}
        stream = {k for k, n in threads.items() if "stream" in n.lower()}
        ops = {k for k, n in threads.items() if n.strip().lower() == "xla ops"}
        if stream:
            sel, source = stream, "GPU streams"
        elif ops:
            sel, source = ops, "XLA Ops line"
        else:
            sel = set(threads) or {(p, None) for p in dev_pids}
            source = "device threads"
        use = lambda e: (e["pid"], e.get("tid")) in sel or (e["pid"] in dev_pids and not threads)
    else:
        sel = {k for k, n in tname.items() if re.match(r"tf_XLA(PjRt)?Cpu", n or "")}
        source = "XLA CPU client threads"
        use = lambda e: (e["pid"], e.get("tid")) in sel and not e.get("name", "").startswith(("end:", "Threadpool", "ThunkExecutor"))
    return [e for e in ev if e.get("ph") == "X" and use(e)], source


def summarize_trace(path: str, loaded=None) -> dict:
    """Sum the device kernel time of a Chrome-format trace (jax.profiler) by kernel name and scope
    (device events as _device_events selects them; loaded: its result for path, already read)."""
    events, source = loaded or _device_events(path)
    by_name, by_scope, by_hlo, hlo_of_name = {}, {}, {}, {}
    busy = 0.0
    n = 0
    for e in events:
        dur = float(e.get("dur", 0.0))  # microseconds
        name = e.get("name", "?")
        t, c = by_name.get(name, (0.0, 0))
        by_name[name] = (t + dur, c + 1)
        busy += dur
        n += 1
        a = e.get("args") or {}
        hlo = a.get("hlo_op") or name
        by_hlo[hlo] = by_hlo.get(hlo, 0.0) + dur
        hlo_of_name[name] = hlo
        scope = a.get("tf_op") or a.get("scope") or a.get("name_scope") or a.get("long_name") or ""
        if scope:
            scope = _DIGITS.sub("#", str(scope).split(" ")[0])
            by_scope[scope] = by_scope.get(scope, 0.0) + dur
    return {"by_name": by_name, "by_scope": by_scope, "by_hlo": by_hlo, "hlo_of_name": hlo_of_name,
            "busy_ms": busy / 1000, "n_events": n,
            "source": source}


def traced_difference(gen, n1: int, n2: int, prefix: str, key=lambda name: name):
    """Trace gen(n1) and gen(n2) (generate() calls of one compiled program) and return (per, ds, x, y):
    per {key(kernel name): [us per step, launches per step]} from the difference of the two traces
    over the difference of their steps ds (the prefill cancels), x and y the two summaries (with
    steps and run_ms)."""
    import jax
    summ = []
    for n in (n1, n2):
        d = tempfile.mkdtemp(prefix=prefix)
        with jax.profiler.trace(d, create_perfetto_trace=True):
            r = gen(n)
        sm = summarize_trace(_find_trace(d))
        sm["steps"] = int(r.num_iterations)
        sm["run_ms"] = 1000 * r.run_time_s
        summ.append(sm)
    x, y = summ
    ds = max(1, y["steps"] - x["steps"])
    per: dict = {}
    for sign, sm in ((-1, x), (1, y)):
        for k, (t, c) in sm["by_name"].items():
            p = per.setdefault(key(k), [0.0, 0.0])
            p[0] += sign * t / ds
            p[1] += sign * c / ds
    return per, ds, x, y


def _module_of(e) -> str:
    a = e.get("args") or {}
    m = a.get("hlo_module") or a.get("module") or a.get("program") or "?"
    return re.sub(r"\(\d+\)$", "", str(m))


def trace_timeline(path: str, min_gap_us: float = 2.0, loaded=None) -> dict:
    """The device's timeline in a trace: its span, busy time (the union of kernel intervals over every
    stream) and idle gaps of >= min_gap_us, each gap named by the programs (HLO modules) of the kernels
    on either side: 'A' (a gap inside program A: e.g. a while loop's predicate read between
    iterations) or 'A -> B' (between two program launches: host dispatch, transfers, host sync).
    Returns span_ms, busy_ms, idle_ms, gaps {name: (ms, count)}, busy_by_module {module: (ms, kernels)}
    (loaded: _device_events(path), already read)."""
    events, source = loaded or _device_events(path)
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), _module_of(e)) for e in events)
    out = {"source": source, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": {}, "busy_by_module": {}}
    if not iv:
        return out
    for t0, t1, m in iv:
        ms, c = out["busy_by_module"].get(m, (0.0, 0))
        out["busy_by_module"][m] = (ms + (t1 - t0) / 1e3, c + 1)
    busy = 0.0
    cur0, cur1, cur_m = iv[0]
    for t0, t1, m in iv[1:]:
        if t0 > cur1:
            busy += cur1 - cur0
            gap = t0 - cur1
            if gap >= min_gap_us:
                key = cur_m if m == cur_m else f"{cur_m} -> {m}"
                ms, c = out["gaps"].get(key, (0.0, 0))
                out["gaps"][key] = (ms + gap / 1e3, c + 1)
            cur0, cur1, cur_m = t0, t1, m
        elif t1 >= cur1:
            cur1, cur_m = t1, m
    busy += cur1 - cur0
    out["span_ms"] = (cur1 - iv[0][0]) / 1e3
    out["busy_ms"] = busy / 1e3
    out["idle_ms"] = out["span_ms"] - out["busy_ms"]
    return out


_HLO_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')


def hlo_op_names(hlo_text: str) -> dict:
    """HLO instruction name -> JAX op_name (the named-scope path) from compiled HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _scope_of(op_name: str) -> tuple[str, str]:
    """('verify/target_layer#/dot_general', 'verify') from 'jit(_run)/while/body/verify/target_layer3/dot_general'."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    parts = [p for p in parts if p not in ("while", "body", "cond", "closed_call", "pjit", "checkpoint")]
    phase = next((p for p in parts if not p.startswith(("jvp", "transpose"))), "?")
    return _DIGITS.sub("#", "/".join(parts)), _DIGITS.sub("#", phase)


def _lookup_hlo(names: dict, key: str):
    if key in names:
        return names[key]
    k2 = re.sub(r"_(\d+)$", r".\1", key)   # kernel 'loop_add_fusion_3' <- HLO 'loop_add_fusion.3'
    return names.get(k2)


# ----------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): prove every section runs")
    ap.add_argument("--preset", default="qwen3-8b",
                    help="target shapes (dflash_jax.PRESETS: qwen3-8b, llama3.1-8b, ...; random bf16 weights), "
                         "its draft 5 layers wide as the target; the reference section runs for qwen3-8b only")
    ap.add_argument("--batches", default="", metavar="8,32,64",
                    help="batch sizes of the batch section (default 8,32,64; smoke 2,4)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated subset of {','.join(ALL_SECTIONS)} (default: all but check)")
    ap.add_argument("--json", default="bench_gpu.json", help="name of the JSON file under --out")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_gpu.json and the trace ($OUT)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="stop starting new measurements after this many seconds (the call must end < 8 min)")
    ap.add_argument("--verbose", action="store_true", help="full tracebacks")
    ap.add_argument("--no-precompile", dest="precompile", action="store_false",
                    help="let generate() compile each program when first timed (serial)")
    ap.add_argument("--compile-workers", type=int, default=4, help="threads compiling programs ahead")
    ap.add_argument("--serial-reference", action="store_true",
                    help="finish the PyTorch reference before JAX starts (no overlap with compiles)")
    ap.add_argument("--no-fused-layer", dest="fused_layer", action="store_false",
                    help="KernelConfig(fused_layer=False): no fused q/k norm + RoPE + cache writes or "
                         "add + RMSNorm kernels on the GPU path")
    ap.add_argument("--no-sampling-kernels", dest="sampling_kernels", action="store_false",
                    help="KernelConfig(sampling_kernels=False): top-k/top-p search in XLA reductions")
    ap.add_argument("--gpu-attn", default="", metavar="block_k=128,num_warps=8",
                    help="KernelConfig.attention_tuning: overrides of the GPU attention kernel's launch settings")
    ap.add_argument("--profile-sampling", default="",
                    help="profile this SAMPLING_VARIANTS setting (t1, ...) instead of greedy")
    ap.add_argument("--profile-quantize", default="", metavar="fp8-w8a8",
                    help="profile the target quantized by this --quantize method instead of the bf16 one")
    ap.add_argument("--quantize", default="", metavar="int8,fp8@1",
                    help="the quant section's quantized targets, comma-separated, each timed against bf16 in this "
                         "process: dflash_jax.quantize.QUANTIZE (int8), fp8 (the layers' linears as an FP8 "
                         "block-128 checkpoint loads, fp8_like_checkpoint), fp8-w8a8 (those run W8A8, --w8a8) or "
                         "fp8-w8a8+head (and the LM head int8, --quantize int8+head), fp8-w8a8-channel "
                         "(--w8a8 channel); NAME@1/8 limits one to those batches")
    ap.add_argument("--quant-batches", default="", metavar="1,8,32", help="the quant section's batches (1,8,32)")
    ap.add_argument("--quant-kinds", default="plain,dflash", metavar="plain,dflash",
                    help="the quant section's rows: plain steps, DFlash iterations or both (a call whose compiles "
                         "would not fit both)")
    ap.add_argument("--floor-tbs", type=float, default=0.0,
                    help="copy bandwidth of the floors in TB/s (a probe of the same call); 0: the floors "
                         "section's probe, or 4.23 without it")
    ap.add_argument("--loop-n", default="", metavar="64,256", help="N1,N2 new tokens of every loop row")
    ap.add_argument("--reps", type=int, default=0, help="timed pairs per loop row (default 3)")
    ap.add_argument("--_reference-child", dest="ref_child", help=argparse.SUPPRESS)
    ap.add_argument("--_ref-new", dest="ref_new", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--_ref-prompt", dest="ref_prompt", type=int, default=512, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ref_child:
        reference_child(args.ref_child, args.smoke, args.ref_new, args.ref_prompt)
        return
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # leave the reference child room on the GPU (it holds ~20 GB while JAX starts)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.70")
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    log(f"kernels: fused_layer={args.fused_layer} (fused q/k norm + RoPE + cache writes, add + RMSNorm "
        f"on the GPU path); sampling_kernels={args.sampling_kernels}; gpu attention overrides "
        f"{args.gpu_attn or '(default)'}")
    bad = [x for x in sections if x not in ALL_SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; known: {ALL_SECTIONS}")
    if args.quantize:
        badq = check_quantize_names(parse_quantize(args.quantize)[0])
        if badq:
            ap.error(f"--quantize: unknown {badq}; supported: dflash_jax.quantize.QUANTIZE and {', '.join(FP8_METHODS)}")
        if "quant" not in sections:
            sections.append("quant")
    elif "quant" in sections:
        ap.error("the quant section needs --quantize (e.g. --quantize int8)")
    try:
        parse_quant_kinds(args.quant_kinds)
    except ValueError as e:
        ap.error(str(e))
    if args.profile_quantize and args.profile_quantize not in parse_quantize(args.quantize or "")[0]:
        ap.error(f"--profile-quantize {args.profile_quantize}: not one of --quantize ({args.quantize or 'none given'})")
    b = Bench(args)
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    try:
        run_all(b, args, sections)
    except KeyboardInterrupt as e:
        log(f"INTERRUPTED ({e}): reporting what was measured")
        p = getattr(b, "ref_proc", None)
        if p is not None and p.poll() is None:
            p.kill()
        b.R["interrupted"] = str(e)
    b.report()


def run_all(b, args, sections):
    log(f"bench_gpu: sections {sections}, budget {args.budget_s:.0f}s, out {args.out}, smoke={args.smoke}")
    # The reference runs in a child process, started before this process touches the GPU. While it
    # runs, this process builds the models and compiles every program (CPU work; XLA's autotuning
    # runs a few kernels on the device). JAX is capped below its default 75% of the GPU memory so
    # that the reference's ~20 GB fit beside it. Nothing is timed here until the reference is done.
    ref = None
    if "reference" in sections and args.preset != "qwen3-8b":
        log(f"reference: skipped (the PyTorch reference is built at Qwen3-8B shapes; --preset {args.preset})")
        sections = [x for x in sections if x != "reference"]
    if "reference" in sections:
        try:
            ref = b.start_reference()
        except Exception as e:
            b.err("reference", e)
        if args.serial_reference and ref is not None:
            try:
                b.finish_reference(ref)
            except Exception as e:
                b.err("reference", e)
            ref = None
    if args.precompile and any(x not in ("reference", "floors", "check") for x in sections):
        log("== precompile")
        try:
            b.precompile(sections, args.compile_workers)
        except Exception as e:
            b.err("precompile", e)
        b.save()
    if ref is not None:
        log("== reference (waiting for the child)")
        try:
            b.finish_reference(ref)
        except Exception as e:
            b.err("reference", e)
        b.save()
    order = list(ALL_SECTIONS)
    if args.profile_quantize:   # after quant: its DFlash B = 1 row's time gives the profile's launch gaps
        order.remove("profile")
        order.insert(order.index("quant") + 1, "profile")
    for name in order:
        if name not in sections or name == "reference":
            continue
        if b.elapsed() > b.budget:
            log(f"SKIP {name}: time budget spent")
            b.R["skipped"].append(name)
            continue
        log(f"== {name}")
        try:
            getattr(b, f"sec_{name}")()
        except Exception as e:
            b.err(name, e)
        b.save()
    try:
        import jax
        b.R["versions"] = {"jax": jax.__version__, "python": sys.version.split()[0]}
        try:
            import flax
            b.R["versions"]["flax"] = flax.__version__
        except Exception:
            pass
    except Exception:
        pass


if __name__ == "__main__":
    main()
