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
