"""Decode batch buckets (design §3.13): how many cache rows a decode step runs.

The scheduler gives every request the lowest free row, so the decoding rows crowd the
front of the cache. A decode step runs only rows ``[0, b)``, ``b`` the smallest bucket
that holds the highest decoding row; the rows past ``b`` are not touched. On CUDA each
bucket has its own captured graph (:mod:`sparda.engine.graph_runner`), as vLLM captures
one per ``--cuda-graph-sizes`` entry.

By default there is one bucket, the cache's rows: every step runs every row.
``cuda_graph_sizes="auto"`` (:data:`~sparda.config.AUTO_BUCKETS`) turns on the buckets of
:func:`auto_sizes`, a list sets them.
"""

from __future__ import annotations

import bisect

from sparda.config import AUTO_BUCKETS

#: the automatic buckets below the cache's rows: 1, 2, 4, then every multiple of this
AUTO_STRIDE = 8


def auto_sizes(rows: int) -> tuple[int, ...]:
    """The buckets of ``cuda_graph_sizes="auto"`` for a cache of ``rows`` rows: 1, 2, 4 and the
    multiples of :data:`AUTO_STRIDE` below ``rows``, then ``rows`` (at most 7 padding rows a step)."""
    small = [n for n in (1, 2, 4) if n < rows]
    return tuple(small + list(range(AUTO_STRIDE, rows, AUTO_STRIDE)) + [rows])


def decode_buckets(sizes: tuple[int, ...] | str | None, rows: int) -> tuple[int, ...]:
    """The buckets of a cache of ``rows`` rows, ascending, the last ``rows`` itself (so that
    every step fits one), from ``cuda_graph_sizes`` (checked by the config): ``None`` (the
    default) only ``rows``, every step runs every row; ``"auto"`` :func:`auto_sizes`; a
    tuple its sizes below ``rows``."""
    if sizes is None:
        return (rows,)
    if sizes == AUTO_BUCKETS:
        return auto_sizes(rows)
    return tuple(n for n in sizes if n < rows) + (rows,)


def bucket_for(buckets: tuple[int, ...], needed: int) -> int:
    """The smallest of ``buckets`` (ascending) that is at least ``needed`` rows (the highest
    decoding row + 1). Raises ValueError past the largest (more rows than the cache)."""
    i = bisect.bisect_left(buckets, needed)
    if i == len(buckets):
        raise ValueError(f"a decode step of {needed} rows exceeds the cache's {buckets[-1]} rows")
    return buckets[i]
