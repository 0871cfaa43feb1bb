"""lm-eval with --model sparda (method dense) against lm-eval's own hf model, on local tasks."""

import json
import random

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install sparda[lm-eval])")

TASKS = """
task: sparda_local_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
KINDS = {
    "mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["e", "\\n"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _write_tasks(root, rng):
    from sparda.data import heldout_text

    words = heldout_text()[20000:40000].split()
    phrase = lambda n: " ".join(words[(s := rng.randrange(len(words) - n)):s + n])  # noqa: E731
    docs = {
        "mc": [{"question": phrase(rng.randrange(8, 30)), "choices": [phrase(rng.randrange(1, 5)) for _ in range(3)],
                "answer": rng.randrange(3)} for _ in range(4)],
        "ppl": [{"text": phrase(rng.randrange(40, 120))} for _ in range(2)],
        "gen": [{"prompt": phrase(rng.randrange(8, 30)), "target": "x"} for _ in range(3)],
    }
    for kind, rows in docs.items():
        data = root / f"{kind}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{kind}.yaml").write_text(TASKS.format(kind=kind, data=data, cache=root / "hf-datasets")
                                           + KINDS[kind])


def _run(model, args, root, batch_size):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=args, tasks=[f"sparda_local_{k}" for k in KINDS],
                                   task_manager=TaskManager(include_path=str(root)), batch_size=batch_size,
                                   log_samples=True, bootstrap_iters=0, device="cpu")


def test_sparda_dense_scores_equal_lm_evals_hf(tmp_path, make_tiny, fresh_seed, monkeypatch):
    import sparda.integrations.lm_eval  # noqa: F401  (registers --model sparda)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path, random.Random(fresh_seed))
    path = make_tiny("llama")
    ours = _run("sparda", f"pretrained={path},method=dense", tmp_path, batch_size=3)
    theirs = _run("hf", f"pretrained={path},dtype=float32", tmp_path, batch_size=1)
    for task in (f"sparda_local_{k}" for k in KINDS):
        a, b = ours["samples"][task], theirs["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b]
        for x, y in zip(a, b):
            mine, ref = x["filtered_resps"], y["filtered_resps"]
            if task.endswith("gen"):  # strings cut at the first stop string
                assert mine == ref and all("e" not in r and "\n" not in r for r in mine)
            elif task.endswith("mc"):  # (log p, is_greedy) per choice
                assert [g for _, g in mine] == [g for _, g in ref]
                assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in ref], rel=1e-4, abs=1e-3)
            else:  # rolling log-likelihood of the text
                assert mine == pytest.approx(ref, rel=1e-4)
        for metric, value in theirs["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-4), (task, metric)


def test_the_documented_aliases_still_work():
    """``sparda.lm_eval_model`` (import and ``python -m``) and ``sparda.hf`` alias the modules
    under ``sparda.integrations``, so the documented entry points keep working."""
    import subprocess
    import sys

    import sparda.hf
    import sparda.integrations.hf
    import sparda.integrations.lm_eval
    import sparda.lm_eval_model
    from lm_eval.api.registry import get_model

    assert sparda.hf is sparda.integrations.hf and sparda.hf.enable is sparda.integrations.hf.enable
    assert sparda.lm_eval_model is sparda.integrations.lm_eval
    assert get_model("sparda") is sparda.integrations.lm_eval.SpardaLM
    res = subprocess.run([sys.executable, "-m", "sparda.lm_eval_model", "--model", "sparda", "--tasks", "list_groups",
                          "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--model_args" in res.stdout, res.stderr[-2000:]


def test_stop_length_against_brute_force(fresh_seed):
    """Where generate_until cuts: the first prefix whose text, special tokens included, holds a
    stop string (a brute force over every prefix), on random token pieces with a special token."""
    from sparda.integrations.lm_eval import SpardaLM

    pieces = ["a", "b", "\n", "<|end|>", "ab", "\n\n", "c"]
    special = {3}

    class Pieces:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids if not (skip_special_tokens and i in special))

    lm = object.__new__(SpardaLM)
    lm.tokenizer = Pieces()
    rng = random.Random(fresh_seed)
    for _ in range(200):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 12))]
        until = rng.sample(["\n\n", "<|end|>", "ba", "cc", "zz"], rng.randint(1, 3))
        brute = next((n for n in range(1, len(ids) + 1)
                      if any(s in "".join(pieces[i] for i in ids[:n]) for s in until)), len(ids))
        assert lm._stop_length(ids, until) == brute, (fresh_seed, ids, until)
