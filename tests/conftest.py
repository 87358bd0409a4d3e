"""Session fixtures: checkpoints written by transformers / the reference `dflash` package, built once
per session in tmp dirs (see tests/checkpoints.py for what each one is).

- `tiny_target`: path of a random Qwen3 target of the default shapes (vocab 128, H 64, 4 layers, 4 q /
  2 kv heads, head_dim 16, untied, non-unit norms).
- `target_variants`: list of {"name", "path", "kwargs"} over tied/untied embeddings, GQA ratios 1/2/4
  and head_dim 16/32; `target_variant` is the same, parametrized (one test per variant).
- `tiny_pair`: random target (6 layers) + random draft (2 layers, S = 8, `target_layer_ids` left out of
  the config so the default formula gives [1, 3]); dict with target_path, draft_path, block_size,
  mask_token_id, target_layer_ids.
- `trained_pair`: a trained target (vocab 128) + trained draft (S = 8, taps [1, 2]); dict with
  target_path, draft_path, block_size, mask_token_id, eval_prompts, eval_max_new_tokens,
  tau {T: mean}, histogram {T: {length: count}} measured with the reference dflash_generate, ...
- `trained_small_vocab_pair`: the same at vocab 32 (for sampling tests that enumerate the target).

Set DFLASH_TEST_CACHE=/some/dir to keep the trained pairs across sessions (keyed by the source of
tests/checkpoints.py and the library versions); unset, everything is rebuilt in tmp dirs.
"""

from __future__ import annotations

import os

# Two pytest-xdist workers (.ci/run) both load libtpu for the ahead-of-time TPU compiles; without
# this the second one fails on libtpu's multi-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Set before JAX starts (here, before `import jax`), so the xdist workers and every child process the
# tests start (mesh children, CLIs, scripts) inherit them:
# - cheaper XLA:CPU code generation: the tests' programs are tiny and compile time dominates their
#   run (tests/test_qwen3_5.py on 2 cores: 67 -> 47 s; docs/perf-log.md, session 38). TPU and CUDA
#   compiles ahead of time are not affected (these flags are XLA:CPU's LLVM pipeline).
# - one persistent compilation cache for the whole run: a program compiled by one file, worker or
#   child is read back by the next (each file's programs are dropped when it ends). scripts/test.sh
#   points it at a fresh folder per run (CI is cold); a plain `pytest` keeps one per user.
#   The legacy fusion emitters (--xla_cpu_use_fusion_emitters=false) compile another 13-15% faster
#   (tests/test_fp8.py + test_speculative.py: 160 -> 137 s), same tokens; an XLA that does not know
#   a flag aborts the process, so that one is added only where this jaxlib takes it (_xla_takes).
_CHEAP_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts `flag`: known for the pinned jaxlib (tests/constraints.txt),
    else a child process tries it (once: the workers and children inherit XLA_FLAGS)."""
    import subprocess
    import sys
    from importlib import metadata
    try:
        if metadata.version("jaxlib").startswith("0.10."):
            return True
    except metadata.PackageNotFoundError:
        return False
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"],
                           env=dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu"), capture_output=True,
                           timeout=300)
    return probe.returncode == 0


if os.environ.get("DFLASH_TEST_FULL_CODEGEN") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    _add = [f for f in _CHEAP_CODEGEN if f.split("=")[0] not in _flags]
    if _LEGACY_EMITTERS.split("=")[0] not in _flags and _xla_takes(_LEGACY_EMITTERS):
        _add.append(_LEGACY_EMITTERS)
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_add]).strip()
# - one OpenMP thread for torch (the oracles) and NumPy's BLAS: the oracles' matrices are tiny, and
#   torch's OpenMP threads spin against JAX's own pool in the same process (the reference run of
#   test_random_pair_is_lossless_and_identical_to_reference[16]: 19 s with 2 threads, 1.4 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.expanduser("~"), ".cache", "dflash-jax-tests", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import hashlib
import shutil

import filelock

import jax
import pytest

jax.config.update("jax_enable_x64", False)

from tests import checkpoints as ck  # noqa: E402
from tests.timing import (  # noqa: E402,F401  (pytest reads hooks from this module's names)
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport, pytest_runtest_makereport,
    pytest_runtest_setup, pytest_sessionfinish)

# name -> write_target kwargs. GQA 4 uses 8 q / 2 kv heads (not 4 / 1) so a wrong q-head -> kv-head
# grouping shows; head_dim 32 makes q width (128) differ from hidden (64).
TARGET_VARIANTS = {
    "untied-gqa2-hd16": dict(),
    "tied-gqa2-hd16": dict(tie_word_embeddings=True),
    "untied-mha-hd16": dict(num_heads=4, num_kv_heads=4),
    "untied-gqa4-hd16": dict(num_heads=8, num_kv_heads=2),
    "untied-gqa2-hd32": dict(head_dim=32),
    "tied-gqa4-hd32": dict(tie_word_embeddings=True, num_heads=8, num_kv_heads=2, head_dim=32),
}


def _quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    _quiet_transformers()
    return ck.write_target(str(tmp_path_factory.mktemp("tiny_target")), seed=0)


@pytest.fixture(scope="session")
def target_variants(tmp_path_factory) -> list[dict]:
    _quiet_transformers()
    root = tmp_path_factory.mktemp("target_variants")
    return [dict(name=name, kwargs=kw, path=ck.write_target(str(root / name), seed=i, **kw))
            for i, (name, kw) in enumerate(TARGET_VARIANTS.items())]


@pytest.fixture(scope="session", params=list(TARGET_VARIANTS), ids=list(TARGET_VARIANTS))
def target_variant(request, target_variants) -> dict:
    return next(v for v in target_variants if v["name"] == request.param)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict:
    _quiet_transformers()
    root = tmp_path_factory.mktemp("tiny_pair")
    tp = ck.write_target(str(root / "target"), num_layers=6, seed=1)
    dp = ck.write_draft(str(root / "draft"), tp, num_layers=2, block_size=8, seed=2)
    return dict(target_path=tp, draft_path=dp, block_size=8, mask_token_id=127,
                target_layer_ids=ck.default_target_layer_ids(6, 2))


@pytest.fixture(scope="session")
def cli_models(tmp_path_factory) -> tuple[str, str]:
    """(target_path, draft_path): test_cli.py's float32 target at vocab 320 with its byte-level BPE
    tokenizer, chat template and generation_config eos ids, and a reference-written draft (S = 8).
    Built once for test_cli.py, test_user_errors.py and test_serve.py, which only read it."""
    from transformers import GenerationConfig

    from tests import test_cli as tc

    _quiet_transformers()
    root = tmp_path_factory.mktemp("cli")
    target, draft = str(root / "target"), str(root / "draft")
    tc._write_target(target)
    tc.write_tokenizer(target)
    GenerationConfig(eos_token_id=[tc.IM_END, tc.ENDOFTEXT]).save_pretrained(target)
    tc._write_draft(draft, target)
    return target, draft


def _build_pair(tmp_path_factory, name: str, spec: dict) -> dict:
    _quiet_transformers()
    root = str(tmp_path_factory.mktemp(name))
    cache = os.environ.get("DFLASH_TEST_CACHE")
    if not cache:
        ck.build_trained_pair(root, **spec)
        return ck.read_pair(root)
    import torch
    import transformers

    with open(ck.__file__, "rb") as f:
        key = hashlib.sha256(f.read() + repr((spec, torch.__version__, transformers.__version__)).encode())
    cached = os.path.join(cache, f"{name}-{key.hexdigest()[:16]}")
    os.makedirs(cache, exist_ok=True)
    # one build per run: the second xdist worker waits for the first's instead of training its own
    with filelock.FileLock(cached + ".lock"):
        if not os.path.exists(os.path.join(cached, "pair.json")):
            tmp = cached + f".tmp{os.getpid()}"
            ck.build_trained_pair(tmp, **spec)
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(tmp, cached)
    shutil.copytree(cached, root, dirs_exist_ok=True)
    return ck.read_pair(root)


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory) -> dict:
    return _build_pair(tmp_path_factory, "trained_pair", ck.TRAINED_PAIR)


@pytest.fixture(scope="session")
def trained_small_vocab_pair(tmp_path_factory) -> dict:
    return _build_pair(tmp_path_factory, "trained_small_vocab_pair", ck.SMALL_VOCAB_PAIR)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test file's compiled programs when it ends: the whole suite in one process
    otherwise keeps hundreds of executables alive (a full run once ended in a crash inside XLA's
    compiler late in the run)."""
    yield
    from dflash_jax import decode
    decode.clear_compiled()
    jax.clear_caches()
