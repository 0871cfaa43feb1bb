import pytest

from sparda import SelectionConfig, SpardaConfig, SpardaError


def test_presets_match_spec():
    paper = SelectionConfig.from_preset("paper")
    assert (paper.init_blocks, paper.local_blocks, paper.topk_blocks, paper.dense_len) == (1, 33, 62, 8192)
    assert paper.budget_tokens == 6144
    small = SelectionConfig.from_preset("small")
    assert small.budget_blocks == 21 and small.budget_tokens == 1344 and small.dense_len == 2048


def test_overrides_apply_and_none_is_ignored():
    cfg = SelectionConfig.from_preset("small", topk_blocks=3, local_blocks=None)
    assert cfg.topk_blocks == 3 and cfg.local_blocks == 4


@pytest.mark.parametrize("overrides, word", [
    (dict(topk_blocks=-1), "topk_blocks"),
    (dict(init_blocks=-2), "init_blocks"),
    (dict(local_blocks=0), "local_blocks"),
    (dict(block_size=40), "divide"),
    (dict(block_size=0), "block_size"),
])
def test_invalid_budgets_are_one_line_errors(overrides, word):
    with pytest.raises(SpardaError) as err:
        SelectionConfig.from_preset("small", **overrides)
    assert word in str(err.value) and "\n" not in str(err.value)


def test_unknown_preset_method_and_field():
    with pytest.raises(SpardaError, match="preset"):
        SelectionConfig.from_preset("huge")
    with pytest.raises(SpardaError, match="method"):
        SpardaConfig(method="magic")
    with pytest.raises(SpardaError, match="field"):
        SelectionConfig.from_preset("small", topk=3)


def test_prefill_mode_per_preset_and_flags():
    from sparda.config import resolve_sparse_prefill

    assert resolve_sparse_prefill("small") is False and resolve_sparse_prefill("paper") is True
    for preset in ("small", "paper"):
        assert resolve_sparse_prefill(preset, True) is True and resolve_sparse_prefill(preset, False) is False
        assert resolve_sparse_prefill(preset, dense_prefill=True) is False
        assert resolve_sparse_prefill(preset, dense_prefill=False) is True
        assert resolve_sparse_prefill(preset, True, False) is True
    for bad, word in (((True, True), "contradict"), ((1, None), "True or False"), ((None, "yes"), "True or False")):
        with pytest.raises(SpardaError, match=word):
            resolve_sparse_prefill("small", *bad)
    with pytest.raises(SpardaError, match="preset"):
        resolve_sparse_prefill("huge")


def test_llm_and_cli_prefill_defaults(make_tiny, monkeypatch):
    from click.testing import CliRunner

    from sparda import LLM
    from sparda.cli import main

    # the paper budget (96 blocks of 64) would cover the tiny model's 4096-token context, which
    # is refused (check_budget): a context of 8192 tokens that it does not cover
    path = str(make_tiny("llama", max_position_embeddings=8192))
    assert LLM(path, method="sparse", device="cpu").config.sparse_prefill is False
    assert LLM(path, method="sparse", device="cpu", preset="paper").config.sparse_prefill is True
    assert LLM(path, method="sparse", device="cpu", sparse_prefill=True).config.sparse_prefill is True
    assert LLM(path, method="sparse", device="cpu", preset="paper", dense_prefill=True).config.sparse_prefill is False
    with pytest.raises(SpardaError, match="contradict"):
        LLM(path, method="sparse", device="cpu", sparse_prefill=True, dense_prefill=True)
    seen = {}
    real = LLM.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen["sparse_prefill"] = self.config.sparse_prefill

    runner = CliRunner()
    for flags, want in (([], False), (["--sparse-prefill"], True), (["--dense-prefill"], False),
                        (["--preset", "paper", "--dense-len", "64"], True), (["--preset", "paper", "--dense-prefill"], False)):
        monkeypatch.setattr(LLM, "__init__", spy)
        result = runner.invoke(main, ["generate", "--model", path, "--method", "sparse", "--device", "cpu",
                                      "--max-new-tokens", "1", "-p", "hi", *flags])
        monkeypatch.undo()
        assert result.exit_code == 0, result.output
        assert seen["sparse_prefill"] is want, flags
