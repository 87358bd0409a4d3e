"""What serving across processes costs per engine step (issue 58): the op process 0 publishes
through the coordination service's key-value store, against the step itself.

Runs itself as 2 processes x 4 virtual CPU devices (jax.distributed on localhost, mesh
data=2,model=4 over all 8; process 0 drives a LeaderSlots, process 1 follows), and as 1 process
on 8 devices with the same mesh (no ops). A small random pair (--hidden, --layers); --slots rows
busy with long requests; each timed step is dispatched and read at once (pipeline depth 0, so its
wall time is the step's). Prints, per step of K iterations: the step's wall time on each layout,
the publish call's time on process 0 (what the engine thread pays before each dispatch), an op's
round trip (publish, the worker reads it and acknowledges it, process 0 sees the ack: an upper
bound on the one-way delay) and the ops' sizes.

  python scripts/bench_multihost_serve.py                   # ~3 minutes on 2 CPU cores
  python scripts/bench_multihost_serve.py --hidden 512 --layers 8 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _models(args, mesh):
    import dflash_jax as dj
    from dflash_jax import sharding
    cfg = dj.TargetConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                          num_layers=args.layers, num_heads=8, num_kv_heads=4, head_dim=args.hidden // 8,
                          max_position_embeddings=4096)
    target = dj.init_target(cfg, seed=0, dtype="float32")
    draft = dj.init_draft(dj.DraftConfig.for_target(cfg, num_layers=1, block_size=8), seed=1, target=target,
                          dtype="float32")
    sharding.shard_model(target, mesh)
    sharding.shard_model(draft, mesh)
    return target, draft


def child(args) -> None:
    import jax

    from dflash_jax import loading, sharding
    from dflash_jax.serving import multihost_serve as mh
    from dflash_jax.serving.slots import RowRequest, Slots

    loading.init_distributed()
    mesh = sharding.as_mesh("data=2,model=4")
    target, draft = _models(args, mesh)
    slots = Slots(target, draft, slots=args.slots, capacity=args.capacity, steps=args.k, attention_impl="xla",
                  step_buckets=None)
    many = args.layout == "leader"
    if many and jax.process_index() > 0:
        mh.follow(slots)
        return
    channel = mh.Channel() if many else None
    publish_s: list[float] = []
    if many:
        plain = channel.publish

        def timed(op):
            t0 = time.perf_counter()
            plain(op)
            publish_s.append(time.perf_counter() - t0)
        channel.publish = timed
        slots = mh.LeaderSlots(slots, channel)
    reqs = [RowRequest(prompt=tuple(range(1 + i, 17 + i)), max_new=args.capacity - 16 - 8 - 1)
            for i in range(args.slots)]
    slots.warmup([16], ("greedy",))
    busy = list(range(args.slots))
    if args.layout == "leader" or jax.process_count() == 1:
        slots.insert([(i, r) for i, r in enumerate(reqs)])
        step = lambda: slots.step(busy)                                                  # noqa: E731
    else:   # every process makes the same calls itself (as generate does), no ops
        for _, first, _ in slots.insert_async([(i, r) for i, r in enumerate(reqs)]):
            np.asarray(mh.readable(first))
        if args.layout == "spmd-read":       # outputs replicated and read, as LeaderSlots does
            step = lambda: [np.asarray(mh.readable(x)) for x in slots.step_async(busy)]  # noqa: E731
        else:                                # the step alone: waited for, nothing gathered
            step = lambda: jax.block_until_ready(slots.step_async(busy))                # noqa: E731
    for _ in range(3):
        step()
    publish_s.clear()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    out = dict(processes=jax.process_count(), step_ms=1e3 * float(np.median(times)),
               step_ms_min=1e3 * float(np.min(times)), k=slots.steps_for(args.slots))
    if many:
        out["publish_us"] = 1e6 * float(np.median(publish_s))
        client, rtts = channel.client, []
        for _ in range(args.pings):
            t0 = time.perf_counter()
            channel.publish(["noop"])
            while int(client.key_value_try_get(f"{mh.KEY}/ack/1")) < channel.sent:
                pass
            rtts.append(time.perf_counter() - t0)
        out["round_trip_us"] = 1e6 * float(np.median(rtts))
        out["step_op_bytes"] = len(json.dumps(["step", busy]))
        out["insert_op_bytes"] = len(json.dumps(["insert", [[0, mh.row_json(reqs[0])]]]))
        slots.stop()
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, processes: int, layout: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    port = _free_port()
    procs = []
    for i in range(processes):
        env = dict(base, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}")
        if processes > 1:
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", "--layout", layout, *sys.argv[1:]],
                                      env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"a child failed:\n{err[-3000:]}")
    line = next(ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--k", type=int, default=4, help="iterations per engine step")
    p.add_argument("--steps", type=int, default=20, help="steps timed")
    p.add_argument("--pings", type=int, default=200, help="op round trips timed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="leader", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    one, wait, read, two = (_run(args, 1, "spmd-read"), _run(args, 2, "spmd-wait"), _run(args, 2, "spmd-read"),
                            _run(args, 2, "leader"))
    print(f"pair: hidden {args.hidden}, {args.layers} target layers, vocab {args.vocab}; {args.slots} rows busy; "
          f"K = {two['k']} iterations a step; mesh data=2,model=4 on CPU")
    print("| | median | min |\n|---|---|---|")
    print(f"| step, 1 process x 8 devices | {one['step_ms']:.2f} ms | {one['step_ms_min']:.2f} ms |")
    print(f"| step, 2 processes x 4 devices, each process stepping itself, waited for | {wait['step_ms']:.2f} ms | "
          f"{wait['step_ms_min']:.2f} ms |")
    print(f"| the same, outputs replicated and read on process 0 | {read['step_ms']:.2f} ms | "
          f"{read['step_ms_min']:.2f} ms |")
    print(f"| step served: process 0 publishes the op, process 1 follows | {two['step_ms']:.2f} ms | "
          f"{two['step_ms_min']:.2f} ms |")
    print(f"| publish of the step's op (process 0) | {two['publish_us']:.0f} us | |")
    print(f"| op round trip (publish, worker acks, process 0 sees it) | {two['round_trip_us']:.0f} us | |")
    print(f"ops: a step {two['step_op_bytes']} bytes, an insert of one request of 16 prompt tokens "
          f"{two['insert_op_bytes']} bytes; publish = {100 * two['publish_us'] / 1e3 / two['step_ms']:.2f}% of the "
          f"2-process step, round trip = {100 * two['round_trip_us'] / 1e3 / two['step_ms']:.2f}%")


if __name__ == "__main__":
    main()
