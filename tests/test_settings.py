from pathlib import Path

import pytest

from trainwise import settings

# The settings table lives in docs/settings.md (the README links it).
README = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text()


@pytest.mark.parametrize("setting", settings.SETTINGS, ids=lambda s: s.name)
def test_every_setting_is_documented_in_the_readme(setting):
    assert f"`{setting.name}`" in README
    assert f"| `{setting.name}` | `{setting.shown_default}` |" in README


def test_environment_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "state"))
    assert settings.home_dir() == tmp_path / "state"
    assert settings.mlflow_uri() == f"sqlite:///{tmp_path / 'state' / 'mlflow.db'}"
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", "http://127.0.0.1:5000")
    assert settings.mlflow_uri() == "http://127.0.0.1:5000"


def test_unknown_setting_lists_known_ones():
    with pytest.raises(KeyError, match="TRAINWISE_HOME"):
        settings.get("TRAINWISE_NOPE")


# --- issue 8, defect 10: a bad value names the variable, the value and the valid range ---------
@pytest.mark.parametrize("value", ["abc", "1.5", "-0.1", "nan", "1"])
def test_bad_pruning_rate_names_variable_value_and_range(monkeypatch, value):
    monkeypatch.setenv("TRAINWISE_PRUNING_RATE", value)
    with pytest.raises(settings.SettingError,
                       match=rf"TRAINWISE_PRUNING_RATE='{value}'.*\[0, 1\)"):
        settings.pruning_rate()


def test_pruning_rate_reads_a_good_value(monkeypatch):
    monkeypatch.setenv("TRAINWISE_PRUNING_RATE", "0.25")
    assert settings.pruning_rate() == 0.25
    monkeypatch.delenv("TRAINWISE_PRUNING_RATE")
    assert settings.pruning_rate() == 0.3


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_bad_torch_threads_names_the_variable_not_an_internal_field(monkeypatch, value):
    monkeypatch.setenv("TRAINWISE_TORCH_THREADS", value)
    with pytest.raises(settings.SettingError, match=rf"TRAINWISE_TORCH_THREADS='{value}'.*\[1,"
                       ) as caught:
        settings.torch_threads()
    assert "num_threads" not in str(caught.value)


def test_home_that_is_a_file_names_the_variable(monkeypatch, tmp_path):
    home = tmp_path / "home-file"
    home.write_text("x")
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    with pytest.raises(settings.SettingError, match=r"TRAINWISE_HOME=.*is a file"):
        settings.home_dir()
    monkeypatch.setenv("TRAINWISE_HOME", str(home / "below"))
    with pytest.raises(settings.SettingError, match=r"TRAINWISE_HOME=.*cannot be created"):
        settings.home_dir()


def test_check_all_lists_every_bad_setting(monkeypatch):
    monkeypatch.setenv("TRAINWISE_PRUNING_RATE", "abc")
    monkeypatch.setenv("TRAINWISE_TORCH_THREADS", "0")
    with pytest.raises(settings.SettingError) as caught:
        settings.check_all()
    assert "TRAINWISE_PRUNING_RATE" in str(caught.value)
    assert "TRAINWISE_TORCH_THREADS" in str(caught.value)


# --- the CLI checks arguments and settings before the data build -----------------------------
def _demo_refused(capsys, argv: list[str]) -> str:
    from trainwise import cli

    prepared = []  # the step right before the ~35 s data build (headless.run_demo)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "_prepare_environment", lambda: prepared.append(True))
        assert cli.main(argv) == 2
    assert prepared == [], "refused before the data build"
    assert not (settings.home_dir() / "shards").exists()
    return capsys.readouterr().err


def test_demo_with_unknown_partition_lists_valid_ones(capsys):
    err = _demo_refused(capsys, ["demo", "--partition", "nope"])
    assert "unknown partition 'nope'" in err
    assert all(name in err for name in ("tinyshakespeare", "mnist", "pystdlib"))
    assert "Traceback" not in err and "dagster" not in err.lower()


def test_demo_with_path_partition_or_zero_steps_is_refused(capsys):
    assert "path separator" in _demo_refused(capsys, ["demo", "--partition", "../etc"])
    assert "--steps 0" in _demo_refused(capsys, ["demo", "--steps", "0"])


@pytest.mark.parametrize("name, value", [("TRAINWISE_PRUNING_RATE", "abc"),
                                         ("TRAINWISE_TORCH_THREADS", "0")])
def test_demo_with_a_bad_setting_is_refused_before_the_data_build(capsys, monkeypatch, name,
                                                                  value):
    monkeypatch.setenv(name, value)
    assert f"{name}='{value}'" in _demo_refused(capsys, ["demo"])


def test_demo_with_home_a_file_is_refused(capsys, monkeypatch, tmp_path):
    from trainwise import cli

    home = tmp_path / "home-file"
    home.write_text("x")
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    assert cli.main(["demo"]) == 2
    assert "TRAINWISE_HOME=" in capsys.readouterr().err
