"""Configuration validation and the CLI's one-line errors that name the fix."""

from __future__ import annotations

import pytest

from agentevo.cli import main
from agentevo.config import dump_config, load_config, parse_overrides
from agentevo.errors import ConfigError


def _one_line_error(capsys, argv: list[str]) -> str:  # noqa: ANN001
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    return err


def test_unknown_environment_error(capsys, tmp_path) -> None:  # noqa: ANN001
    err = _one_line_error(capsys, ["train", "bc", "--set", "env.name=minecraft", "--output-dir", str(tmp_path)])
    assert "unknown environment 'minecraft'" in err and "twx-cookingworld" in err


def test_impossible_value_error(capsys, tmp_path) -> None:  # noqa: ANN001
    err = _one_line_error(capsys, ["train", "bc", "--set", "optim.lr=-1", "--output-dir", str(tmp_path)])
    assert "optim.lr must be > 0 (got -1" in err
    err = _one_line_error(capsys, ["train", "--set", "optim.batch_size=10", "--set", "optim.micro_batch_size=4",
                                   "--output-dir", str(tmp_path)])
    assert "multiple of optim.micro_batch_size" in err


def test_missing_model_path_error(capsys, tmp_path) -> None:  # noqa: ANN001
    err = _one_line_error(capsys, ["train", "bc", "--set", f"model.path={tmp_path}/nowhere", "--output-dir", str(tmp_path)])
    assert "does not exist" in err and "model.path" in err and "null for the embedded tiny model" in err


def test_unknown_key_and_type_errors(capsys, tmp_path) -> None:  # noqa: ANN001
    err = _one_line_error(capsys, ["train", "--set", "optim.learning_rate=1", "--output-dir", str(tmp_path)])
    assert "unknown config key optim.'learning_rate'" in err and "lr" in err
    err = _one_line_error(capsys, ["train", "--set", "rollout.n_parallel=many", "--output-dir", str(tmp_path)])
    assert "rollout.n_parallel must be an integer" in err
    err = _one_line_error(capsys, ["train", "--config", str(tmp_path / "missing.yaml")])
    assert "does not exist" in err
    err = _one_line_error(capsys, ["train", "qevolve-typo", "--output-dir", str(tmp_path)])
    assert "unknown recipe 'qevolve-typo'" in err


def test_resume_of_a_non_run_folder(capsys, tmp_path) -> None:  # noqa: ANN001
    err = _one_line_error(capsys, ["resume", str(tmp_path)])
    assert "not a run folder" in err


def test_overrides_yaml_and_round_trip(tmp_path) -> None:  # noqa: ANN001
    assert parse_overrides(["a.b=3", "a.c=[x, y]", "d=null"]) == {"a": {"b": 3, "c": ["x", "y"]}, "d": None}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["novalue"])
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  name: twx-twc\n  n_test: 7\noptim:\n  lr: 0.01\n")
    cfg = load_config(path, ["optim.epochs=2", "env.params.max_steps=9", "optim.weight_decay=1e-3"])
    assert (cfg.env.name, cfg.env.n_test, cfg.optim.lr, cfg.optim.epochs) == ("twx-twc", 7, 0.01, 2.0)
    assert cfg.optim.weight_decay == 0.001  # YAML reads 1e-3 as a string; numbers in that form are accepted
    assert cfg.env.params == {"max_steps": 9}
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert dump_config(load_config(again)) == dump_config(cfg)


def test_envs_list(capsys) -> None:  # noqa: ANN001
    assert main(["envs", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("twx-cookingworld", "scienceworld", "alfworld", "webshop", "searchqa"):
        assert name in out


def test_env_parameter_of_another_environment(capsys, tmp_path) -> None:  # noqa: ANN001
    # the demo config's TextWorldExpress parameters do not fit SearchQA: the error names the parameter and the fix
    err = _one_line_error(capsys, ["train", "--config", "configs/demo_twx_bc.yaml", "--set", "env.name=searchqa",
                                   "--output-dir", str(tmp_path)])
    assert "has no parameter 'game_params'" in err and "env.params" in err and "corpus_path" in err


def test_envs_show_and_play(capsys, monkeypatch) -> None:  # noqa: ANN001
    assert main(["envs", "show", "searchqa"]) == 0
    out = capsys.readouterr().out
    assert "search[" in out and "hash" in out and "test" in out
    from agentevo.envs import make_env

    env = make_env("searchqa")
    task = env.tasks("train")[0]
    answers = iter(env.expert(task))
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    assert main(["envs", "play", "searchqa", "--split", "train", "--task", "0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("success")


def test_yaml_booleans_in_string_fields_say_to_quote() -> None:
    from agentevo.config import load_config
    from agentevo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"got False: YAML reads yes/no.*--set \"qevolve.buffer='no'\""):
        load_config(None, ["qevolve.buffer=no"])
    assert load_config(None, ["qevolve.buffer='refresh'", "model.path=null"]).qevolve.buffer == "refresh"


def test_a_single_string_for_a_list_of_strings_is_a_one_item_list() -> None:
    cfg = load_config(None, ["eval.splits=dev", "tracking.report_to=none"])
    assert cfg.eval.splits == ["dev"]
    assert cfg.tracking.report_to == ["none"]
    with pytest.raises(ConfigError, match="optim.betas must be a list of 2 values"):
        load_config(None, ["optim.betas=0.9"])


def test_bc_eval_epochs_are_checked_before_any_work() -> None:
    """BC's learning curve: increasing epochs inside the schedule, on a BC trained in this run, without LoRA."""
    assert load_config(None, ["optim.epochs=12", "bc.eval_epochs=[4,8]"]).bc.eval_epochs == [4, 8]
    with pytest.raises(ConfigError, match=r"bc.eval_epochs \[8, 4\] must be increasing epoch numbers, each once"):
        load_config(None, ["bc.eval_epochs=[8,4]"])
    with pytest.raises(ConfigError, match=r"bc.eval_epochs\[0\] must be >= 1 \(got 0\)"):
        load_config(None, ["bc.eval_epochs=[0,4]"])
    with pytest.raises(ConfigError, match=r"bc.eval_epochs \[4, 12\] must stay below optim.epochs \(12\)"):
        load_config(None, ["optim.epochs=12", "bc.eval_epochs=[4,12]"])
    with pytest.raises(ConfigError, match="but bc.warm_start_from starts from a BC trained elsewhere"):
        load_config(None, ["optim.epochs=12", "bc.eval_epochs=[4]", "bc.warm_start_from=runs/bc"])
    with pytest.raises(ConfigError, match="with model.lora.enabled set it to"):
        load_config(None, ["optim.epochs=12", "bc.eval_epochs=[4]", "model.lora.enabled=true"])
