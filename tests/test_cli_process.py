"""The CLI as a user runs it, in its own process: Ctrl-C during a generation, and a plain
`pip install -e .` (no test extra) running a chat prompt. Both slow (subprocesses; the second
installs the package from PyPI into a fresh venv, with pip's cache)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import test_cli as tc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "JAX_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **extra)
    return env


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny Qwen3 with a tokenizer and chat template, and room for a very long generation."""
    from tests.checkpoints import write_target
    path = str(tmp_path_factory.mktemp("proc") / "target")
    write_target(path, vocab_size=tc.VOCAB, max_position_embeddings=1 << 20)
    tc.write_tokenizer(path)
    return path


@pytest.mark.slow
def test_sigint_stops_the_generation_keeps_the_output_and_exits_130(chat_target):
    cmd = [sys.executable, "-m", "dflash_jax.generate", "--model", chat_target, "--draft", "none",
           "--dtype", "float32", "--max-new-tokens", "500000", "--ignore-eos", "--prompt-ids", "1,2,3"]
    # the child as a terminal's foreground job gets it: Ctrl-C not ignored. A child inherits an ignored
    # SIGINT (and Python then installs no KeyboardInterrupt): CI's session 31 run had a pytest worker
    # left so, and this test's child ran on. A handled SIGINT in this process is the default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    finally:
        signal.signal(signal.SIGINT, previous)
    out = bytearray()
    started = threading.Event()

    def read():
        while chunk := proc.stdout.read1(4096):
            out.extend(chunk)
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "no output within 120 s"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    err = proc.stderr.read().decode()
    assert rc == 130, err
    assert elapsed < 5, f"took {elapsed:.1f} s to stop"
    tokens = out.decode().split()
    assert 1 <= len(tokens) < 500000 and all(t.isdigit() for t in tokens)  # the partial output, kept
    assert "interrupted" in err and "Traceback" not in err


@pytest.mark.slow
def test_plain_install_runs_a_chat_prompt(chat_target, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # --no-compile: byte-compiling every installed package was half of this test (CI time)
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--no-compile", "-e", REPO], capture_output=True,
                         text=True, timeout=1800)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in _env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run([py, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True, env=env)
    assert probe.stdout.strip() == "True", "the fresh venv must not have torch (the test extra)"
    run = subprocess.run([py, "-m", "dflash_jax.generate", "--model", chat_target, "--draft", "none",
                          "--dtype", "float32", "--max-new-tokens", "8", "What is 17 * 23?"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "new tokens" in run.stderr and "jinja2" not in run.stderr
    assert "PyTorch was not found" not in run.stderr
