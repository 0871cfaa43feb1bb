"""Checkpoints of Forecast training, ``OUT.state.pt``, and SIGINT handling (docs/forecast.md)."""

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
    """``OUT.state.pt`` beside weights file ``out``."""
    return out.with_name(out.name + ".state.pt")


def save_state(path: Path, forecast, optimizer, batches, step: int, history: list, run: dict) -> None:
    """Write the checkpoint state atomically (SpardaError if it cannot be written)."""
    with atomic_output(path) as tmp:
        torch.save({"forecast": forecast.state_dict(), "optimizer": optimizer.state_dict(),
                    "data": batches.state_dict(), "step": step, "history": list(history), "run": dict(run)}, tmp)


def load_state(path: Path, device) -> dict:
    """Read a :func:`save_state` file onto ``device`` (SpardaError: unreadable, or a key missing)."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # torch raises pickle / zip / OS errors alike
        raise SpardaError(f"--resume: cannot read the checkpoint state {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise SpardaError(f"--resume: {path} is not a train-forecast checkpoint of this version; "
                          "start afresh without --resume")
    return state


def check_resumable(run: dict, saved: dict) -> None:
    """Refuse (SpardaError naming the key) to resume with settings that change the data or loss."""
    for key, value in run.items():
        if key in saved and saved[key] != value:
            raise SpardaError(f"--resume: the checkpoint was trained with {key} {saved[key]!r}, this run "
                              f"asks for {value!r}; use the same value or start afresh without --resume")


@contextmanager
def stop_on_sigint():
    """Yield a ``threading.Event`` set by a first SIGINT; a second raises ``KeyboardInterrupt``
    (main thread only)."""
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
