"""Checkpoints of Forecast training: everything a resumed run needs to continue bit for bit,
and a SIGINT that stops at the end of the current step with a checkpoint written.

``OUT.state.pt`` (``torch.save``, written atomically) holds the fp32 Forecast weights, the
AdamW state, the data order (:meth:`sparda.training.data.Batches.state_dict`), the step
count and the per-step history; the query tokens of a step depend on ``(seed, step,
sequence)`` only (:func:`sparda.training.step.query_positions`). With the same command,
a run of ``a`` steps resumed to ``a + b`` gives the same weights as one run of ``a + b``
steps, bit for bit (same device, same number of threads).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from sparda.errors import SpardaError
from sparda.io import atomic_output

#: keys of the state file
STATE_KEYS = ("forecast", "optimizer", "data", "step", "history", "run")


class Interrupted(SpardaError):
    """Training stopped by SIGINT after a checkpoint was written (exit code 130)."""

    exit_code = 130


def state_path(out: Path) -> Path:
    """Where the checkpoint state of weights file ``out`` lives: ``OUT.state.pt``."""
    return out.with_name(out.name + ".state.pt")


def save_state(path: Path, forecast, optimizer, batches, step: int, history: list, run: dict) -> None:
    """Write the checkpoint state atomically (no half-written file; SpardaError on failure)."""
    with atomic_output(path) as tmp:
        torch.save({"forecast": forecast.state_dict(), "optimizer": optimizer.state_dict(),
                    "data": batches.state_dict(), "step": step, "history": list(history), "run": dict(run)}, tmp)


def load_state(path: Path, device) -> dict:
    """Read a checkpoint state written by :func:`save_state` onto ``device``.

    Raises SpardaError: an unreadable file or one without the expected keys.
    """
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # torch raises pickle / zip / OS errors alike
        raise SpardaError(f"--resume: cannot read the checkpoint state {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise SpardaError(f"--resume: {path} is not a train-forecast checkpoint of this version; "
                          "start afresh without --resume")
    return state


def check_resumable(run: dict, saved: dict) -> None:
    """Refuse to resume with settings that change the data order or the loss.

    ``run`` / ``saved``: the settings that must match (seq_len, batch_size, seed, queries,
    preset, frozen_attention, data). Raises SpardaError naming the first difference.
    """
    for key, value in run.items():
        if key in saved and saved[key] != value:
            raise SpardaError(f"--resume: the checkpoint was trained with {key} {saved[key]!r}, this run "
                              f"asks for {value!r}; use the same value or start afresh without --resume")


@contextmanager
def stop_on_sigint():
    """While active, a first SIGINT (Ctrl-C) only sets the yielded ``threading.Event``: the
    training loop finishes its step, writes a checkpoint and raises :class:`Interrupted`. A
    second SIGINT interrupts at once (``KeyboardInterrupt``). Outside the main thread the
    handler cannot be installed and Ctrl-C keeps its default behaviour."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
