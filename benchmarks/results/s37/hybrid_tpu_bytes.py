"""Session 37: one Qwen3.5-9B program (L layers, 0: all; batch B; S = 1 plain, 16 DFlash) compiled
for a v6e chip on the CPU host, its per-op HBM (scripts/tpu_bytes.py) printed against bench_hybrid's
floor. Run from the repo root: L=0 B=32 S=1 PYTHONPATH=$PWD python benchmarks/results/s37/hybrid_tpu_bytes.py
(the "before" log is this script on session 36's code; bench_hybrid.py --tpu-aot now reports the same)."""
import os, sys, time, dataclasses, json
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost"); os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-4")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1"); os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, "scripts"); sys.argv += ["--tpu-aot", "v6e"]
import bench_hybrid as bh
import tpu_bytes as tb
from flax import nnx
from jax.experimental import topologies
from dflash_jax import DraftConfig, decode, init_draft, init_target
from dflash_jax.kernel_config import KernelConfig
L = int(os.environ.get("L", "4")); B = int(os.environ.get("B", "1")); S = int(os.environ.get("S", "16"))
form = os.environ.get("FORM", "chunk")
c = bh.config(bh.QWEN35_9B, form)
if L:
    c = dataclasses.replace(c, num_layers=L, layer_types=c.layer_types[:L])
dc = DraftConfig.for_target(c, num_layers=5, block_size=16, target_layer_ids=tuple(sorted({min(i, c.num_layers - 1) for i in (1, 3)})))
target = nnx.eval_shape(lambda: init_target(c, seed=0, dtype="bfloat16"))
draft = nnx.eval_shape(lambda: init_draft(dc, seed=1, dtype="bfloat16"))
dev = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2").devices[0]
t0 = time.time()
low = decode.lower_iteration(c, dc if S > 1 else None, batch=B, prompt_len=512, capacity=1024,
                             kernels=KernelConfig(attention="pallas_tpu"), device=dev)
comp = low.compile()
print("compile s", time.time() - t0, flush=True)
fl = bh.floor_bytes(target, draft if S > 1 else None, c, B, 1024, S)
print("floor", {k: round(v / 1e9, 4) for k, v in fl.items()})
if os.environ.get("SAVE"):
    open(os.environ["SAVE"], "w").write(comp.as_text())
s = tb.breakdown(comp)
tb.print_report(s, int(os.environ.get("TOP", "30")), fl["total"])
