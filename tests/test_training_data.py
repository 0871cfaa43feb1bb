"""Forecast training data: every input kind loads the documents written into it; packing
joins short documents with EOS and splits long ones; the batch order resumes exactly."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sparda.errors import SpardaError
from sparda.training.data import Batches, load_texts, pack
from sparda.training.sources import read_documents


def _docs(n: int) -> list[str]:
    rng = random.Random(torch.initial_seed())
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta\nnewline"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) + f" #{i}" for i in range(n)]


def test_jsonl_and_directory_inputs(tmp_path):
    """jsonl (field --text-column), plain text, markdown, a nested directory in sorted order;
    other suffixes and blank lines are skipped."""
    docs = _docs(7)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.jsonl").write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(docs[:3]))
                                            + "\n\n", encoding="utf-8")
    (tmp_path / "d" / "a.txt").write_text(docs[3], encoding="utf-8")
    (tmp_path / "d" / "sub" / "c.md").write_text(docs[4], encoding="utf-8")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\xff\xfe")
    single = tmp_path / "one.jsonl"
    single.write_text("\n".join(json.dumps({"body": t}) for t in docs[5:]), encoding="utf-8")
    got = read_documents([tmp_path / "d", single], "body")
    assert got == [docs[3]] + docs[:3] + [docs[4]] + docs[5:]
    texts, description = load_texts([str(single)], "body")
    assert texts == docs[5:] and str(single) in description


def test_jsonl_errors_name_the_line_and_the_option(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(SpardaError, match=r"x.jsonl:2 .*'text'.*--text-column"):
        read_documents([bad])
    bad.write_text('{"text": 3}\n', encoding="utf-8")
    with pytest.raises(SpardaError, match=r"x.jsonl:1: field 'text' is int"):
        read_documents([bad])
    with pytest.raises(SpardaError, match="training data not found"):
        read_documents([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpardaError, match="holds no .txt"):
        read_documents([tmp_path / "empty"])


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = _docs(9)
    path = tmp_path / "corpus.parquet"
    table = pa.table({"id": list(range(len(docs) + 1)), "content": docs + [None]})
    pq.write_table(table, path, row_group_size=4)  # several row groups, a null row
    assert read_documents([path], "content") == docs
    (tmp_path / "dir").mkdir()
    pq.write_table(table, tmp_path / "dir" / "part-0.parquet")
    assert read_documents([tmp_path / "dir"], "content") == docs
    with pytest.raises(SpardaError, match=r"no column 'text' \(columns: id, content\).*--text-column"):
        read_documents([path])
    with pytest.raises(SpardaError, match="column 'id' does not hold text"):
        read_documents([path], "id")


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = _docs(11)
    datasets.Dataset.from_dict({"text": docs, "n": list(range(11))}).save_to_disk(str(tmp_path / "ds"))
    assert read_documents([tmp_path / "ds"]) == docs
    split = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"t": docs[:4]}),
                                  "test": datasets.Dataset.from_dict({"t": docs[4:]})})
    split.save_to_disk(str(tmp_path / "dd"))
    assert read_documents([tmp_path / "dd"], "t") == docs[:4]
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"t": docs[:2]}),
                          "b": datasets.Dataset.from_dict({"t": docs[2:]})}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(SpardaError, match="splits a, b but no 'train'"):
        read_documents([tmp_path / "ab"], "t")


def test_missing_optional_library_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from sparda.training import sources

    path = tmp_path / "c.parquet"
    path.write_bytes(b"PAR1")
    real = importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("pyarrow", "datasets") else real(name, *a))
    with pytest.raises(SpardaError, match=r"needs the 'pyarrow' package; .*sparda\[parquet\]"):
        read_documents([path])
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "dataset_info.json").write_text("{}")
    (ds / "state.json").write_text("{}")
    with pytest.raises(SpardaError, match=r"needs the 'datasets' package; .*sparda\[datasets\]"):
        read_documents([ds])


class _CharTokenizer:
    """One token per character (ids = code points), EOS 0: packing is checked by hand."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_pack_joins_short_documents_with_eos_and_splits_long_ones():
    rng = random.Random(torch.initial_seed())
    seq_len = rng.randint(8, 20)
    docs = ["a" * rng.randint(1, seq_len // 2) for _ in range(3)] + ["b" * rng.randint(2 * seq_len, 3 * seq_len)]
    docs += ["c" * rng.randint(1, 5)]
    stream = []
    for d in docs:
        stream += [ord(c) for c in d] + [0]
    got = pack(docs, _CharTokenizer(), seq_len)
    num = len(stream) // seq_len
    assert got.dtype == torch.int64 and got.shape == (num, seq_len)
    assert got.flatten().tolist() == stream[:num * seq_len]  # long document spread over >= 2 rows
    assert sum(row.count(ord("b")) > 0 for row in got.tolist()) >= 2
    with pytest.raises(SpardaError, match="fewer than --seq-len"):
        pack(["ab"], _CharTokenizer(), 10)


def test_batches_resume_draws_the_same_sequence_of_batches():
    n, b = 7, 3
    seed = torch.initial_seed()
    full = Batches(n, b, seed)
    want = [full.next() for _ in range(9)]
    assert all(len(x) == b for x in want)
    passes = sum(want, [])
    for k in range(0, len(passes) - n + 1, n):  # every pass is a permutation
        assert sorted(passes[k:k + n]) == list(range(n))
    first = Batches(n, b, seed)
    got = [first.next() for _ in range(4)]
    state = first.state_dict()
    second = Batches(n, b, seed + 1)  # another seed: the state decides
    second.load_state_dict(state)
    got += [second.next() for _ in range(5)]
    assert got == want
