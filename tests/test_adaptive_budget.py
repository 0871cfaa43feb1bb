"""The mass-adaptive decode budget (design §3.12) end to end on a tiny random Llama, and
its options' refusals (one line naming the option as the caller spelt it)."""

from __future__ import annotations

import math

import pytest
import torch

from sparda.config import build_config, spell
from sparda.engine.llm import LLM
from sparda.errors import SpardaError

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=64, init_blocks=1, local_blocks=2,
             topk_blocks=6)
METHODS = ["sparse", "oracle", "sparda-random", "sparse-offload"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.mark.parametrize("options, word", [
    (dict(topp_mass=0.0), "topp_mass must be a number in (0, 1]"),
    (dict(topp_mass=1.5), "topp_mass must be a number in (0, 1]"),
    (dict(topp_mass=math.nan), "topp_mass must be a number in (0, 1]"),
    (dict(topp_mass=True), "topp_mass must be a number in (0, 1]"),
    (dict(topp_mass="0.5"), "topp_mass must be a number in (0, 1]"),
    (dict(min_blocks=8), "min_blocks=8 applies with topp_mass only"),
    (dict(topp_mass=0.9, min_blocks=2), "min_blocks must be an integer from 3 (init_blocks + local_blocks) to 9"),
    (dict(topp_mass=0.9, min_blocks=10), "min_blocks must be an integer from 3"),
    (dict(topp_mass=0.9, min_blocks=4.0), "min_blocks must be an integer, got 4.0"),
    (dict(topp_mass=0.9, method="quest"), "topp_mass applies to methods sparse, oracle, sparda"),
    (dict(topp_mass=0.9, method="streaming"), "not 'streaming'"),
])
def test_bad_options_are_one_line_errors(options, word):
    options = {"method": "sparse", **SMALL, **options}
    with pytest.raises(SpardaError) as err:
        build_config(cuda_available=False, **options)
    message = str(err.value)
    assert word in message and "\n" not in message
    option = message.split()[0].split("=")[0]  # the option the message is about, spelt as a flag on the CLI
    assert spell(message, "cli").startswith("--" + option.replace("_", "-"))


def test_options_reach_the_selection():
    sel = build_config(method="sparda", cuda_available=False, topp_mass=0.8, min_blocks=7, **SMALL).selection
    assert (sel.topp_mass, sel.min_blocks, sel.min_scored_blocks, sel.adaptive) == (0.8, 7, 4, True)
    sel = build_config(method="sparda", cuda_available=False, topp_mass=0.8, **SMALL).selection
    assert (sel.min_blocks, sel.min_scored_blocks) == (None, 0)
    assert not build_config(method="sparse", cuda_available=False, **SMALL).selection.adaptive


def _run(tiny, method, prompts, **options):
    llm = LLM(str(tiny), method=method, device="cpu", **SMALL, **options)
    return llm.generate(None, prompt_token_ids=prompts, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("method", METHODS)
def test_threshold_one_is_fixed_topk_and_small_reads_less(tiny, method):
    """``p = 1``: the fixed top-k's tokens and reads; a small ``p``: fewer blocks read (and,
    offloaded, copied) on the long row, all of them on the short one under ``dense_len``."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (300, 30)]
    fixed = _run(tiny, method, prompts)
    one = _run(tiny, method, prompts, topp_mass=1.0, min_blocks=4)
    assert [o.token_ids for o in one] == [o.token_ids for o in fixed]
    assert [o.stats["kv_read_fraction"] for o in one] == [o.stats["kv_read_fraction"] for o in fixed]
    small = _run(tiny, method, prompts, topp_mass=0.05)
    assert small[0].stats["kv_read_fraction"] < fixed[0].stats["kv_read_fraction"]
    assert small[1].stats["kv_read_fraction"] == 1.0
    if "offload" in fixed[0].stats:
        assert small[0].stats["offload"]["bytes_per_token"] <= fixed[0].stats["offload"]["bytes_per_token"]
    # the floor: min_blocks = the budget takes the fixed top-k whatever p
    floor = _run(tiny, method, prompts, topp_mass=0.05, min_blocks=sum(SMALL[k] for k in
                                                                      ("init_blocks", "local_blocks", "topk_blocks")))
    assert [o.token_ids for o in floor] == [o.token_ids for o in fixed]


def test_eval_runs_each_mass_beside_the_fixed_budget(tiny, tmp_path):
    """``sparda eval --topp-mass``: the adaptive methods also run at each mass (``@pP``); each
    record's ``kv_bytes_read_per_token`` is its K/V bytes times its read fraction, and the
    accuracy table shows it."""
    from sparda.eval.runner import EvalPlan, load_results, run_eval

    text = tmp_path / "haystack.txt"
    text.write_text("It was a fine morning in Highbury. Emma walked to the village and met Harriet.\n" * 60)
    plan = EvalPlan(text=str(text), tasks=("passkey",), methods=("dense", "sparse"), lengths=(400,), samples=1,
                    ppl_windows=1, out=str(tmp_path / "out"), model=str(tiny), device="cpu",
                    overrides={**SMALL, "dense_len": 0, "topk_blocks": 4}, topp_masses=(0.05, 1.0), batch_size=1)
    run_eval(plan, progress=False)
    records = {r["label"]: r for r in load_results(tmp_path / "out" / "results.jsonl")}
    assert set(records) == {"dense", "sparse", "sparse@p0.05", "sparse@p1"}
    assert [records[k]["topp_mass"] for k in ("sparse", "sparse@p0.05", "sparse@p1")] == [None, 0.05, 1.0]
    assert records["sparse@p1"]["completion"] == records["sparse"]["completion"]
    assert records["sparse@p1"]["kv_bytes_read_per_token"] == records["sparse"]["kv_bytes_read_per_token"]
    assert records["sparse@p0.05"]["kv_bytes_read_per_token"] < records["sparse"]["kv_bytes_read_per_token"]
    llm = LLM(str(tiny), method="dense", device="cpu")
    per_token = llm.model_runner.kv_bytes_per_token()
    for r in records.values():
        tokens = r["prompt_tokens"] + r["new_tokens"] - 1
        assert r["kv_bytes_read_per_token"] == pytest.approx(int(per_token * tokens) * r["kv_read_fraction"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| mean | n | KV MiB read / token |" in report


def test_hf_enable_takes_the_threshold_and_gives_llms_tokens(tiny):
    """``sparda.hf.enable(..., topp_mass=...)``: transformers' generate() decodes as ``LLM`` with
    the same threshold, reading what it reads."""
    from transformers import AutoModelForCausalLM

    import sparda.integrations.hf as hf

    ids = torch.randint(100, 20000, (260,)).tolist()
    options = dict(SMALL, topp_mass=0.1, min_blocks=4)
    expected = LLM(str(tiny), method="sparse", device="cpu", **options).generate(
        None, prompt_token_ids=[ids], max_new_tokens=8, ignore_eos=True)[0]
    model = hf.enable(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval(), method="sparse",
                      **options)
    assert hf.method_of(model).config.selection.topp_mass == 0.1
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(ids):].tolist() == expected.token_ids
    assert hf.cache_of(model).read_fraction() == pytest.approx(expected.stats["kv_read_fraction"], abs=1e-4)
