"""`sparda serve` on the bundled model answers the passkey demo through the openai client
(slow: two ~7K-token prefills on the CPU; run with `pytest -m slow`)."""

import concurrent.futures
import signal

import openai
import pytest

from sparda.data import heldout_text
from sparda.eval.tasks.passkey import make_passkey

from test_serve_cli import start_serve

pytestmark = pytest.mark.slow


def test_bundled_model_answers_the_passkey_demo_streamed_and_not(bundled_tokenizer):
    sample = make_passkey(bundled_tokenizer, heldout_text(), 7000, 0.5, 0)  # `sparda demo`'s prompt
    proc, url, log = start_serve("--dense-prefill", "--device", "cpu", "--max-batch", "2", "--max-model-len", "7200")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        kwargs = dict(model=name, messages=[{"role": "user", "content": sample.prompt}], max_tokens=24, temperature=0)

        def streamed():
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(lambda: client.chat.completions.create(**kwargs).choices[0].message.content)
            chunks = pool.submit(streamed)
            plain, chunks = plain.result(), chunks.result()
        assert sample.answer in plain, plain
        assert chunks == plain
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
