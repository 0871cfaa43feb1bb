"""Decode batch buckets (design §3.13): how many cache rows a decode step runs.

The scheduler gives every request the lowest free row, so the decoding rows crowd the
front of the cache. A decode step runs only rows ``[0, b)``, ``b`` the smallest bucket
that holds the highest decoding row; the rows past ``b`` are not touched. On CUDA each
bucket has its own captured graph (:mod:`sparda.engine.graph_runner`), as vLLM captures
one per ``--cuda-graph-sizes`` entry.
"""

from __future__ import annotations

import bisect

#: the default buckets below the cache's rows: 1, 2, 4, then every multiple of this
DEFAULT_STRIDE = 8


def default_sizes(rows: int) -> tuple[int, ...]:
    """The default buckets of a cache of ``rows`` rows: 1, 2, 4 and the multiples of
    :data:`DEFAULT_STRIDE` below ``rows``, then ``rows`` (at most 7 padding rows a step)."""
    small = [n for n in (1, 2, 4) if n < rows]
    return tuple(small + list(range(DEFAULT_STRIDE, rows, DEFAULT_STRIDE)) + [rows])


def decode_buckets(sizes: tuple[int, ...] | None, rows: int) -> tuple[int, ...]:
    """The buckets of a cache of ``rows`` rows, ascending: ``sizes`` (``cuda_graph_sizes``,
    checked by the config; ``None``: :func:`default_sizes`) below ``rows``, then ``rows``
    itself, so that every step fits one."""
    if sizes is None:
        return default_sizes(rows)
    return tuple(n for n in sizes if n < rows) + (rows,)


def bucket_for(buckets: tuple[int, ...], needed: int) -> int:
    """The smallest of ``buckets`` (ascending) that is at least ``needed`` rows (the highest
    decoding row + 1). Raises ValueError past the largest (more rows than the cache)."""
    i = bisect.bisect_left(buckets, needed)
    if i == len(buckets):
        raise ValueError(f"a decode step of {needed} rows exceeds the cache's {buckets[-1]} rows")
    return buckets[i]
