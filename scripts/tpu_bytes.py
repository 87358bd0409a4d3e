#!/usr/bin/env python
"""Where the bytes of a compiled TPU program go: its optimized HLO's ops by bytes accessed, named.

    python scripts/tpu_bytes.py --chip v6e                      # Qwen3-8B DFlash iteration, B=1, C=1024
    python scripts/tpu_bytes.py --chip v6e --plain --batch 32   # the plain step at B=32
    python scripts/tpu_bytes.py --chip v6e --layers 4 --draft-layers 1 --top 30   # small, ~10 s
    python scripts/tpu_bytes.py --hlo FILE.hlo                   # an earlier --save-hlo, no compiling
    python scripts/tpu_bytes.py --chip v5e --quantize int8 [--no-tpu-mlp]     # the int8 target (A/B the MLP kernel)

It compiles one loop iteration (dflash_jax.decode.lower_iteration, the Mosaic attention kernel) for one
chip of a TPU topology on this CPU host (see docs/benchmarks-howto.md for the ahead-of-time set-up), reads `compiled.as_text()` and
charges every top-level op its operands + results, the way XLA's HloCostAnalysis does:
  * a fusion's operand that the fused computation only slices (slice / dynamic-slice) costs the slice;
  * a fusion whose root is a dynamic-update-slice into a parameter (in place) costs the update, not
    the buffer, on both sides;
  * parameters, constants, bitcasts, tuples and get-tuple-element cost nothing; an async op
    (copy-start/done, slice-start/done) is charged at its start: a slice its read and write, a copy
    four times its size (as the compiler's total shows it counts them).
Each op is grouped by its named scope (target_layerN, draft_layerN, draft_lm_head, verify, accept,
commit) and its bytes split by kind: the operand that is a weight (traced back through bitcasts,
slices and copies to an entry parameter) is "weights" (the LM head its own kind), a KV-cache operand
"kv read", a result written into a cache "kv write", copies/transposes "copies", the accept and
commit scopes "sampling", the rest "activations". The total is printed next to the compiler's
cost_analysis()['bytes accessed'] (TOTAL CHECK), so the breakdown is the compiler's own sum, named.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1,
               "token": 0}
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id",
        "replica-id"}
# async pairs: the start carries the transfer, the done is free
ASYNC_DONE = {"copy-done", "slice-done", "all-gather-done", "all-reduce-done", "collective-permute-done",
              "async-done", "send-done", "recv-done"}
KINDS = ("weights", "lm_head", "kv_read", "kv_write", "copies", "sampling", "activations")

_ARRAY = re.compile(r"\b(pred|[sufb]f?\d+|bf16|f8e4m3fn|f8e5m2|token)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")


def _elems(s: str) -> list:
    """The arrays of a shape string as (bytes, in_hbm): a layout with S(n), n > 0, is another memory
    space (S(1) VMEM, S(2) SMEM, ...), not HBM."""
    out = []
    for m in re.finditer(r"\b(pred|[sufb]f?\d+|bf16|f8e4m3fn|f8e5m2|token)\[([\d,]*)\](\{[^}]*\})?", s):
        dt, dims, lay = m.group(1), m.group(2), m.group(3) or ""
        if dt not in DTYPE_BYTES:
            continue
        size = 1
        for d in dims.split(","):
            if d:
                size *= int(d)
        out.append((int(size * DTYPE_BYTES[dt]), not re.search(r"S\([1-9]\d*\)", lay)))
    return out


def hbm_bytes(s: str) -> int:
    return sum(b for b, h in _elems(s) if h)


def shape_bytes(s: str) -> int:
    """Bytes of an HLO shape string (array or tuple), layouts ignored (logical sizes, as the cost model)."""
    n = 0
    for dt, dims in _ARRAY.findall(s):
        if dt not in DTYPE_BYTES:
            continue
        size = 1
        for d in dims.split(","):
            if d:
                size *= int(d)
        n += size * DTYPE_BYTES[dt]
    return int(n)


def _split_type_and_rest(text: str):
    """'bf16[2,3]{1,0} opcode(...), attrs' -> ('bf16[2,3]{1,0}', 'opcode(...), attrs')."""
    text = text.strip()
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[:i + 1], text[i + 1:].strip()
    i = text.find(" ")
    return text[:i], text[i + 1:].strip()


def _operands(rest: str):
    """opcode and the %names in its operand list."""
    i = rest.find("(")
    op = rest[:i].strip()
    depth, j = 0, i
    for j in range(i, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            break
    return op, rest[i + 1:j], rest[j + 1:]


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list
    attrs: str
    root: bool = False
    args: str = ""

    @property
    def param_num(self) -> int:
        return int(self.args)

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1).replace("\\'", "'") if m else ""

    @property
    def calls(self) -> list:
        return re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%([\w.\-]+)", self.attrs)

    def attr(self, key: str) -> str | None:
        m = re.search(key + r'="([^"]*)"', self.attrs)
        return m.group(1) if m else None

    def attr_block(self, key: str) -> str:
        """The text of a `key={...}` attribute (nested braces), "" when absent."""
        j = self.attrs.find(key + "={")
        if j < 0:
            return ""
        j += len(key) + 1
        depth = 0
        for e in range(j, len(self.attrs)):
            depth += self.attrs[e] == "{"
            depth -= self.attrs[e] == "}"
            if depth == 0:
                return self.attrs[j:e + 1]
        return self.attrs[j:]


def parse_hlo(text: str):
    """{computation: [Instr]}, entry name, entry parameter names by number."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, rest = _split_type_and_rest(m.group(3))
        op, args, attrs = _operands(rest)
        comps[cur].append(Instr(m.group(2), shape, op, re.findall(r"%([\w.\-]+)", args), attrs,
                                root=bool(m.group(1)), args=args))
    return comps, entry



# ---------------------------------------------------------------------------------------------
# charging ops
# ---------------------------------------------------------------------------------------------

_LAYER = re.compile(r"(target_layer\d+|draft_layer\d+|draft_lm_head)")
_SCOPES = ("verify", "draft", "accept", "commit")
_FOLLOW = {"bitcast", "copy-done", "slice-done", "copy-start", "slice-start", "reshape", "copy", "transpose",
           "get-tuple-element"}


class Program:
    """The entry computation of an optimized HLO module, with the helpers that name its bytes."""

    def __init__(self, text: str | None = None, *, comps=None, comp: str | None = None, tuple_sources=None,
                 group: str | None = None):
        if comps is None:
            comps, comp = parse_hlo(text)
        self.comps, self.entry = comps, comp
        self.instrs = self.comps[comp]
        self.by = {i.name: i for i in self.instrs}
        # a while body's parameter is the loop tuple: element k comes from the loop's k-th input
        self.tuple_sources = tuple_sources
        self.default_group = group

    def sub(self, while_instr: Instr, comp: str, operand: int = 0) -> "Program":
        """The body (or condition) of a while loop, its tuple parameter traced to the loop's inputs
        (a conditional's branch: operand = 1 + the branch index, its operand tuple)."""
        t = self.by.get(while_instr.operands[operand]) if len(while_instr.operands) > operand else None
        srcs = [self.source(o) for o in t.operands] if t is not None and t.op == "tuple" else None
        return Program(comps=self.comps, comp=comp, tuple_sources=srcs, group=self.group(while_instr))

    def source(self, name: str, depth: int = 0):
        """The entry parameter an operand comes from (through bitcasts, copies, async slices and
        ConcatBitcast), as its metadata op_name ("ts['layers'][3]['qkv'].value", "s.target_cache.k[3]"),
        or None for a computed value."""
        i = self.by.get(name)
        while i is not None and depth < 64:
            depth += 1
            if i.op == "parameter":
                return i.op_name or i.name
            if (i.op == "get-tuple-element" and self.tuple_sources is not None and i.operands
                    and self.by.get(i.operands[0]) is not None and self.by[i.operands[0]].op == "parameter"):
                k = int(re.search(r"index=(\d+)", i.attrs).group(1))
                return self.tuple_sources[k] if k < len(self.tuple_sources) else None
            if i.op == "get-tuple-element" and i.operands and getattr(self.by.get(i.operands[0]), "op", "") == "while":
                # a loop's result k is its state element k: the loop's k-th input, updated in place
                t = self.by.get(self.by[i.operands[0]].operands[0])
                k = int(re.search(r"index=(\d+)", i.attrs).group(1))
                if t is None or t.op != "tuple" or k >= len(t.operands):
                    return None
                i = self.by.get(t.operands[k])
                continue
            if i.op == "get-tuple-element" and i.operands and getattr(self.by.get(i.operands[0]), "op", "") == "custom-call":
                # an in-place kernel's result k is the operand it is aliased to (the cache row write)
                k = int(re.search(r"index=(\d+)", i.attrs).group(1))
                cc = self.by[i.operands[0]]
                m = re.search(r"\{%d\}:\s*\((\d+)," % k, cc.attr_block("output_to_operand_aliasing"))
                if not m:
                    return None
                i = self.by.get(cc.operands[int(m.group(1))])
                continue
            if i.op in _FOLLOW or (i.op == "custom-call" and i.attr("custom_call_target") == "ConcatBitcast"):
                if not i.operands:
                    return None
                i = self.by.get(i.operands[0])
                continue
            if i.op == "dynamic-update-slice":  # the buffer it updates
                i = self.by.get(i.operands[0])
                continue
            if i.op == "fusion":
                dus = self.fusion_dus_buffer(i)
                if dus is None:
                    return None
                i = self.by.get(i.operands[dus])
                continue
            return None
        return None

    def fusion_root(self, f: Instr) -> Instr:
        comp = self.comps[f.calls[0]]
        by = {i.name: i for i in comp}
        r = next((i for i in comp if i.root), comp[-1])
        while r.op == "bitcast" and r.operands:
            r = by[r.operands[0]]
        return r

    def fusion_dus_buffer(self, f: Instr):
        """Operand index of the buffer a fusion updates in place (root dynamic-update-slice of a
        parameter), else None."""
        comp = self.comps[f.calls[0]]
        by = {i.name: i for i in comp}
        r = self.fusion_root(f)
        if r.op != "dynamic-update-slice":
            return None
        b = by.get(r.operands[0])
        while b is not None and b.op == "bitcast":
            b = by.get(b.operands[0])
        return b.param_num if b is not None and b.op == "parameter" else None

    def fusion_operand_reads(self, f: Instr) -> list:
        """Bytes each fusion operand is charged: its size, or what the fused computation slices or
        gathers from it; the in-place buffer of a root dynamic-update-slice: nothing."""
        comp = self.comps[f.calls[0]]
        by = {i.name: i for i in comp}
        users = collections.defaultdict(list)
        for i in comp:
            for o in i.operands:
                users[o].append(i)
        params = {i.param_num: i for i in comp if i.op == "parameter"}
        dus = self.fusion_dus_buffer(f)
        out = []
        for k, name in enumerate(f.operands):
            full = shape_bytes(self.by[name].shape) if name in self.by else 0
            p = params.get(k)
            us = _users_through_bitcast(p, users) if p is not None else []
            if k == dus and all(u.op == "dynamic-update-slice" for u in us):
                out.append(0)
            elif us and all(u.op in ("slice", "dynamic-slice") or (u.op == "gather" and by.get(u.operands[0]) in
                                                                    _bitcast_chain(p, users)) for u in us):
                out.append(min(full, sum(shape_bytes(u.shape) for u in us)))
            else:
                out.append(full)
        return out

    def group(self, i: Instr, src: str | None = None) -> str:
        on = i.op_name
        m = _LAYER.search(on)
        if m:
            return m.group(1)
        src = src or ""
        m = re.search(r"(ts|ds|tstate|dstate|target_state|draft_state)\['layers'\]\[(\d+)\]", src)
        if m:
            return ("target_layer" if m.group(1) in ("ts", "tstate", "target_state") else "draft_layer") + m.group(2)
        m = re.search(r"s\.(?:loop\.)?(target|draft)_cache\.[kv]\[(\d+)\]", src)
        if m:
            return f"{m.group(1)}_layer{m.group(2)}"
        if "lm_head" in src:
            return "lm_head"
        for s in _SCOPES:
            if f"/{s}/" in on + "/":
                return s
        return self.default_group or "loop"


def _bitcast_chain(p, users):
    out, stack = [p], [p]
    while stack:
        x = stack.pop()
        for u in users.get(x.name, []):
            if u.op == "bitcast":
                out.append(u)
                stack.append(u)
    return out


def _users_through_bitcast(p, users):
    out, stack = [], [p]
    while stack:
        x = stack.pop()
        for u in users.get(x.name, []):
            if u.op == "bitcast":
                stack.append(u)
            else:
                out.append(u)
    return out


# entry parameter names of the weights: lower_iteration's (ts, ds) and the generation program's
_WEIGHT_PREFIXES = ("ts[", "ds[", "tstate[", "dstate[", "target_state[", "draft_state[")
# entry parameter names of the K/V caches: the iteration's loop state `s`, the slot step's `slots.loop`
_CACHE_PREFIXES = ("s.target_cache", "s.draft_cache", "slots.loop.target_cache", "slots.loop.draft_cache")


def _operand_kind(src: str | None, lm_scope: bool) -> str:
    if src is None:
        return "activations"
    if "lm_head" in src or ("embed" in src and lm_scope):
        return "lm_head"
    if src.startswith(_WEIGHT_PREFIXES):
        return "weights"
    if src.startswith(_CACHE_PREFIXES):
        return "kv_read"
    return "activations"


def _tuple_elems(s: str) -> list:
    s = s.strip()
    if not s.startswith("("):
        return [s]
    out, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [x for x in out if x and not x.startswith("/*")] if out else []


def charges(prog: Program) -> list:
    """One record per top-level op that moves bytes: {name, op, group, kind parts, model, hbm, what}.

    model: the cost model's charge (operands + results with the fusion rules; an async slice counted
    as its read and its write, an async copy four times its size (read, the start's two-buffer tuple,
    the done's result); ConcatBitcast, which only renames VMEM, its result).
    hbm: the same op's traffic to and from HBM only (arrays whose layout puts them in VMEM/SMEM,
    S(n), cost nothing: they are on-chip)."""
    out = []
    for i in prog.instrs:
        if i.op in FREE or i.op in ASYNC_DONE:
            continue
        if i.op == "while":
            # charged as its body and condition, once each (as the compiler's total counts a loop):
            # its operands are the loop state, which the body updates in place
            for key in ("body", "condition"):
                m = re.search(key + r"=%([\w.\-]+)", i.attrs)
                if m:
                    for r in charges(prog.sub(i, m.group(1))):
                        r["name"] = f"{i.name}/{r['name']}"
                        out.append(r)
            continue
        if i.op == "conditional":
            # charged as its costliest branch (the compiler takes the maximum over branches): the slot
            # step's cond runs the iterations or nothing; each branch's parameter is its operand tuple
            m = re.search(r"branch_computations=\{([^}]*)\}", i.attrs)
            names = ([x.strip().lstrip("%") for x in m.group(1).split(",")] if m else
                     [re.search(k + r"=%([\w.\-]+)", i.attrs).group(1) for k in ("true_computation", "false_computation")
                      if re.search(k + r"=%([\w.\-]+)", i.attrs)])
            best = []
            for k, comp in enumerate(names):
                rs = charges(prog.sub(i, comp, operand=1 + k))
                if sum(r["model"] for r in rs) >= sum(r["model"] for r in best):
                    best = rs
            for r in best:
                r["name"] = f"{i.name}/{r['name']}"
                out.append(r)
            continue
        parts = []   # (kind, model bytes, hbm bytes)
        lm_scope = "draft_lm_head" in i.op_name or "btv/dot_general" in i.op_name
        scope_kind = "sampling" if re.search(r"/(accept|commit)/", i.op_name) else "activations"
        src0 = prog.source(i.operands[0]) if i.operands else None
        target = i.attr("custom_call_target") if i.op == "custom-call" else None
        if i.op in ("slice-start", "copy-start"):
            el = _tuple_elems(i.shape)
            if i.op == "slice-start":
                dst = el[1]
                src_hbm = hbm_bytes(prog.by[i.operands[0]].shape) > 0
                n = shape_bytes(dst)
                rd, wr = n if src_hbm else 0, hbm_bytes(dst)
                kind = _operand_kind(src0, False)
                parts += [(kind, 2 * n, rd + wr)]
                what = f"async slice of {src0} into {'VMEM' if not wr else 'HBM'}"
            else:
                dst, src = el[0], el[1]
                n = shape_bytes(dst)
                rd, wr = hbm_bytes(src), hbm_bytes(dst)
                kind = _operand_kind(src0, False)
                if kind == "kv_read" and wr and not rd:
                    kind = "kv_write"     # the cache evicted back to HBM after its update in VMEM
                # the cost model: the source read, the (destination, source) tuple the start returns
                # and the done's result (the rule that makes the sum agree with the compiler's total)
                parts += [(kind, 4 * n, rd + wr)]
                what = f"async copy of {src0 or i.operands[0]} {'HBM' if rd else 'VMEM'}->{'HBM' if wr else 'VMEM'}"
            out.append(dict(name=i.name, op=i.op, group=prog.group(i, src0), parts=parts, what=what))
            continue
        if target == "ConcatBitcast":
            parts.append((_operand_kind(src0, False), shape_bytes(i.shape), hbm_bytes(i.shape)))
            out.append(dict(name=i.name, op="ConcatBitcast", group=prog.group(i, src0), parts=parts,
                            what=f"VMEM pieces of {src0} joined (no data moved)"))
            continue
        if target == "tpu_custom_call" and "output_to_operand_aliasing" in i.attrs:
            rec = _aliased_kernel_charge(prog, i, src0)
            if rec is not None:
                bs = _blockspec_parts(prog, i, scope_kind)
                if bs is not None:
                    # the compiler charges the kernel its declared cost estimate, which is what the
                    # BlockSpecs and the kernel's DMAs move
                    rec["parts"] = [(k, m, w) for k, m, _, w in bs]
                    rec["parts_hbm"] = [(k, h) for k, _, h, _ in bs]
                out.append(rec)
                continue
        if i.op == "fusion":
            reads = prog.fusion_operand_reads(i)
            dus = prog.fusion_dus_buffer(i)
            root = prog.fusion_root(i)
        else:
            reads = [shape_bytes(prog.by[o].shape) if o in prog.by else 0 for o in i.operands]
            dus = 0 if i.op == "dynamic-update-slice" else None
            root = i
        is_copy = root.op in ("copy", "transpose")
        srcs = []
        for k, o in enumerate(i.operands):
            src = prog.source(o)
            srcs.append(src)
            shape = prog.by[o].shape if o in prog.by else ""
            full = shape_bytes(shape)
            hb = reads[k] if hbm_bytes(shape) == full and full else 0
            if k == dus and i.op == "dynamic-update-slice":
                hb = m = 0   # in place: the buffer is neither read nor copied
            elif target == "tpu_custom_call" and o in i.operands[:k]:
                # one buffer given to a kernel twice (the fused MLP's gate and up columns of one
                # [H, 2I] weight): its BlockSpecs read disjoint blocks, so each byte once
                hb = m = 0
            else:
                m = reads[k]
            kind = "copies" if is_copy else _operand_kind(src, lm_scope)
            if kind == "activations":
                kind = scope_kind
            parts.append((kind, m, hb))
        # the result
        res = i.shape
        if dus is not None:
            upd_name = None
            if i.op == "dynamic-update-slice":
                upd_name = i.operands[1]
                n = shape_bytes(prog.by[upd_name].shape)
            else:
                comp = prog.comps[i.calls[0]]
                byc = {x.name: x for x in comp}
                n = shape_bytes(byc[root.operands[1]].shape)
            hb = n if hbm_bytes(res) else 0
            kind = "kv_write" if (srcs[dus] or "").startswith(_CACHE_PREFIXES) else scope_kind
            parts.append((kind, n, hb))
        else:
            kind = "copies" if is_copy else scope_kind
            parts.append((kind, shape_bytes(res), hbm_bytes(res)))
        what = i.op if target is None else target
        if i.op == "fusion":
            what = f"fusion[{root.op}]"
        named = [s for s in srcs if s]
        if named:
            what += " of " + ", ".join(sorted(set(named)))[:120]
        out.append(dict(name=i.name, op=i.op if target is None else target, group=prog.group(i, src0 or (named[0] if named else None)),
                        parts=parts, what=what, op_name=i.op_name[-80:]))
        bs = _blockspec_parts(prog, i, scope_kind) if target == "tpu_custom_call" else None
        if bs is not None:
            out[-1]["parts_hbm"] = [(k, h) for k, _, h, _ in bs]
            out[-1]["parts_hbm_whole"] = [(k, w) for k, _, _, w in bs]
    for r in out:
        r["model"] = sum(p[1] for p in r["parts"])
        # hbm_whole: every operand of a Pallas kernel charged whole (the rule before its BlockSpecs
        # were read); hbm: what its BlockSpecs move where they could be read
        r["hbm_whole"] = sum(p[1] for p in r["parts_hbm_whole"]) if "parts_hbm_whole" in r else sum(p[2] for p in r["parts"])
        r["hbm"] = sum(p[1] for p in r["parts_hbm"]) if "parts_hbm" in r else r["hbm_whole"]
    return out


def _aliased_kernel_charge(prog: Program, i: Instr, src0):
    """A Pallas kernel that updates operands in place (output_to_operand_aliasing), such as the
    cache row-write kernel: its aliased buffers stay in HBM and it moves only what its DMAs name,
    which its declared cost estimate says (the compiler charges that figure too). The other
    operands are charged whole; the estimate's remainder is the aliased buffers' traffic, half read
    and half written (kv read / kv write where they are caches). None: no estimate, charge as usual."""
    m = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', i.attrs)
    if not m:
        return None
    aliased = {int(x) for x in re.findall(r":\s*\((\d+),", i.attr_block("output_to_operand_aliasing"))}
    parts, srcs, rest, seen = [], [], int(m.group(1)), set()
    for k, o in enumerate(i.operands):
        src = prog.source(o)
        srcs.append(src)
        if k in aliased or o in seen:   # an operand given twice (disjoint BlockSpecs) is charged once
            continue
        seen.add(o)
        shape = prog.by[o].shape if o in prog.by else ""
        n = shape_bytes(shape)
        rest -= n
        parts.append((_operand_kind(src, False), n, hbm_bytes(shape)))
    rest = max(rest, 0)
    cache = any((srcs[k] or "").startswith(_CACHE_PREFIXES) for k in aliased)
    rd, wr = ("kv_read", "kv_write") if cache else ("activations", "activations")
    parts += [(rd, rest // 2, rest // 2), (wr, rest - rest // 2, rest - rest // 2)]
    named = sorted({srcs[k] for k in aliased if srcs[k]})
    what = "tpu_custom_call in place" + (" of " + ", ".join(named)[:120] if named else "")
    return dict(name=i.name, op="tpu_custom_call", group=prog.group(i, named[0] if named else src0),
                parts=parts, what=what, op_name=i.op_name[-80:])


# ---------------------------------------------------------------------------------------------
# Pallas kernels: what their BlockSpecs move
# ---------------------------------------------------------------------------------------------
#
# A Mosaic kernel's custom call carries its module (backend_config custom_call_config.body, MLIR
# bytecode): the grid (iteration_bounds), the number of scalar-prefetch operands, and per input and
# output its window (window_bounds, the block shape) and index map (a transform_N function of the
# grid indices and the scalar-prefetch refs). The pipeline DMAs an operand's block at the first step
# and whenever its block index changes from one step to the next (row-major grid order, the last
# axis fastest), so an operand moves (number of index changes + 1) x its block, clipped to the
# array. An index that depends on a scalar-prefetch value is unknown at compile time: where it is
# min(grid-derived value, x) or max(...) (a clamp, such as the attention's last needed KV tile) the
# bound is the grid-derived value (every block, the capacity the ideal counts); any other unknown
# index is charged a block on every step. Operands without a window (memory_space ANY/HBM, moved by
# the kernel's own DMAs) are charged the kernel's declared cost estimate less its windowed traffic,
# split evenly among them (the row writer's cache windows: read, then written back).

_MOSAIC_CACHE: dict = {}
_LOAD_VALUE = 1 << 30      # a scalar-prefetch value in an index map: as large as any k_end
_CMPI = {0: "eq", 1: "ne", 2: "lt", 3: "le", 4: "gt", 5: "ge", 6: "lt", 7: "le", 8: "gt", 9: "ge"}


def mosaic_module_text(body_b64: str) -> str | None:
    """The generic-form text of a Mosaic kernel's serialized module, None where it does not parse."""
    if body_b64 in _MOSAIC_CACHE:
        return _MOSAIC_CACHE[body_b64]
    text = None
    try:
        import base64
        from jax._src.lib import tpu as _tpu
        from jax._src.lib.mlir import ir
        ctx = ir.Context()
        ctx.allow_unregistered_dialects = True
        _tpu.register_dialect(ctx)
        with ctx:
            text = str(ir.Module.parse(base64.b64decode(body_b64)))
    except Exception:   # noqa: BLE001  (another jaxlib, a body of another format: charge whole)
        text = None
    _MOSAIC_CACHE[body_b64] = text
    return text


def parse_mosaic(text: str) -> dict | None:
    """{grid, scalar_prefetch, windows: [None | (bounds, transform name)] per input then output,
    transforms: {name: (arg names, [(result, op, operand names, attrs)], returned names)}}."""
    main = next((ln for ln in text.splitlines() if "window_params = [" in ln), None)
    if main is None:
        return None
    grid = re.search(r"iteration_bounds = array<i64(?::\s*([\d,\s]*))?>", main)
    grid = tuple(int(x) for x in (grid.group(1) or "").split(",") if x.strip()) if grid else ()
    sp = re.search(r"scalar_prefetch = (\d+)", main)
    wp = main[main.find("window_params = [") + len("window_params = ["):]
    windows = []
    for m in re.finditer(r"\{([^{}]*)\}", wp[:wp.find("]}")] if "]}" in wp else wp):
        e = m.group(1)
        t = re.search(r"transform_indices = @([\w.]+)", e)
        b = re.search(r"window_bounds = array<i64(?::\s*([\d,\s]*))?>", e)
        windows.append(None if not t or not b else
                       (tuple(int(x) for x in (b.group(1) or "").split(",") if x.strip()), t.group(1)))
    transforms = {}
    for m in re.finditer(r"\^bb0\(([^)]*)\):\n(.*?)\n\s*\}\) \{function_type = [^\n]*?sym_name = \"([\w.]+)\"",
                         text, re.S):
        args = re.findall(r"(%[\w#]+):", m.group(1))
        ops, ret = [], None
        for ln in m.group(2).splitlines():
            r = re.match(r'\s*(?:(%[\w#]+) = )?"(?:[\w]+\.)*?((?:arith|memref|func)\.\w+)"\(([^)]*)\)\s*(\{[^}]*\})?', ln)
            if not r:
                ops.append((None, "unknown", [], ""))
                continue
            res, op, opnds, attrs = r.group(1), r.group(2), re.findall(r"%[\w#]+", r.group(3)), r.group(4) or ""
            if op == "func.return":
                ret = opnds
            else:
                ops.append((res, op, opnds, attrs))
        transforms[m.group(3)] = (args, ops, ret or [])
    return dict(grid=grid, scalar_prefetch=int(sp.group(1)) if sp else 0, windows=windows, transforms=transforms)


def eval_transform(fn, grid: tuple) -> list:
    """An index map over every grid step: per block-index component an int array [steps], or None
    where it is unknown (charged every step). See the section comment for the clamp rule."""
    import numpy as np
    args, ops, ret = fn
    steps = 1
    for g in grid:
        steps *= g
    idx = np.indices(grid).reshape(len(grid), steps) if grid else np.zeros((0, 1), np.int64)
    env = {a: (idx[k].astype(np.int64), False, None) for k, a in enumerate(args[:len(grid)])}
    for a in args[len(grid):]:
        env[a] = None                                   # a scalar-prefetch ref
    bad = (np.zeros(steps, np.int64), True, None)
    for res, op, opnds, attrs in ops:
        if res is None:
            continue
        vals = [env.get(o) for o in opnds]
        name = op.split(".", 1)[1]
        if op == "memref.load":
            env[res] = (np.full(steps, _LOAD_VALUE, np.int64), True, None)
            continue
        if op == "arith.constant":
            c = re.search(r"value = (-?\d+|true|false)", attrs)
            v = {"true": 1, "false": 0}.get(c.group(1), None) if c else None
            v = int(c.group(1)) if c and v is None else v
            env[res] = (np.full(steps, v, np.int64), False, None) if v is not None else bad
            continue
        if any(v is None for v in vals) or not vals:
            env[res] = bad
            continue
        x = [v[0] for v in vals]
        tainted = any(v[1] for v in vals)
        bound = None
        with np.errstate(all="ignore"):
            if name in ("index_cast", "index_castui", "extsi", "extui", "trunci", "bitcast"):
                out = x[0]
            elif name == "addi":
                out = x[0] + x[1]
            elif name == "subi":
                out = x[0] - x[1]
            elif name == "muli":
                out = x[0] * x[1]
            elif name in ("divsi", "divui"):
                out = np.where(x[1] != 0, np.trunc(x[0] / np.where(x[1] != 0, x[1], 1)), 0).astype(np.int64)
            elif name == "floordivsi":
                out = x[0] // np.where(x[1] != 0, x[1], 1)
            elif name in ("ceildivsi", "ceildivui"):
                out = -(-x[0] // np.where(x[1] != 0, x[1], 1))
            elif name in ("remsi", "remui"):
                out = np.fmod(x[0], np.where(x[1] != 0, x[1], 1))
            elif name in ("minsi", "minui", "maxsi", "maxui"):
                out = (np.minimum if name.startswith("min") else np.maximum)(x[0], x[1])
                clean = [v for v in vals if not v[1]]
                if tainted and len(clean) == 1 and np.array_equal(out, clean[0][0]):
                    bound = clean[0][0]     # a clamp that does not bind at the largest prefetch value
            elif name == "andi":
                out = x[0] & x[1]
            elif name == "ori":
                out = x[0] | x[1]
            elif name == "xori":
                out = x[0] ^ x[1]
            elif name == "shli":
                out = x[0] << x[1]
            elif name in ("shrsi", "shrui"):
                out = x[0] >> x[1]
            elif name == "select":
                out = np.where(x[0] != 0, x[1], x[2])
            elif name == "cmpi":
                p = re.search(r"predicate = (\d+)", attrs)
                f = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                     "gt": np.greater, "ge": np.greater_equal}[_CMPI[int(p.group(1))]] if p else None
                if f is None:
                    env[res] = bad
                    continue
                out = f(x[0], x[1]).astype(np.int64)
            else:
                env[res] = bad
                continue
        env[res] = (np.asarray(out, np.int64) * np.ones(steps, np.int64), tainted, bound)
    comps = []
    for r in ret:
        v = env.get(r)
        if v is None or (v[1] and v[2] is None):
            comps.append(None)
        else:
            comps.append(v[2] if v[1] else v[0])
    return comps


def window_traffic(bounds: tuple, shape: tuple, comps: list, steps: int, itemsize: float) -> int:
    """Bytes an operand's pipeline moves: its block at each step whose block index differs from the
    previous step's (the first step included), clipped to the array."""
    import numpy as np
    if len(bounds) != len(shape) or len(comps) != len(shape):
        return -1
    changed = np.zeros(steps, bool)
    changed[0] = True
    per = np.ones(steps, np.int64)
    for c, wb, dim in zip(comps, bounds, shape):
        if c is None:
            changed[:] = True
            per = per * min(wb, dim)
            continue
        if steps > 1:
            changed[1:] |= c[1:] != c[:-1]
        per = per * np.clip(np.minimum(wb, dim - c * wb), 0, None)
    return int(per[changed].sum() * itemsize)


def _dims(shape: str) -> tuple:
    m = _ARRAY.search(shape)
    return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) if m else (None, ())


def pallas_traffic(i: Instr) -> dict | None:
    """{inputs: [bytes per custom-call operand], outputs: [bytes per result], any_in, any_out: the
    operands/results without a window} from the kernel's BlockSpecs; None where the module cannot
    be read (the caller charges the operands whole)."""
    m = re.search(r'"body":"([^"]*)"', i.attrs)
    if not m:
        return None
    text = mosaic_module_text(m.group(1))
    k = parse_mosaic(text) if text else None
    if k is None:
        return None
    in_shapes = _tuple_elems("(" + i.attr_block("operand_layout_constraints").strip("{}") + ")")
    out_shapes = _tuple_elems(i.shape)
    nsp = k["scalar_prefetch"]
    if len(in_shapes) != len(i.operands) or len(k["windows"]) != len(in_shapes) - nsp + len(out_shapes):
        return None
    steps = 1
    for g in k["grid"]:
        steps *= g
    traffic, any_ops = [], []
    for n, shp in enumerate(in_shapes[nsp:] + out_shapes):
        w = k["windows"][n]
        dt, dims = _dims(shp)
        if w is None:
            traffic.append(None)
            any_ops.append(n)
            continue
        fn = k["transforms"].get(w[1])
        if fn is None or dt not in DTYPE_BYTES:
            return None
        b = window_traffic(w[0], dims, eval_transform(fn, k["grid"]), steps, DTYPE_BYTES[dt])
        if b < 0:
            return None
        traffic.append(b)
    if any_ops:
        est = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', i.attrs)
        if not est:
            return None
        rest = int(est.group(1)) - sum(t for t in traffic if t is not None) - sum(shape_bytes(s) for s in in_shapes[:nsp])
        rest = max(rest, 0)
        for j, n in enumerate(any_ops):
            traffic[n] = rest // len(any_ops) + (rest % len(any_ops) if j == 0 else 0)
    ins = [shape_bytes(s) for s in in_shapes[:nsp]] + traffic[:len(in_shapes) - nsp]
    return dict(inputs=ins, outputs=traffic[len(in_shapes) - nsp:],
                any_in=[n + nsp for n in any_ops if n < len(in_shapes) - nsp])


def _blockspec_parts(prog: Program, i: Instr, scope_kind: str):
    """[(kind, bytes moved, of them HBM, HBM with each windowed operand whole)] of a Pallas kernel
    from its BlockSpecs (pallas_traffic), None where unread: operands by their source, results
    written into a cache (aliased) kv write, the rest the scope's. The whole figure charges an
    operand given twice once (its two windows are disjoint blocks of it) and keeps the windowless
    operands' DMA bytes."""
    t = pallas_traffic(i)
    if t is None:
        return None
    aliased = {int(o): int(r) for r, o in re.findall(r"\{(\d+)\}:\s*\((\d+),", i.attr_block("output_to_operand_aliasing"))}
    parts, srcs, seen = [], [], set()
    for k, o in enumerate(i.operands):
        src = prog.source(o)
        srcs.append(src)
        shape = prog.by[o].shape if o in prog.by else ""
        kind = _operand_kind(src, False)
        hbm = bool(hbm_bytes(shape))
        whole = t["inputs"][k] if k in t["any_in"] else (0 if o in seen else shape_bytes(shape))
        seen.add(o)
        parts.append((kind if kind != "activations" else scope_kind, t["inputs"][k],
                      t["inputs"][k] if hbm else 0, whole if hbm else 0))
    outs = _tuple_elems(i.shape)
    by_out = {r: o for o, r in aliased.items()}
    for r, b in enumerate(t["outputs"]):
        src = srcs[by_out[r]] if r in by_out else None
        kind = "kv_write" if (src or "").startswith(_CACHE_PREFIXES) else scope_kind
        hbm = r < len(outs) and bool(hbm_bytes(outs[r]))
        whole = b if r in by_out and by_out[r] in t["any_in"] else (shape_bytes(outs[r]) if r < len(outs) else 0)
        parts.append((kind, b, b if hbm else 0, whole if hbm else 0))
    return parts


def group_class(g: str) -> str:
    """target_layer7 -> target layers (the per-layer rows summed in the short table)."""
    return re.sub(r"\d+$", "", g)


def summarize(recs: list) -> dict:
    """Totals: by kind, by group class x kind, for the cost model and for HBM traffic."""
    keys = ("model", "hbm", "hbm_whole")
    tot = {k: collections.Counter() for k in keys}
    by_group = {k: collections.defaultdict(collections.Counter) for k in keys}
    by_op = {k: collections.Counter() for k in keys}

    def add(key, r, kind, b):
        tot[key][kind] += b
        by_group[key][group_class(r["group"])][kind] += b
        by_op[key][r["op"]] += b

    for r in recs:
        for kind, m, h in r["parts"]:
            add("model", r, kind, m)
            if "parts_hbm_whole" not in r:
                add("hbm_whole", r, kind, h)
            if "parts_hbm" not in r:
                add("hbm", r, kind, h)
        for kind, h in r.get("parts_hbm_whole", ()):
            add("hbm_whole", r, kind, h)
        for kind, h in r.get("parts_hbm", ()):
            add("hbm", r, kind, h)
    return {"kinds_model": dict(tot["model"]), "kinds_hbm": dict(tot["hbm"]),
            "kinds_hbm_whole": dict(tot["hbm_whole"]),
            "model_total": sum(tot["model"].values()), "hbm_total": sum(tot["hbm"].values()),
            "hbm_whole_total": sum(tot["hbm_whole"].values()),
            "ops_hbm_whole": dict(by_op["hbm_whole"]),
            "groups_model": {g: dict(c) for g, c in by_group["model"].items()},
            "groups_hbm": {g: dict(c) for g, c in by_group["hbm"].items()},
            "ops_model": dict(by_op["model"]), "ops_hbm": dict(by_op["hbm"])}


def breakdown(compiled_or_text) -> dict:
    """The per-kind breakdown of a compiled program (or its as_text()), with the compiler's total."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    recs = charges(Program(text))
    s = summarize(recs)
    if not isinstance(compiled_or_text, str):
        ca = compiled_or_text.cost_analysis()
        if isinstance(ca, (list, tuple)):
            ca = ca[0] if ca else {}
        s["compiler_bytes_accessed"] = float(ca.get("bytes accessed", float("nan")))
    s["records"] = recs
    return s


def print_report(s: dict, top: int = 25, ideal: float | None = None, file=sys.stdout):
    P = lambda *a: print(*a, file=file)  # noqa: E731
    G = 1e9
    comp = s.get("compiler_bytes_accessed")
    P(f"TOTAL CHECK: tool's cost-model sum {s['model_total'] / G:.3f} GB"
      + (f" vs compiler cost_analysis {comp / G:.3f} GB ({100 * (s['model_total'] / comp - 1):+.1f}%)" if comp else "")
      + f"; HBM traffic (on-chip VMEM/SMEM operands excluded, Pallas kernels by their BlockSpecs) {s['hbm_total'] / G:.3f} GB"
      + (f" ({s['hbm_total'] / ideal:.3f}x ideal)" if ideal else "")
      + f"; Pallas operands whole {s.get('hbm_whole_total', s['hbm_total']) / G:.3f} GB"
      + (f"; ideal {ideal / G:.3f} GB" if ideal else ""))
    P(f"{'kind':12} {'cost model GB':>14} {'HBM GB':>8} {'HBM whole GB':>13}")
    for k in KINDS:
        P(f"{k:12} {s['kinds_model'].get(k, 0) / G:14.3f} {s['kinds_hbm'].get(k, 0) / G:8.3f} "
          f"{s.get('kinds_hbm_whole', s['kinds_hbm']).get(k, 0) / G:13.3f}")
    P("")
    P(f"{'group':16} " + " ".join(f"{k[:10]:>10}" for k in KINDS) + "   (cost model GB / HBM GB)")
    for g in sorted(s["groups_model"]):
        m, h = s["groups_model"][g], s["groups_hbm"].get(g, {})
        P(f"{g:16} " + " ".join(f"{m.get(k, 0) / G:5.2f}/{h.get(k, 0) / G:4.2f}" for k in KINDS))
    P("")
    P(f"{'op kind':22} {'cost model GB':>14} {'HBM GB':>8} {'HBM whole GB':>13}")
    for op, b in sorted(s["ops_model"].items(), key=lambda x: -x[1])[:12]:
        P(f"{op:22} {b / G:14.3f} {s['ops_hbm'].get(op, 0) / G:8.3f} "
          f"{s.get('ops_hbm_whole', s['ops_hbm']).get(op, 0) / G:13.3f}")
    P("")
    P(f"top {top} ops by cost-model bytes:")
    for r in sorted(s["records"], key=lambda r: -r["model"])[:top]:
        whole = f", whole {r['hbm_whole'] / 1e6:.1f}" if r.get("hbm_whole", r["hbm"]) != r["hbm"] else ""
        P(f"  {r['model'] / 1e6:9.1f} MB (HBM {r['hbm'] / 1e6:8.1f}{whole}) {r['group']:14} {r['name']:28} {r['what'][:110]}")


# ---------------------------------------------------------------------------------------------
# the CLI: compile one iteration for a chip
# ---------------------------------------------------------------------------------------------

def _compile(args):
    import dataclasses as dc_
    import jax  # noqa: F401
    from jax.experimental import topologies
    sys.path.insert(0, REPO)
    from dflash_jax import DraftConfig, TargetConfig, decode
    topo = {"v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "v5e": "v5e:2x2", "v4": "v4:2x2x1"}[args.chip]
    dev = topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
    tc = TargetConfig.preset(args.preset)
    if args.layers:
        tc = dc_.replace(tc, num_layers=args.layers)
    n = args.draft_layers
    taps = tuple(sorted({min(tc.num_layers - 1, 1 + k * max(1, (tc.num_layers - 2) // max(1, n - 1))) for k in range(n)}))
    if args.preset == "qwen3-8b" and not args.layers and n == 5:
        taps = (1, 9, 17, 25, 33)
    dc = DraftConfig.for_target(tc, num_layers=n, block_size=16, mask_token_id=tc.vocab_size - 1,
                                target_layer_ids=taps)
    from dflash_jax.kernel_config import KernelConfig
    kernels = KernelConfig(attention="pallas_tpu", tpu_mlp=getattr(args, "tpu_mlp", None))
    place = dict(device=dev)
    if getattr(args, "mesh", None):
        from dflash_jax import sharding
        place = dict(mesh=sharding.make_mesh(args.mesh, devices=topologies.get_topology_desc(
            platform="tpu", topology_name=topo).devices))
    q = getattr(args, "quantize", None)
    low = decode.lower_iteration(tc, None if args.plain else dc, batch=args.batch, prompt_len=512,
                                 capacity=args.capacity, kernels=kernels, quantize=q, **place)
    return low.compile(), tc, dc


def collective_bytes(hlo: str) -> int:
    """Bytes the collectives of a compiled program (one chip's) read and write: operand + result
    of each all-reduce / all-gather / reduce-scatter / collective-permute (its start op)."""
    n = 0
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                      r"(-start)?\(", line)
        if m:
            n += 2 * shape_bytes(m.group(1))
    return n


def ideal_per_chip(tc, dc, *, draft: bool, batch: int, capacity: int, dp: int, tp: int,
                   collectives: int = 0, weight_bytes: float = 2) -> dict:
    """The ideal of one chip of a (data, model) mesh: its 1/tp of every weight (the fused TP layout
    shards every matrix and the LM head over 'model'; the norms, a few KB, counted whole), the KV of
    its B/dp rows and max(Hkv, tp)/tp kv heads, and the collectives' buffers (read and written).
    weight_bytes: as ideal_bytes."""
    full = ideal_bytes(tc, dc, draft=draft, batch=batch, capacity=capacity, weight_bytes=weight_bytes)
    rows = batch // dp
    kv = lambda c: max(c.num_kv_heads, tp) // tp / c.num_kv_heads   # noqa: E731  (kv heads per chip, as a fraction)
    out = {k: v / tp for k, v in full.items() if k in ("target_layers", "lm_head", "draft")}
    per = ideal_bytes(tc, dc, draft=draft, batch=rows, capacity=capacity)
    if draft:
        t_only = ideal_bytes(tc, None, draft=False, batch=rows, capacity=capacity)["kv_read"]
        out["kv_read"] = t_only * kv(tc) + (per["kv_read"] - t_only) * kv(dc)
        t_w = rows * 16 * 2 * tc.num_layers * tc.num_kv_heads * tc.head_dim * 2
        out["kv_write"] = t_w * kv(tc) + (per["kv_write"] - t_w) * kv(dc)
    else:
        out["kv_read"], out["kv_write"] = per["kv_read"] * kv(tc), per["kv_write"] * kv(tc)
    out["collectives"] = collectives
    out["total"] = sum(out.values())
    return out


def ideal_bytes(tc, dc, *, draft: bool, batch: int, capacity: int, weight_bytes: float = 2) -> dict:
    """Every weight read once per use (the LM head twice with a draft: the draft's and the verify's
    logits), the KV caches read over the capacity (what the kernel declares), the rows the iteration
    writes. weight_bytes: bytes per element of the target layers' matrices (1: an int8 target,
    dflash_jax.quantize, plus a float32 scale per output column; the draft, LM head and norms stay 2)."""
    def layer(c, wb=2):
        H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
        mats = H * (c.num_heads + 2 * c.num_kv_heads) * D + c.num_heads * D * H + H * 2 * I + I * H
        cols = (c.num_heads + 2 * c.num_kv_heads) * D + H + 2 * I + H
        return wb * mats + (4 * cols if wb != 2 else 0) + 2 * (2 * H + 2 * D)
    lm = 2 * tc.hidden_size * tc.vocab_size
    t_layers = tc.num_layers * layer(tc, weight_bytes) + 2 * tc.hidden_size
    kv_t = 2 * tc.num_layers * tc.num_kv_heads * tc.head_dim * 2
    S = 16 if draft else 1
    out = {"target_layers": t_layers, "lm_head": lm * (2 if draft else 1),
           "kv_read": batch * capacity * kv_t, "kv_write": batch * S * kv_t}
    if draft:
        kv_d = 2 * dc.num_layers * dc.num_kv_heads * dc.head_dim * 2
        out["draft"] = dc.num_layers * layer(dc) + 2 * len(dc.target_layer_ids) * tc.hidden_size ** 2 + 4 * tc.hidden_size
        out["kv_read"] += batch * capacity * kv_d
        out["kv_write"] += batch * 2 * S * kv_d     # the pending context rows and the block's rows
    out["total"] = sum(out.values())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chip", default="v6e", choices=("v6e", "v5p", "v5e", "v4"))
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=0, help="target layers (0: the preset's)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="the plain step (no draft)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--mesh", default=None, help='a (data, model) mesh over the topology\'s 4 chips, e.g. '
                    '"data=1,model=4": the sharded program, one chip\'s bytes vs the per-chip ideal')
    ap.add_argument("--tpu-mlp", action=argparse.BooleanOptionalAction, default=None,
                    help="KernelConfig(tpu_mlp=...): force the fused MLP kernel on/off (default: the library's, on)")
    ap.add_argument("--quantize", default=None, choices=("int8", "int8+head"),
                    help="the target's weights as load_target(quantize=...) holds them (one chip)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--hlo", default=None, help="analyse this saved as_text() instead of compiling")
    ap.add_argument("--save-hlo", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ideal = None
    if args.hlo:
        with open(args.hlo) as f:
            s = breakdown(f.read())
    else:
        accel = {"v6e": "v6e-4", "v5p": "v5p-8", "v5e": "v5litepod-4", "v4": "v4-8"}[args.chip]
        for k, v in dict(JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost", TPU_ACCELERATOR_TYPE=accel,
                         TPU_SKIP_MDS_QUERY="1").items():
            os.environ.setdefault(k, v)
        comp, tc, dc = _compile(args)
        if args.save_hlo:
            with open(args.save_hlo, "w") as f:
                f.write(comp.as_text())
        s = breakdown(comp)
        if args.mesh:
            from dflash_jax import sharding
            dp, tp = sharding.parse_mesh(args.mesh)
            ideal = ideal_per_chip(tc, dc, draft=not args.plain, batch=args.batch, capacity=args.capacity,
                                   dp=dp, tp=tp, collectives=collective_bytes(comp.as_text()))
        else:
            ideal = ideal_bytes(tc, dc, draft=not args.plain, batch=args.batch, capacity=args.capacity,
                                weight_bytes=1 if args.quantize else 2)
        s["ideal"] = ideal
        ideal = ideal["total"]
    print_report(s, args.top, ideal)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in s.items() if k != "records"}, f, indent=1)


if __name__ == "__main__":
    main()
