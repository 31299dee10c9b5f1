"""Every Triton attention kernel compiled for sm_90 (H100/H200) on this machine, no GPU
needed, with the registers and spills ptxas reports for each: a kernel that does not build,
or that spills, is known before a device window is spent on it.

    python bench/triton_sm90.py [--json FILE]       # the table BENCHMARKS.md section 3 shows

Each kernel is compiled from the arguments a real call passes: ``bert.triton_attention``'s
``forward``, ``backward`` and ``dropout_mask`` run on CPU tensors of a training call's
shapes and strides (BERT-Large's 16 heads of 64, q/k/v as views of the fused QKV output,
a token count that is a multiple of 64 like every budget rung), with a ``launch`` that binds
the arguments as triton's launcher does (pointer alignment and integer divisibility become
the same specialisation the device would compile) and hands the result to
``triton.compile`` for the sm_90 target instead of running it: through Triton's whole
pipeline to the cubin (the triton wheel carries ptxas). Covered: the forward with dropout
for each forward block configuration of the device run's sweep
(``bench/attention_blocks.BLOCK_CONFIGS``) and without dropout (evaluation) for the default;
the three backward kernels with dropout for each backward configuration and without for the
default; the speed levers' kernels (the forward storing its dropout mask as bits at each of
``FWD_TILES``, the backward kernels reading it at the default blocks); ``_mask_kernel``. The binding uses the pinned triton's (3.6.0) launcher internals
(``create_function_from_signature``, ``JITFunction._pack_args``): another triton version may
need this file changed, and says so by failing here.

Registers and spills come from ptxas's own report of each compile (``-v``, which triton
passes; printed with ``knobs.nvidia.dump_ptxas_log``, every compile forced past the cache);
its performance advisories (e.g. serialised wgmma) are kept as notes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.attention_blocks import BLOCK_CONFIGS  # noqa: E402
from bert import triton_attention as ta  # noqa: E402

# A training call's geometry: BERT-Large's heads, a budget rung's token count (a multiple of
# 64), local batch 16's sequences at seq 512.
HEADS, HEAD_DIM, TOKENS, SEQS, MAX_SEQLEN, DROPOUT = 16, 64, 1024, 16, 512, 0.1


class Sm90Compile:
    """A ``launch`` for bert.triton_attention that compiles each distinct kernel
    specialisation for ``sm_<capability>`` and keeps ptxas's report of it (``rows``)."""

    def __init__(self, capability: int = 90) -> None:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.triton = triton
        self.target = GPUTarget("cuda", capability, 32)
        self.backend = make_backend(self.target)
        self.binders: dict[Any, Any] = {}
        self.seen: set[tuple] = set()
        self.rows: list[dict] = []

    def __call__(self, kernel, grid, *args, **kwargs) -> None:
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        knobs = self.triton.knobs
        # What JITFunction.run adds before it binds (triton 3.6.0).
        kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode)
        if kernel not in self.binders:
            self.binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, spec, options = self.binders[kernel](*args, **kwargs)
        key = (kernel.__name__, str(spec), str(options))
        if key in self.seen:
            return
        self.seen.add(key)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, spec, options)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = self.triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                           options=options.__dict__)
        consts = {kernel.arg_names[path[0]]: val for path, val in constexprs.items()}
        self.rows.append({"kernel": kernel.__name__, **consts, "num_warps": compiled.metadata.num_warps,
                          "num_stages": compiled.metadata.num_stages, "shared_bytes": compiled.metadata.shared,
                          "cubin_bytes": len(compiled.asm["cubin"]), **ptxas_report(log.getvalue())})


def ptxas_report(log: str) -> dict[str, Any]:
    """Registers, spill stores/loads and stack frame (bytes) from ptxas -v's report of one
    entry function, and its advisories."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or frame is None:
        raise RuntimeError(f"no ptxas register report in the compile's output:\n{log}")
    notes = [m.group(1).strip() for m in re.finditer(r"ptxas info\s*:\s*(\(C\d+\).*)", log)]
    return {"n_regs": int(regs.group(1)), "stack_bytes": int(frame.group(1)), "spill_stores_bytes": int(frame.group(2)),
            "spill_loads_bytes": int(frame.group(3)), "ptxas_notes": notes}


def compile_all(capability: int = 90) -> list[dict]:
    """Every kernel of bert.triton_attention for each configuration the device runs or
    sweeps (module docstring), compiled as a training call would launch it."""
    if not ta.AVAILABLE:
        raise RuntimeError("the triton package is not installed")
    import triton

    if not hasattr(ta._fwd_kernel, "signature") or triton.knobs.runtime.interpret:
        raise RuntimeError("triton runs in its interpreter in this process (TRITON_INTERPRET): nothing compiles")
    compile_ = Sm90Compile(capability)
    bf16 = torch.bfloat16
    qkv = torch.empty(TOKENS, 3, HEADS, HEAD_DIM, dtype=bf16)  # the fused projection's output
    q, k, v = qkv.unbind(1)
    out, grad_out = (torch.empty(TOKENS, HEADS, HEAD_DIM, dtype=bf16) for _ in range(2))
    lse = torch.empty(HEADS, TOKENS, dtype=torch.float32)
    cu = torch.zeros(SEQS + 1, dtype=torch.int32)
    seed = torch.zeros(1, dtype=torch.int64)
    knobs = triton.knobs
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True  # ptxas runs, and reports
    try:
        for fwd_blocks, bwd_blocks in BLOCK_CONFIGS:
            ta.forward(q, k, v, cu, MAX_SEQLEN, DROPOUT, seed, fwd_blocks, launch=compile_)
            ta.backward(grad_out, q, k, v, out, lse, cu, MAX_SEQLEN, DROPOUT, seed, bwd_blocks, launch=compile_)
        ta.forward(q, k, v, cu, MAX_SEQLEN, 0.0, None, launch=compile_)  # evaluation
        ta.backward(grad_out, q, k, v, out, lse, cu, MAX_SEQLEN, 0.0, None, launch=compile_)
        mask = ta.mask_buffer(SEQS, HEADS, MAX_SEQLEN, q.device)  # model.triton_dropout_mask=bits
        for tile in ta.FWD_TILES.values():
            ta.forward(q, k, v, cu, MAX_SEQLEN, DROPOUT, seed, tile, launch=compile_, mask=mask)
        ta.backward(grad_out, q, k, v, out, lse, cu, MAX_SEQLEN, DROPOUT, None, launch=compile_, mask=mask)
        ta.dropout_mask(seed, 2, HEADS, MAX_SEQLEN, DROPOUT, launch=compile_)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return compile_.rows


def table(rows: list[dict]) -> str:
    lines = ["| kernel | BLOCK_M x BLOCK_N | warps / stages | dropout | registers | spill stores / loads (B) "
             "| stack (B) | shared (B) | ptxas advisories |", "|---|---|---|---|---:|---|---:|---:|---|"]
    masks = {True: "yes, mask bits", False: "yes"}
    for r in rows:
        blocks = f"{r.get('BLOCK_M', r.get('BLOCK'))}" + (f" x {r['BLOCK_N']}" if "BLOCK_N" in r else "")
        drop = masks[bool(r.get("MASK_BITS"))] if r.get("DROPOUT") else {False: "no"}.get(r.get("DROPOUT"), "-")
        notes = "; ".join(re.sub(r" in the function '.*'", "", n) for n in r["ptxas_notes"])
        lines.append(f"| {r['kernel']} | {blocks} | {r['num_warps']} / {r['num_stages']} | {drop} | {r['n_regs']} "
                     f"| {r['spill_stores_bytes']} / {r['spill_loads_bytes']} | {r['stack_bytes']} "
                     f"| {r['shared_bytes']} | {notes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="FILE", help="also write the rows, the triton and ptxas versions here")
    ap.add_argument("--capability", type=int, default=90, help="the target's compute capability (90: H100/H200)")
    args = ap.parse_args(argv)
    try:
        rows = compile_all(args.capability)
    except RuntimeError as e:
        print(f"triton_sm90: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.json:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = subprocess.run([get_ptxas(args.capability).path, "--version"], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "ptxas": ptxas,
                                               "capability": args.capability, "kernels": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
