"""Seconds per training step on short rows padded long (the issue-33 case): CPU seconds of the
process (all threads; steadier than wall time on a shared machine) and wall seconds per step, step 1
(the compile) apart. The CLI's defaults: block 16, 512 anchors, batch 8, bf16 compute, a 2-layer
draft. Usage: python scripts/perf_step.py TARGET_DIR DATA_DIR RUN_DIR STEPS
DATA_DIR without a manifest gets 64 rows of a 30-token prompt + a 95-token answer padded to 3072
(what `regenerate --max-len 3072` writes for short answers). Results: docs/perf-log.md."""
import json
import os
import sys
import time

import jax
import numpy as np

import dflash_jax as dj
from dflash_jax.train import step as step_mod
from dflash_jax.train.data import TokenData, write_shard
from dflash_jax.train.run import RunConfig, train

target_dir, data_dir, run_dir, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
target = dj.load_target(target_dir, dtype="bfloat16")
if not os.path.isfile(os.path.join(data_dir, "manifest.json")):
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    rows = [(list(rng.integers(4, V, 125)), [0] * 30 + [1] * 95) for _ in range(64)]
    with open(os.path.join(data_dir, "manifest.json"), "w") as f:
        json.dump(dict(shards=[write_shard(data_dir, 0, TokenData.from_rows(rows, 3072))]), f)
cfg = dj.DraftConfig.for_target(target.config, num_layers=2, block_size=16, mask_token_id=3)
data = TokenData.from_dir(data_dir)
real, rec = step_mod.Trainer.step, []


def timed(self, *a, **k):
    c0, w0 = time.process_time(), time.perf_counter()
    out = real(self, *a, **k)
    jax.block_until_ready(out)
    rec.append(dict(cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - w0, length=a[1].shape[1],
                    anchors=k.get("num_anchors", self.cfg.num_anchors)))
    print("step", len(rec), rec[-1], flush=True)
    return out


step_mod.Trainer.step = timed
train(target, cfg, data, run=RunConfig(out_dir=run_dir, batch_size=8, max_steps=steps, log_every=1,
                                       save_every=1000, progress=False))
print(json.dumps(dict(compile_step=rec[0], steps=rec[1:])))
