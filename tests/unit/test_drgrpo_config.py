"""`algorithm.advantage = "drgrpo"` is Dr. GRPO as the paper defines it (Liu et al. 2025): no std
scaling *and* a constant loss normaliser, so loss_aggregation defaults to
"seq_mean_token_sum_norm" with it and another is refused naming both keys (r − mean with another
normaliser is "grpo" with scale_rewards = "none"); other advantages keep "token_mean"; what a run
resolved survives its config.toml; the normaliser is the generation budget, for multi-turn too."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.schema import AlgorithmConfig, Config, ConfigError, config_to_toml, load_config


def test_drgrpo_brings_its_constant_normaliser() -> None:
    assert load_config(None, ["algorithm.advantage=drgrpo"]).algorithm.loss_aggregation == "seq_mean_token_sum_norm"
    assert AlgorithmConfig(advantage="drgrpo").loss_aggregation == "seq_mean_token_sum_norm"
    assert Config.model_validate({"algorithm": {"advantage": "drgrpo"}}).algorithm.loss_aggregation == "seq_mean_token_sum_norm"


def test_an_explicit_constant_normaliser_is_kept(tmp_path: Path) -> None:
    cfg = load_config(None, ["algorithm.advantage=drgrpo", "algorithm.loss_aggregation=seq_mean_token_sum_norm"])
    assert cfg.algorithm.loss_aggregation == "seq_mean_token_sum_norm"


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_another_normaliser_is_refused_naming_both_keys(aggregation: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.advantage=drgrpo", f"algorithm.loss_aggregation={aggregation}"])
    message = str(err.value)
    assert "algorithm.advantage" in message and "algorithm.loss_aggregation" in message and "\n" not in message
    recipe = tmp_path / "recipe.toml"  # set in a recipe file, the advantage from --set: the same
    recipe.write_text(f'[algorithm]\nloss_aggregation = "{aggregation}"\n')
    with pytest.raises(ConfigError, match="algorithm.loss_aggregation"):
        load_config(recipe, ["algorithm.advantage=drgrpo"])
    assert load_config(recipe, ["algorithm.advantage=grpo", "algorithm.scale_rewards=none"]).algorithm.loss_aggregation == aggregation


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_other_advantages_keep_token_mean(advantage: str) -> None:
    assert load_config(None, [f"algorithm.advantage={advantage}"]).algorithm.loss_aggregation == "token_mean"


def test_the_resolved_pair_survives_config_toml(tmp_path: Path) -> None:
    for overrides in (["algorithm.advantage=drgrpo"], ["algorithm.advantage=grpo", "algorithm.scale_rewards=none"]):
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


def test_the_constant_normaliser_is_the_generation_budget_for_multi_turn_too() -> None:
    single = load_config(None, ["run.backend=local", "algorithm.advantage=drgrpo", "rollout.max_new_tokens=12"])
    assert single.generation_budget == 12
    turns = ["run.backend=local", "task.environment=arithmetic_feedback", "rollout.max_new_tokens=12", "rollout.max_turns=3"]
    turns.append("train.row_tokens=256")
    assert load_config(None, turns).generation_budget == 36  # every turn's budget
    assert load_config(None, [*turns, "rollout.max_total_tokens=30"]).generation_budget == 30  # what an episode can hold
