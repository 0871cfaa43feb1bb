"""Long-context evaluation tasks (design §8): name -> seeded generator
``make(tokenizer, haystack, context_tokens, depth, seed)`` of :class:`TaskSample`.
"""

from __future__ import annotations

from sparda.errors import SpardaError
from sparda.eval.tasks.common import NOISE, TaskSample
from sparda.eval.tasks.niah import make_niah
from sparda.eval.tasks.passkey import make_passkey
from sparda.eval.tasks.variable_tracking import make_variable_tracking
from sparda.eval.tasks.words import make_common_words, make_frequent_words


def _passkey(haystack_kind: str):
    def make(tokenizer, haystack, context_tokens, depth, seed):
        text = haystack if haystack_kind == "real" else NOISE * (context_tokens // 20 + 10)
        s = make_passkey(tokenizer, text, context_tokens - 40, depth, seed)
        name = "passkey" if haystack_kind == "real" else "passkey-synth"
        return TaskSample(task=name, prompt=s.prompt, answers=(s.answer,), metric="contains", depth=depth,
                          context_tokens=context_tokens, max_new_tokens=16)
    return make


def _niah(kind: str, synthetic: bool = False):
    def make(tokenizer, haystack, context_tokens, depth, seed):
        sample = make_niah(tokenizer, NOISE if synthetic else haystack, context_tokens, depth, seed, kind=kind)
        if synthetic:
            sample = TaskSample(**{**sample.__dict__, "task": sample.task + "-synth"})
        return sample
    return make


#: task name -> generator ``(tokenizer, haystack, context_tokens, depth, seed) -> TaskSample``
TASKS = {
    "passkey": _passkey("real"),
    "passkey-synth": _passkey("synthetic"),
    "niah-single": _niah("single"),
    "niah-single-synth": _niah("single", synthetic=True),
    "niah-multikey": _niah("multikey"),
    "niah-multivalue": _niah("multivalue"),
    "niah-multiquery": _niah("multiquery"),
    "vt": lambda tok, hay, n, depth, seed: make_variable_tracking(tok, NOISE, n, seed),
    "cwe": lambda tok, hay, n, depth, seed: make_common_words(tok, n, seed),
    "fwe": lambda tok, hay, n, depth, seed: make_frequent_words(tok, n, seed),
}

#: tasks whose score does not depend on a needle depth
DEPTHLESS = ("vt", "cwe", "fwe")


def make_sample(task: str, tokenizer, haystack: str, context_tokens: int, depth: float, seed: int) -> TaskSample:
    """Generate one sample of ``task``. Raises SpardaError for an unknown task name."""
    if task not in TASKS:
        raise SpardaError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task](tokenizer, haystack, context_tokens, depth, seed)


__all__ = ["TASKS", "DEPTHLESS", "TaskSample", "make_sample"]
