from pathlib import Path

import pytest

from trainwise import settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


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
