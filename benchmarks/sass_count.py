"""Static instruction counts of the prefill top-k launches, compiled here for sm_90 (no GPU).

Triton compiles a kernel for a named target without a device, and its wheel carries
``ptxas`` and ``cuobjdump``; this script compiles the two top-k launches of
``kernels.prefill_selection`` (``topk_search`` ``bisect`` and ``bracket``) as the Forecast's
last 8K chunk of a 128K prompt uses them (``paper`` preset, ``N_P = 2048``, one row and one
warp per program), disassembles them and prints registers, spills and instructions before,
inside and after each backward-branch loop (the bisection steps). A static count, not a
timing: it tells which variant issues fewer instructions per row, the GPU says what that is
worth. Usage: ``PYTHONPATH=src python3 benchmarks/sass_count.py [OUT.json]``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import sparda.kernels.prefill_selection as ps  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")
BACK = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA (?:!?U?P\w+, )?0x([0-9a-f]+)")


def compile_sass(fn, consts: dict, num_warps: int = 1) -> tuple[str, str]:
    """``(sass, resource usage)`` of ``fn`` for sm_90 with the launch's int arguments as i32."""
    sig = {"SCR": "*fp32", "MASK": "*u8", "QPOS": "*i64"}
    for name in ("stride_pb", "stride_sb", "stride_sh", "stride_st", "stride_mb", "stride_mh", "stride_mt",
                 "H", "Tq", "N"):
        sig[name] = "i32"
    sig.update({k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    cubin = Path("/tmp") / f"sparda-{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    run = lambda *a: subprocess.run([str(BIN / "cuobjdump"), *a, str(cubin)], capture_output=True, text=True,
                                    check=True).stdout
    return run("-sass"), run("-res-usage")


def regions(sass: str) -> dict:
    """Instruction counts before, inside and after the first backward-branch loop."""
    ins = [(int(a, 16), op) for a, op in INSTR.findall(sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in BACK.findall(sass) if int(t, 16) < int(a, 16)]
    out = {"instructions": len(ins), "by_op": dict(Counter(op for _, op in ins).most_common(8))}
    if loops:
        start, end = loops[0]
        out.update(before_loop=sum(a < start for a, _ in ins), loop=sum(start <= a <= end for a, _ in ins),
                   after_loop=sum(a > end for a, _ in ins))
    return out


def main() -> None:
    cfg = SelectionConfig.from_preset("paper")
    common = dict(BS=cfg.block_size, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, TOPK=cfg.topk_blocks,
                  BUDGET=cfg.budget_blocks, DENSE_LEN=cfg.dense_len, N_P=2048)
    report = {"target": "sm_90", "triton": triton.__version__, "n_p": 2048, "topk_blocks": cfg.topk_blocks}
    for name, fn, extra in (("bisect", ps._prefill_topk_kernel, {"RS": 1}),
                            ("bracket", ps._prefill_topk_bracket_kernel, {})):
        sass, res = compile_sass(fn, {**common, **extra})
        regs = re.search(r"REG:(\d+)", res)
        report[name] = {"registers": int(regs.group(1)) if regs else None,
                        "spill_stores": sass.count("STL"), **regions(sass)}
        print(name, {k: v for k, v in report[name].items() if k != "by_op"}, flush=True)
    b, r = report["bisect"], report["bracket"]
    if "loop" in b:
        per_row = b["before_loop"] + 32 * b["loop"] + b["after_loop"]
        print(f"bisect: {per_row} instructions per row (32 steps of {b['loop']})")
    if "loop" in r:
        print(f"bracket, no tie at the k-th key: the tie pass is skipped; {r['before_loop']} before the search, "
              f"{r['loop']} per step, {r['after_loop']} after it (the tie pass included, run on tie rows only)")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
