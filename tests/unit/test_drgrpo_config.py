"""`algorithm.advantage = "drgrpo"` is Dr. GRPO as the paper defines it (Liu et al. 2025): no std
scaling *and* a constant loss normaliser, so loss_aggregation defaults to
"seq_mean_token_sum_norm" with it; an explicit loss_aggregation is kept; other advantages keep
"token_mean"; what a run resolved survives its config.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.schema import AlgorithmConfig, Config, config_to_toml, load_config


def test_drgrpo_brings_its_constant_normaliser() -> None:
    assert load_config(None, ["algorithm.advantage=drgrpo"]).algorithm.loss_aggregation == "seq_mean_token_sum_norm"
    assert AlgorithmConfig(advantage="drgrpo").loss_aggregation == "seq_mean_token_sum_norm"
    assert Config.model_validate({"algorithm": {"advantage": "drgrpo"}}).algorithm.loss_aggregation == "seq_mean_token_sum_norm"


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_an_explicit_loss_aggregation_is_respected(aggregation: str, tmp_path: Path) -> None:
    cfg = load_config(None, ["algorithm.advantage=drgrpo", f"algorithm.loss_aggregation={aggregation}"])
    assert cfg.algorithm.loss_aggregation == aggregation
    recipe = tmp_path / "recipe.toml"  # set in a recipe file, the advantage from --set: the same
    recipe.write_text(f'[algorithm]\nloss_aggregation = "{aggregation}"\n')
    assert load_config(recipe, ["algorithm.advantage=drgrpo"]).algorithm.loss_aggregation == aggregation


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_other_advantages_keep_token_mean(advantage: str) -> None:
    assert load_config(None, [f"algorithm.advantage={advantage}"]).algorithm.loss_aggregation == "token_mean"


def test_the_resolved_pair_survives_config_toml(tmp_path: Path) -> None:
    for overrides in (["algorithm.advantage=drgrpo"], ["algorithm.advantage=drgrpo", "algorithm.loss_aggregation=token_mean"]):
        cfg = load_config(None, overrides)
        written = tmp_path / "config.toml"
        written.write_text(config_to_toml(cfg))
        assert load_config(written).algorithm == cfg.algorithm


def test_the_local_trainer_gets_the_dr_grpo_loss() -> None:
    from relayrl.backends.local.build import make_trainer
    from relayrl.models.loading import load_model_and_tokenizer, shipped_model_dir

    model, _ = load_model_and_tokenizer(shipped_model_dir())
    cfg = load_config(None, ["run.backend=local", "algorithm.advantage=drgrpo", "rollout.max_new_tokens=12"])
    loss = make_trainer(cfg, model, 1).settings.loss
    assert loss.aggregation == "seq_mean_token_sum_norm" and loss.max_completion_tokens == 12
