"""Shared fixtures: fresh random seeds, tiny random Llama-family checkpoints, the bundled model."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random

import numpy as np
import pytest
import torch

#: environment variable that replays a failed test's inputs: SPARDA_TEST_SEED=N pytest ...
SEED_ENV = "SPARDA_TEST_SEED"
#: environment variable that replays the random models of module- and session-scoped fixtures
#: (shared by several tests, so drawn from a seed of the whole run, not of one test)
SESSION_SEED_ENV = "SPARDA_SESSION_SEED"
SESSION_SEED = int(os.environ.get(SESSION_SEED_ENV) or random.SystemRandom().randrange(2**31))


def derived_seed(*parts) -> int:
    """A seed in ``[0, 2^31)`` fixed by :data:`SESSION_SEED` and ``parts`` (e.g. a fixture's
    module and name), whatever ran before: a shared fixture replays on its own."""
    digest = hashlib.sha256(repr((SESSION_SEED, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 2**31


@contextlib.contextmanager
def seeded(seed: int):
    """Seed torch, numpy and ``random`` inside the block; restore their states after it."""
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


def pytest_report_header(config):
    return f"sparda session seed={SESSION_SEED} (replay shared fixtures: {SESSION_SEED_ENV}={SESSION_SEED})"


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture shared beyond one test (module, class, package or session scope) is built
    under :func:`derived_seed` of its scope's node and name, not under whatever random state
    the tests before it left: a failed test replays with its fixtures' random models."""
    if fixturedef.scope == "function":
        yield
        return
    with seeded(derived_seed(request.node.nodeid, fixturedef.argname)):
        yield


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Seed torch, numpy and ``random`` with a fresh seed for each test (or ``$SPARDA_TEST_SEED``).

    The seed is stored on the test item; :func:`pytest_runtest_makereport` adds a
    ``sparda seed`` section (``seed=N``, the session seed of the shared fixtures and the
    replay command) to a failed test's report.
    Tests that need their own generators derive them from this seed (``torch.initial_seed()``).
    """
    env = os.environ.get(SEED_ENV)
    seed = int(env) if env else random.SystemRandom().randrange(2**31)
    request.node.sparda_seed = seed
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Print the seed of a failed (or erroring) test, so its inputs can be replayed."""
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "sparda_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("sparda seed", f"seed={seed} session seed={SESSION_SEED}  (replay: "
                                               f"{SESSION_SEED_ENV}={SESSION_SEED} {SEED_ENV}={seed} "
                                               f"python3 -m pytest '{item.nodeid}')"))


@pytest.fixture(scope="session")
def bundled_dir():
    """The bundled SmolLM2-135M-Instruct converted to a safetensors directory (cached)."""
    from sparda.model.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def bundled_tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_dir)


TINY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)


def tiny_config(arch: str, vocab_size: int, **extra):
    """A transformers config of a tiny random model of architecture ``arch``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    kwargs = dict(TINY, vocab_size=vocab_size, **extra)
    if arch == "qwen3":
        kwargs.setdefault("head_dim", 16)
    if arch == "llama":
        kwargs.setdefault("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 512})
    if arch == "qwen2":
        kwargs.setdefault("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    return cls(**kwargs)


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory, bundled_tokenizer):
    """Factory: ``make_tiny(arch, **config) -> directory`` of a random tiny checkpoint
    saved with ``save_pretrained`` (plus the bundled tokenizer)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(arch: str, **extra):
        key = (arch, repr(sorted(extra.items())))
        if key not in made:
            config = tiny_config(arch, len(bundled_tokenizer), **extra)
            # drawn from the session seed and the key: the same weights whichever test asks first
            with seeded(derived_seed("make_tiny", *key)), torch.no_grad():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                for p in model.parameters():  # larger weights than the default init: peaky logits
                    if p.dim() > 1:
                        p.normal_(0, 0.08)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            bundled_tokenizer.save_pretrained(path)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny decode steps are dominated by thread hand-offs
    on a busy 2-core machine (about 10x faster on one thread). Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
