"""Helpers shared by the benchmark entry points in ``benchmarks/`` (``bench_decode.py``,
``bench_prefill.py``, ``bench_kernels.py``, ``bench_offload.py``, ``bench_serve.py``,
``bench_eval.py``, ``bench_train.py``; docs/bench.md).

One copy of what several of them need: a token-ids-only tokenizer stub (:class:`NoText`),
the random 4-layer Llama the parity checks generate with (:func:`random_llama`), the
prefill selection kernel against its twin on the GPU (:func:`prefill_selection_check`),
the commit and device of a run (:func:`git_commit`, :func:`device_line`), and running a
``sparda`` CLI command with its output teed to a log file and its wall time appended
(:func:`run_logged`, what the former shell scripts did with ``/usr/bin/time ... | tee``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

#: the repository root (``benchmarks/`` and ``src/`` live here)
ROOT = Path(__file__).resolve().parents[3]


class NoText:
    """Stands in for a tokenizer: token ids only (``generate(None, prompt_token_ids=...)``
    on a model without one; completions decode to ``""``)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def random_llama(dtype: torch.dtype, device: str | torch.device, head_dim: int = 128, seed: int = 0):
    """A random 4-layer Llama :class:`~sparda.model.llama.CausalLM` (hidden 512, 8 Q / 2 KV
    heads, vocab 2048), built in fp32 under ``torch.manual_seed(seed)`` and cast to
    ``dtype`` (RoPE frequencies kept in fp32): the model of the decode parity checks
    (greedy tokens of one configuration against another), small enough for the CPU."""
    from transformers import LlamaConfig

    from sparda.model.llama import CausalLM

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=2048, max_position_embeddings=8192,
                      rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    model.rotary.inv_freq.data = model.rotary.inv_freq.float()
    return model.eval()


def prefill_selection_check(device: str = "cuda") -> list[dict]:
    """The bf16 prefill selection kernel (``kernels.prefill_selection``, real ``tl.dot``)
    against its PyTorch twin on ``device`` (32K context, 512 query tokens, ``paper``
    preset): query-based G = 16 and 4 and the Forecast (with and without the lookahead
    rule). Per case: the share of query rows whose masks are equal, the recall of the
    twin's selected blocks, the largest score error relative to the largest score, and
    whether the top-k rule applied to the kernel's own scores gives the kernel's mask."""
    from sparda.config import SelectionConfig
    from sparda.kernels import reference, twins
    from sparda.kernels.prefill_selection import select_prefill_blocks_triton

    cfg = SelectionConfig.from_preset("paper")
    rows = []
    num_tokens, num_q, heads, d = 32768, 512, 2, 128
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    num_blocks = num_tokens // cfg.block_size
    gen = torch.Generator(device=device).manual_seed(0)
    ck = torch.randn(1, heads, num_ck, d, device=device, generator=gen).bfloat16()
    q_pos = torch.arange(num_tokens - num_q, num_tokens, device=device).view(1, -1)
    for groups in (16, 4, None):
        shape = (1, heads, num_q, d) if groups is None else (1, heads, groups, num_q, d)
        query = (torch.randn(shape, device=device, generator=gen) * 0.3).bfloat16()
        for lookahead in ((False, True) if groups is None else (False,)):
            mask, scores = select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg, lookahead=lookahead,
                                                        return_scores=True)
            ref_mask, ref_scores = twins.select_prefill_reference(query, ck, q_pos, num_blocks, cfg,
                                                                  lookahead=lookahead, return_scores=True)
            blocks = torch.arange(num_blocks, device=device).view(1, 1, 1, -1)
            valid = blocks <= (q_pos // cfg.block_size)[:, None, :, None]
            fin = torch.isfinite(ref_scores) & valid
            err = ((scores[fin] - ref_scores[fin]).abs().max() / ref_scores[fin].abs().max()).item()
            rule_exact = torch.equal(mask, reference.select_blocks(scores.nan_to_num(0.0), q_pos, cfg))
            rows.append({"groups": groups or "forecast", "lookahead": lookahead,
                         "rows_equal": float((mask == ref_mask).all(-1).float().mean()),
                         "selected_recall": round(float((mask & ref_mask).sum() / ref_mask.sum()), 6),
                         "score_max_rel_err": err, "rule_exact_on_kernel_scores": rule_exact})
            print("kernel_check", rows[-1], flush=True)
    return rows


def git_commit(given: str | None = None) -> str:
    """``given``, else the short commit of the repository's ``HEAD``, else ``"unknown"``."""
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_line() -> str:
    """``"<torch version> <CUDA device name or cpu>"``."""
    return f"{torch.__version__} {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}"


def write_device_txt(out: Path) -> None:
    """``OUT/device.txt``: the UTC time and :func:`device_line`, also printed."""
    text = f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}\n{device_line()}\n"
    print(text, end="", flush=True)
    (out / "device.txt").write_text(text)


def sparda_cli() -> tuple[list[str], dict]:
    """The command prefix that runs this checkout's ``sparda`` CLI (``python -m sparda.cli``)
    and the environment for it (``ROOT/src`` first on ``PYTHONPATH``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return [sys.executable, "-m", "sparda.cli"], env


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> int:
    """Run ``cmd`` with stdout and stderr merged, echoed here and written to ``log``, and
    its wall time appended as ``"<seconds> s wall"``; returns its exit status."""
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as handle:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            sys.stdout.write(line)
            handle.write(line)
        status = proc.wait()
        wall = f"{time.perf_counter() - start:.2f} s wall\n"
        sys.stdout.write(wall)
        handle.write(wall)
    sys.stdout.flush()
    return status
