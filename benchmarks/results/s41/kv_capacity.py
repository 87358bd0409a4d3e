"""Session 41: the largest KV capacity (B = 1) the TPU compiler accepts for Qwen3-Coder-30B-A3B int8 + its
8-layer draft at 48 layers, one DFlash iteration. Usage: python benchmarks/results/s41/kv_capacity.py v6e-1:8192 ..."""
import os, sys, argparse, importlib.util, time
for k, v in dict(JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost", TPU_ACCELERATOR_TYPE="v6e-4", TPU_SKIP_MDS_QUERY="1").items():
    os.environ.setdefault(k, v)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
spec = importlib.util.spec_from_file_location("aot", os.path.join(REPO, "scripts", "tpu_moe_aot.py"))
aot = importlib.util.module_from_spec(spec); spec.loader.exec_module(aot)
for chip, cap, q in [(a.split(":") + ["int8"])[:3] for a in sys.argv[1:]]:      # chip:capacity[:int8|bf16]
    cap, q = int(cap), None if q == "bf16" else q
    args = argparse.Namespace(preset="qwen3-coder-30b-a3b", draft_layers=8, batch=1, capacity=cap)
    t = time.time()
    try:
        comp = aot.lower(chip, "dflash", 48, args, q).compile()
        ma = comp.memory_analysis()
        m = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
        print(chip, cap, q or "bf16", "OK memory GiB", round(m / 2**30, 3), "compile s", round(time.time() - t), flush=True)
    except Exception as e:
        print(chip, cap, q or "bf16", "REFUSED", str(e).splitlines()[0][:300], flush=True)
