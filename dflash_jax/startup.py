"""Ctrl-C while a command starts (`python -m dflash_jax.generate / benchmark / serve / train`).

Before a command's own Ctrl-C handling begins (generate's stop-after-this-iteration, train's save),
the interpreter is importing jax and transformers, loading weights or compiling: a KeyboardInterrupt
there surfaced as a 40-line traceback from inside an import, or was swallowed by a garbage-collector
callback ("Exception ignored in: _xla_gc_callback") and the run went on. So from the package's
first line, when it is imported for one of these commands, Ctrl-C ends the process at once with
one line and exit code 130 (nothing is half-written then); a command hands Ctrl-C back to Python
(`interrupt_as_exception`) where it handles KeyboardInterrupt itself.

This module imports nothing heavy: it runs before jax is imported.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["COMMANDS", "EXIT_INTERRUPTED", "is_command_run", "exit_on_interrupt", "interrupt_as_exception"]

COMMANDS = ("dflash_jax.generate", "dflash_jax.benchmark", "dflash_jax.serve", "dflash_jax.train",
            "dflash_jax.train.__main__")
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C stopped


def is_command_run() -> bool:
    """This interpreter was started as `python [options] -m <one of COMMANDS>`."""
    argv = list(getattr(sys, "orig_argv", ()))
    for i, a in enumerate(argv[1:], 1):
        if a == "-m":
            return i + 1 < len(argv) and argv[i + 1] in COMMANDS
        if a.startswith("-m"):
            return a[2:] in COMMANDS
        if not a.startswith("-"):  # a script or -c: not a module run
            return False
    return False


def _exit_interrupted(signum, frame) -> None:
    try:
        os.write(2, b"\n[dflash] interrupted\n")
    finally:
        os._exit(EXIT_INTERRUPTED)


def exit_on_interrupt() -> None:
    """Ctrl-C ends the process at once: one line on stderr, exit 130. Only where Python's own
    handler is in place (a background job's ignored SIGINT stays ignored)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)


def interrupt_as_exception() -> None:
    """Ctrl-C raises KeyboardInterrupt again, for a command that handles it from here on."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
