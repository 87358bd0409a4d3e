"""The generate CLI on many CPU devices, in subprocesses: `--mesh data=2,model=4` on 8 virtual
devices of one process, bad --mesh values, and a real two-process run (jax.distributed over
localhost, 4 virtual devices each, JAX's gloo CPU collectives) with one mesh over all 8 devices.
Each run gives the same greedy tokens as one device; only process 0 prints. All slow (each child
compiles the loop)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _env(devices: int, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "JAX_", "XLA_", "DFLASH_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)
    return env


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target (8 q / 2 kv heads: the fused layout splits over model=4) and its draft."""
    from tests.checkpoints import write_draft, write_target
    root = tmp_path_factory.mktemp("multihost")
    t = write_target(str(root / "t"), num_heads=8, num_kv_heads=2, head_dim=8)
    return t, write_draft(str(root / "d"), t, num_layers=2, block_size=4)


def _args(pair, *extra, width: str = "block"):
    """The CLI's arguments; whole blocks unless `width` says otherwise (acceptance lengths compare only
    between runs that verify the same widths: "auto" chooses from each run's own timings)."""
    return ["--model", pair[0], "--draft", pair[1], "--dtype", "float32", "--attention", "xla",
            "--prompt-ids", "1,2,3,4", "--max-new-tokens", "12", "--verify-width", width, "--json", *extra]


def _cmd(pair, *extra, width: str = "block"):
    """The CLI's command (`_args` after `python -m dflash_jax.generate`)."""
    return [sys.executable, "-m", "dflash_jax.generate", *_args(pair, *extra, width=width)]


def _result(stdout: str) -> dict | None:
    """The --json line (native libraries may print other lines on stdout), or None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) <= 1, stdout
    return json.loads(lines[0]) if lines else None


def _run(cmd, env, timeout=600):
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return _result(r.stdout)


@pytest.fixture(scope="module")
def one_device(pair):
    return _run(_cmd(pair), _env(1))


def test_mesh_flag_gives_the_tokens_of_one_device(pair, one_device):
    many = _run(_cmd(pair, "--mesh", "data=2,model=4"), _env(8))
    assert many["tokens"] == one_device["tokens"] and len(many["tokens"]) == 12
    assert many["acceptance_lengths"] == one_device["acceptance_lengths"]


BAD_MESH = [
    ("data=3,model=4", "--mesh data=3,model=4: mesh data=3,model=4 needs 12 devices, there are 8"),
    ("data=2,model=2", "--mesh data=2,model=2: mesh data=2,model=2 needs 4 devices, there are 8"),
    ("rows=2,model=4", "--mesh rows=2,model=4: mesh 'rows=2,model=4': expected 'data=N,model=M'"),
    ("data=0,model=8", "axis 'data' must be a positive integer"),
]

# the CLI's main once per bad value, in one process (`python -m dflash_jax.generate` is sys.exit(main())):
# its exit code and what it wrote to stderr, per value
_BAD_MESH_RUNS = """
import contextlib, io, json, sys, traceback
from dflash_jax.cli.generate import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def test_bad_mesh_is_a_one_line_cli_error(pair):
    """Each bad --mesh value: the CLI exits 2 with a one-line error, no traceback. One process runs
    the CLI's main for the four values (a CLI start each paid ~3.5 s of CI)."""
    argvs = [_args(pair, "--mesh", spec) for spec, _ in BAD_MESH]
    r = subprocess.run([sys.executable, "-c", _BAD_MESH_RUNS, json.dumps(argvs)], env=_env(8), cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("[[")][-1])
    assert len(runs) == len(BAD_MESH)
    for (spec, message), (code, stderr) in zip(BAD_MESH, runs):
        assert code == 2, (spec, stderr[-3000:])
        err = stderr.strip().splitlines()
        assert message in err[-1] and "Traceback" not in stderr, (spec, stderr[-3000:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_mesh_over_eight_devices(pair, one_device):
    """jax.distributed.initialize from the environment (the CLI's init_distributed), 2 processes x
    4 CPU devices, mesh data=2,model=4 over all 8: the batch rows and the vocab/heads both span the
    two processes. Process 0 prints the result, process 1 nothing. The CLI's default verify width,
    "auto": both processes choose from process 0's measured costs (loop.width_costs), so the program's
    replicas take the same widths, and the tokens are one device's (the acceptance lengths are the
    chosen widths', not the block's)."""
    port = _free_port()
    procs = [subprocess.Popen(_cmd(pair, "--mesh", "data=2,model=4", width="auto"), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-4000:]
            outs.append((out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    first, second = (_result(o) for o, _ in outs)
    assert first is not None and second is None, outs[1][0][-2000:]
    assert "[dflash]" not in outs[1][1]                       # process 1's Python output goes nowhere
    assert first["tokens"] == one_device["tokens"] and first["verify_width"] == "auto"
    assert all(1 <= a <= 4 for a in first["acceptance_lengths"])
