"""Which kernels a generation program uses: one frozen, hashable value, part of the compile key.

    from dflash_jax import KernelConfig, generate
    generate(target, draft, prompts, kernels=KernelConfig(attention="pallas", fused_layer=False))

Every setting that changes the compiled program lives here and nowhere else (no environment
variables): two configs in one process compile two programs. `resolve()` turns "auto" into the
concrete path of a backend and fills the GPU tuning from the device; the loop, the layers and the
sampler only ever see resolved configs. The measurements behind the defaults below ("the table"):
docs/perf-log.md, "Kernel configuration table (moved from kernel_config.py)".

attention (the backend of every attention in the target and the draft):
  "auto"        TPU/GPU -> the Pallas kernel of that backend, CPU -> "xla"
  "xla"         the jnp reference (queries chunked for long prefill)
  "pallas"      the Pallas kernel of the default backend; on CPU the TPU kernel in interpret mode
  "pallas_tpu"  force the TPU kernel: ahead-of-time compiles for a TPU from a CPU host
  "pallas_gpu"  force the Triton GPU kernel: jax.export(..., platforms=["cuda"]) from a CPU host
  resolved only (tests): "pallas_interpret" (the TPU kernel interpreted on CPU),
  "pallas_gpu_interpret" (the whole GPU path, fused kernels included, interpreted on CPU).

The GPU path's other kernels (ignored, and reset by resolve(), on the other paths):
  fused_layer       q/k norm + RoPE + cache writes as one kernel and the residual add + RMSNorm as
                    another, for blocks of up to 64 tokens (decode, verify, the draft block)
  sampling_kernels  top-k / top-p threshold search as Pallas kernels (count passes and the
                    top-k gather) instead of XLA reductions
  n_sms             the GPU's streaming multiprocessors (the attention kernel's split counts fill
                    them); None: read from the device, else GPU_TUNING by device kind
  xla_kv_chunk      (the XLA path) keys per chunk of the short-block attention's loop, which stops
                    at the longest row's k_end, so unused capacity costs nothing; None (default):
                    from the cache's capacity (pallas_kernels.attention.kv_chunk_for: 128 up to
                    2,048 rows, 256 up to 8,192, 512 beyond); 0: dense over the whole capacity
                    (benchmarks compare against it)
  attention_tuning  overrides of pallas_kernels.attention.gpu.default_config, as (name, value)
                    pairs (benchmarks' on-device A/B of launch settings)
  moe_tuning        overrides of the one-token MoE path's gmm launches (the GPU gmm's `gmm_rows`), as
                    (name, value) pairs: {gate_up,down}_{bn,bk,num_warps,num_stages} (A/Bs)

moe_gmm (the grouped matmul of MoE targets' expert layers, pallas_kernels/moe):
  "auto"        TPU -> "pallas_tpu", GPU -> "pallas_gpu", CPU -> "xla" (on the H200 the GPU kernel
                measured faster than ragged_dot at every token count of a Coder-30B-A3B expert layer
                and in a 12-layer verify forward: the table)
  "xla"         jax.lax.ragged_dot (portable; on GPU it streams every expert whatever the routing)
  "pallas"      the Pallas kernel of the backend, reading only the experts some token chose: TPU
                -> "pallas_tpu", GPU -> "pallas_gpu", CPU -> the TPU kernel interpreted
  "pallas_tpu"  force the TPU kernel (ahead-of-time compiles for a TPU from a CPU host)
  "pallas_gpu"  force the Triton GPU kernel (pallas_kernels/moe/gpu.py; a CUDA export from a CPU host)
  resolved only (tests): "pallas_tpu_interpret", "pallas_gpu_interpret" (a kernel on CPU)
moe_route         with the GPU gmm (pallas_gpu, or interpreted): the router's softmax, top-k,
                  renormalisation and the choices' ascending order as one Triton kernel
                  (pallas_kernels/moe/gpu.route) instead of XLA's four or five launches; False: XLA's
                  ops (A/Bs). Off, whatever it says, on the other gmm paths.

gdn (the Gated DeltaNet layers' short blocks, decode and verify, of Qwen3.5 hybrid targets):
  "auto"        "pallas_gpu" on GPU (measured faster than "xla" on the H200 with gdn_block_v 32 at
                Qwen3.5-9B shapes, B = 1 and B = 32: the table), "xla" elsewhere
  "xla"         models/gated_delta.py's XLA forms (the verify form the target's config names)
  "pallas"      the fused Triton block kernel and the commit's fold kernel (pallas_kernels/
                gated_delta) on GPU; on CPU the same kernels interpreted; on TPU "xla"
  "pallas_gpu"  force the Triton kernel (a CUDA export from a CPU host)
  resolved only (tests): "pallas_gpu_interpret"
gdn_block_v       value dims per kernel program (default 32; 0 or >= the head's dv: all of a head's,
                  the gated output norm fused into the kernel; smaller: more programs, the norm
                  left to XLA). 32 measured faster than the whole head (128) at every H200 point
                  (the table)

while_graphs (CUDA only; resolve() sets it False on every other backend, where it means nothing):
  None (default) -> True on CUDA: the program is compiled with XLA's CUDA-graph command buffers
                    extended to while loops and conditionals (compile option
                    xla_gpu_enable_command_buffer = XLA's default types + WHILE, CONDITIONAL), so a
                    loop whose trip count the device decides (the one-shot generation, the adaptive
                    widths' loops, the slot engine's adaptive steps) runs as a graph with a device-side
                    condition instead of the host reading each iteration's predicate. Measured
                    faster on the H200 at B = 64 and 128, a tie for plain decoding at B = 1, greedy
                    tokens unchanged (the table)
  False             XLA's own command-buffer types (a while loop's predicate read by the host)

The TPU path's (ignored, and reset by resolve(), elsewhere):
  tpu_mlp           the SwiGLU MLP of blocks up to 1024 rows as one Pallas kernel
                    (pallas_kernels/fused_layer/tpu_mlp.py) that keeps the [rows, I] intermediate in
                    VMEM instead of XLA's two matmul fusions (docs/tpu-bytes.md). None (default):
                    on for pallas_tpu, off for pallas_interpret; True/False force it
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["KernelConfig", "ATTENTION_BACKENDS", "GPU_TUNING"]

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")
# What resolve() leaves in `attention`: the concrete path.
RESOLVED_ATTENTION = ("xla", "pallas_tpu", "pallas_gpu", "pallas_interpret", "pallas_gpu_interpret")
GPU_PATHS = ("pallas_gpu", "pallas_gpu_interpret")
TPU_PATHS = ("pallas_tpu", "pallas_interpret")

# Tuning by GPU device kind (a substring of jax's device_kind), for a program built where no GPU
# can be asked (a CUDA export from a CPU host, the interpreter). "default" is a Hopper-class part.
GPU_TUNING = {
    "H200": dict(n_sms=132),
    "H100": dict(n_sms=132),
    "A100": dict(n_sms=108),
    "L4": dict(n_sms=58),
    "default": dict(n_sms=132),
}
MOE_GMM = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu")
RESOLVED_MOE_GMM = ("xla", "pallas_tpu", "pallas_tpu_interpret", "pallas_gpu", "pallas_gpu_interpret")
GDN = ("auto", "xla", "pallas", "pallas_gpu")
RESOLVED_GDN = ("xla", "pallas_gpu", "pallas_gpu_interpret")
MOE_TUNING_NAMES = tuple(f"{p}_{n}" for p in ("gate_up", "down") for n in ("bn", "bk", "num_warps", "num_stages"))
ATTENTION_TUNING_NAMES = ("block_t", "block_k", "kv_splits", "num_warps", "num_stages", "min_chunk",
                          "merge_kernel", "merge_rows", "merge_cols")


def _gpu_tuning(device_kind: str | None) -> dict:
    for kind, tuning in GPU_TUNING.items():
        if device_kind and kind != "default" and kind.lower() in device_kind.lower():
            return tuning
    return GPU_TUNING["default"]


# XLA's default command-buffer types (jaxlib 0.10.2's DebugOptions defaults, read on this project's
# CPU host; jaxlib's private proto view that shows them crashed a process with libtpu loaded and
# the H200's jax 0.11.2, so they are not read at run time), to which while_graphs adds WHILE (the
# set measured on the H200: docs/perf-log.md).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION", "CONDITIONAL")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    attention: str = "auto"
    fused_layer: bool = True
    sampling_kernels: bool = True
    n_sms: int | None = None
    attention_tuning: tuple = ()     # ((name, int), ...), sorted by resolve()
    xla_kv_chunk: int | None = None  # None: from the capacity (module doc)
    tpu_mlp: bool | None = None      # None: on for pallas_tpu (off in the interpreter, where it is slow)
    moe_gmm: str = "auto"            # MoE experts' grouped matmul (MOE_GMM; module doc)
    moe_route: bool = True           # the GPU gmm path's routing kernel (module doc)
    moe_tuning: tuple = ()           # ((name, int), ...): the one-token gmm launches (module doc)
    gdn: str = "auto"                # GDN layers' short blocks (GDN; module doc)
    gdn_block_v: int = 32            # value dims per GDN kernel program (0: the head's dv)
    while_graphs: bool | None = None  # CUDA: while loops / conditionals in command buffers (module doc)

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS + RESOLVED_ATTENTION:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_BACKENDS}")
        if self.moe_gmm not in MOE_GMM + RESOLVED_MOE_GMM:
            raise ValueError(f"moe_gmm={self.moe_gmm!r}; expected one of {MOE_GMM}")
        if self.gdn not in GDN + RESOLVED_GDN:
            raise ValueError(f"gdn={self.gdn!r}; expected one of {GDN}")
        if self.while_graphs not in (None, True, False):
            raise ValueError(f"while_graphs must be None (auto), True or False, got {self.while_graphs!r}")
        if not isinstance(self.gdn_block_v, int) or self.gdn_block_v < 0:
            raise ValueError(f"gdn_block_v must be an integer >= 0 (0: the head's value dims), got {self.gdn_block_v!r}")
        if self.xla_kv_chunk is not None and (not isinstance(self.xla_kv_chunk, int) or self.xla_kv_chunk < 0):
            raise ValueError(f"xla_kv_chunk must be None (from the capacity) or an integer >= 0 (0: dense), "
                             f"got {self.xla_kv_chunk!r}")
        if self.n_sms is not None and (not isinstance(self.n_sms, int) or self.n_sms < 1):
            raise ValueError(f"n_sms must be a positive integer or None, got {self.n_sms!r}")
        tuning = dict(self.attention_tuning)
        bad = set(tuning) - set(ATTENTION_TUNING_NAMES)
        if bad:
            raise ValueError(f"attention_tuning: unknown settings {sorted(bad)}; "
                             f"expected names from {ATTENTION_TUNING_NAMES}")
        bad = set(dict(self.moe_tuning)) - set(MOE_TUNING_NAMES)
        if bad:
            raise ValueError(f"moe_tuning: unknown settings {sorted(bad)}; expected names from {MOE_TUNING_NAMES}")

    @classmethod
    def parse_tuning(cls, spec: str) -> tuple:
        """"block_k=128,num_warps=8" -> (("block_k", 128), ("num_warps", 8)) (for CLI flags)."""
        out = []
        for item in filter(None, (x.strip() for x in spec.split(","))):
            name, _, val = item.partition("=")
            out.append((name.strip(), int(val)))
        return tuple(out)

    def resolve(self, backend: str | None = None, device=None) -> "KernelConfig":
        """The concrete config for `backend` (default: jax.default_backend()): "auto"/"pallas"
        chosen, the GPU-only settings off on the other paths, n_sms from `device` (default: the
        first device of the backend) or GPU_TUNING. Idempotent; equal programs give equal configs."""
        backend = backend or jax.default_backend()
        on_tpu, on_gpu = backend == "tpu", backend in ("gpu", "cuda", "rocm")
        attention = self.attention
        if attention == "auto":
            attention = "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "xla"
        elif attention == "pallas":
            attention = "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "pallas_interpret"
        moe_gmm = self.moe_gmm
        if moe_gmm == "auto":
            moe_gmm = "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "xla"
        elif moe_gmm == "pallas":
            moe_gmm = "pallas_tpu" if on_tpu else "pallas_gpu" if on_gpu else "pallas_tpu_interpret"
        gdn = self.gdn
        if gdn == "auto":
            gdn = "pallas_gpu" if on_gpu else "xla"
        elif gdn == "pallas":
            gdn = "pallas_gpu" if on_gpu else "xla" if on_tpu else "pallas_gpu_interpret"
        gdn_block_v = self.gdn_block_v if gdn != "xla" else 0
        gpu_gmm = moe_gmm in ("pallas_gpu", "pallas_gpu_interpret")    # the routing kernel and tuning go with it
        moe_route = bool(self.moe_route) and gpu_gmm
        moe_tuning = tuple(sorted(dict(self.moe_tuning).items())) if gpu_gmm else ()
        while_graphs = on_gpu and (self.while_graphs is None or bool(self.while_graphs))
        if attention not in GPU_PATHS:
            return KernelConfig(while_graphs=while_graphs, gdn=gdn, gdn_block_v=gdn_block_v, attention=attention, fused_layer=False, sampling_kernels=False,
                                xla_kv_chunk=self.xla_kv_chunk if attention == "xla" else None,
                                tpu_mlp=(attention == "pallas_tpu" if self.tpu_mlp is None
                                         else bool(self.tpu_mlp) and attention in TPU_PATHS),
                                moe_gmm=moe_gmm, moe_route=moe_route, moe_tuning=moe_tuning)
        n_sms = self.n_sms
        if n_sms is None:
            if device is None and on_gpu:
                device = jax.devices()[0]
            is_gpu = device is not None and device.platform in ("gpu", "cuda", "rocm")
            n_sms = getattr(device, "core_count", None) if is_gpu else None
            if not isinstance(n_sms, int) or n_sms < 1:
                n_sms = _gpu_tuning(device.device_kind if is_gpu else None)["n_sms"]
        return KernelConfig(attention=attention, fused_layer=bool(self.fused_layer),
                            sampling_kernels=bool(self.sampling_kernels), n_sms=int(n_sms),
                            attention_tuning=tuple(sorted(dict(self.attention_tuning).items())),
                            xla_kv_chunk=None, moe_gmm=moe_gmm, moe_route=moe_route, moe_tuning=moe_tuning, gdn=gdn, gdn_block_v=gdn_block_v,
                            while_graphs=while_graphs)

    def compiler_options(self) -> dict:
        """The XLA compile options of a program built with this (resolved) config."""
        if not self.while_graphs:
            return {}
        return {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_TYPES + ("WHILE",))}

    # ---- what the resolved config means for the code that traces the program

    @property
    def gpu(self) -> bool:
        """The Triton GPU path (compiled, or interpreted on CPU)."""
        return self.attention in GPU_PATHS

    @property
    def interpret(self) -> bool:
        """Whether the Pallas kernels of this path run in the interpreter (CPU tests)."""
        return self.attention in ("pallas_interpret", "pallas_gpu_interpret")

    @property
    def fused(self) -> bool:
        """The fused layer kernels (prologue, add + RMSNorm) on this path."""
        return self.gpu and self.fused_layer

    @property
    def search_kernels(self) -> bool:
        """Sampling's threshold search as Pallas kernels on this path."""
        return self.gpu and self.sampling_kernels

    def gmm_rows_tiles(self, which: str) -> dict:
        """Keyword arguments of the one-token path's `gmm_rows` launch `which` ("gate_up", "down")."""
        return {k[len(which) + 1:]: v for k, v in self.moe_tuning if k.startswith(which + "_")}

    def gpu_attention_tuning(self) -> dict:
        """Keyword arguments for the GPU attention kernel: n_sms and the overrides."""
        return dict(self.attention_tuning, n_sms=self.n_sms)


XLA = KernelConfig(attention="xla").resolve("cpu")


def resolved(kernels: "KernelConfig | str | None") -> KernelConfig:
    """A resolved config from a KernelConfig, an attention backend's name, or None (the XLA path)."""
    if kernels is None:
        return XLA
    if isinstance(kernels, str):
        kernels = KernelConfig(attention=kernels)
    if not isinstance(kernels, KernelConfig):
        raise TypeError(f"kernels must be a KernelConfig, got {type(kernels).__name__}")
    return kernels.resolve()


def kernels_from(kernels: KernelConfig | None, attention_impl: str | None) -> KernelConfig:
    """The (unresolved) config of a call that takes both `kernels=` and the older
    `attention_impl=`: either alone, or both when they agree."""
    if attention_impl is not None and not isinstance(attention_impl, str):
        raise ValueError(f"attention_impl must be a string, got {attention_impl!r}")
    if attention_impl is not None and attention_impl not in ATTENTION_BACKENDS + RESOLVED_ATTENTION:
        raise ValueError(f"attention_impl={attention_impl!r}; expected one of {ATTENTION_BACKENDS}")
    if kernels is None:
        return KernelConfig(attention=attention_impl or "auto")
    if not isinstance(kernels, KernelConfig):
        raise TypeError(f"kernels must be a KernelConfig, got {type(kernels).__name__}")
    if attention_impl is not None and attention_impl != kernels.attention:
        raise ValueError(f"attention_impl={attention_impl!r} disagrees with kernels.attention="
                         f"{kernels.attention!r}: give one of them")
    return kernels
