"""The prefetcher's CUDA stream protocol (sparda.cache.prefetch, sparda.cache.timestamps), on
the CPU: ``torch.cuda``'s streams, events and the device clock are replaced by recorders, so
each stamp, copy, wait and accounting is logged with the stream it was issued on. Checked:
the stamps sit where the module docs say (so that ``END - max(WAIT, READY)`` is the stall
after the copy's inputs were ready), and the slot attention waits for the slot diff's
outputs before it reads them (OffloadKVCache.attend)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sparda.cache.offload import OffloadKVCache
from sparda.cache.prefetch import Prefetcher
from sparda.cache.timestamps import DeviceClock
from sparda.config import SelectionConfig

NAMES = {DeviceClock.START: "START", DeviceClock.END: "END", DeviceClock.WAIT: "WAIT", DeviceClock.READY: "READY"}


class _Streams:
    """A log of ``(stream, what)`` and the fakes that write it."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.main = _Stream(self, "main")
        self.current = [self.main]
        self.events = 0

    def note(self, what: str) -> None:
        self.log.append((self.current[-1].name, what))

    def on(self, stream: str) -> list[str]:
        """What was issued on ``stream``, in order."""
        return [w for s, w in self.log if s == stream]

    def index(self, stream: str, what: str) -> int:
        return self.log.index((stream, what))


class _Stream:
    def __init__(self, streams: _Streams, name: str):
        self.streams, self.name = streams, name

    def wait_stream(self, other) -> None:
        self.streams.log.append((self.name, f"wait_stream {other.name}"))

    def wait_event(self, event) -> None:
        self.streams.log.append((self.name, f"wait_event {event.name}"))


class _Clock:
    START, END, WAIT, READY = DeviceClock.START, DeviceClock.END, DeviceClock.WAIT, DeviceClock.READY

    def __init__(self, streams: _Streams):
        self.streams = streams
        self.totals = torch.zeros(3, dtype=torch.long)

    def mark(self, layer: int, which: int) -> None:
        self.streams.note(f"{NAMES[which]} {layer}")

    def account(self, layer: int) -> None:
        self.streams.note(f"account {layer}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Turn a CPU Prefetcher into one that takes its CUDA path against recorders."""
    streams = _Streams()

    class Event:
        def __init__(self, *a, **k):
            self.name = f"e{streams.events}"
            streams.events += 1

        def record(self, stream) -> None:
            streams.log.append((stream.name, f"record {self.name}"))

    @contextlib.contextmanager
    def stream(s):
        streams.current.append(s)
        try:
            yield
        finally:
            streams.current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)

    def convert(pref: Prefetcher) -> Prefetcher:
        pref.cuda = True
        pref.stream, pref.select_stream = _Stream(streams, "copy"), _Stream(streams, "select")
        pref._clock = _Clock(streams)
        return pref

    return streams, convert


def _lookahead(streams, pref, layer, fetch):
    """Layer ``layer``'s lookahead as OffloadedForecastAttention issues it: selection and slot
    diff inside :meth:`Prefetcher.ahead`, then its prefetch."""
    with pref.ahead(layer):
        streams.note(f"select {layer}")
        fetch()


def test_lookahead_stamps(fake_cuda):
    streams, convert = fake_cuda
    pref = convert(Prefetcher(None, torch.device("cpu"), 4, 8, batch=2, timing=True))
    copy = lambda: streams.note("copy 2")
    _lookahead(streams, pref, 2, lambda: pref.fetch(2, copy, None, None, (), prefetch=True))
    streams.note("attention 1")
    pref.wait(2)
    # READY on the issuing stream after the selection chain, before the copy stream forks from it
    sel = streams.on("select")
    assert sel[:3] == ["wait_stream main", "select 2", "READY 2"] and sel[3].startswith("record ")
    selected = sel[3].split()[1]
    assert streams.index("select", "READY 2") < streams.index("copy", "wait_stream select")
    # START / END around the copy on the copy stream, its event after END
    cp = streams.on("copy")
    assert cp[:4] == ["wait_stream select", "START 2", "copy 2", "END 2"] and cp[4].startswith("record ")
    done = cp[4].split()[1]
    # WAIT on the compute stream before both waits, the accounting after them
    assert streams.on("main")[-4:] == ["WAIT 2", f"wait_event {selected}", f"wait_event {done}", "account 2"]
    assert streams.index("main", "attention 1") < streams.index("main", "WAIT 2")
    assert pref.timed_layers == {2} and not pref.pending and not pref._selected
    pref.reset()
    assert pref.timed_layers == {2}  # a replayed graph runs no Python: the layers stay known
    pref.set_timing(False)  # the timed graph goes: so do its layers
    assert pref.timed_layers == set() and pref.timeline() == []


def test_synchronous_fetch_counts_all_of_its_stall_as_transfer(fake_cuda):
    """On the compute stream READY is stamped no later than WAIT, so max(WAIT, READY) = WAIT."""
    streams, convert = fake_cuda
    pref = convert(Prefetcher(None, torch.device("cpu"), 4, 8, batch=2, timing=True))
    pref.fetch(3, lambda: streams.note("copy 3"), None, None, (), prefetch=False)
    assert streams.on("main") == ["READY 3", "WAIT 3", "START 3", "copy 3", "END 3", "account 3"]
    assert streams.on("copy") == [] and not pref.pending
    pref.wait(3)  # nothing pending: nothing issued
    assert len(streams.log) == 6


def test_attention_reads_the_slot_diff_after_the_selection_stream(fake_cuda, monkeypatch):
    """OffloadKVCache.attend: the slot attention is issued only after the compute stream
    waited for the selection chain that wrote the ids it reads and for the layer's copy."""
    import sparda.cache.offload as offload_mod

    streams, convert = fake_cuda
    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1,
                          local_blocks=2, topk_blocks=3)
    cache = OffloadKVCache(2, 1, 2, 16, 96, cfg, torch.float32, "cpu", engine="sync", resident_layers=(0,),
                           timing=True)
    convert(cache.prefetcher)

    def attention(q, *args, **kwargs):
        streams.note("attention")
        return q

    monkeypatch.setattr(offload_mod.kernels, "decode_attention_slots", attention)
    pos = torch.tensor([60])
    ids = torch.tensor([[[0, 1, 2], [0, 2, -1]]], dtype=torch.int32)
    _lookahead(streams, cache.prefetcher, 1, lambda: cache.fetch(1, ids, pos, prefetch=True))
    (selected,) = [w.split()[1] for w in streams.on("select") if w.startswith("record ")]
    (done,) = [w.split()[1] for w in streams.on("copy") if w.startswith("record ")]
    cache.attend(1, torch.zeros(1, 2, 1, 16), pos + 1, pos)
    main = streams.on("main")
    assert main.index(f"wait_event {selected}") < main.index("attention")
    assert main[-5:] == ["WAIT 1", f"wait_event {selected}", f"wait_event {done}", "account 1", "attention"]
