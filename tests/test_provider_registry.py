# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""Adding a compute provider is one module (issue 25, item 5): a class decorated with
`@register_provider(name)`, registered by naming its module in TRAINWISE_PROVIDER_MODULES, then
selected by TRAINWISE_PROVIDER like a built-in. `tests/_fake_provider.py` is such a module (the
`steady` cloud); here it trains a real run through `runs.run_training` and bills it. Bad names and
bad modules are clear errors naming the setting, before any step is trained."""

from __future__ import annotations

import sys
import time

import pytest

from cloud.providers import (
    ComputeProvider,
    LaunchFailedError,
    ProviderModuleError,
    UnknownProviderError,
    provider_class,
    provider_name,
    provider_names,
    registry,
)
from cloud.providers.aws import AwsProvider
from cloud.providers.emulated import EmulatedProvider
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    built_state,
    request,
    run,
    state,
)
from trainwise import gang, preflight, settings

FAKE_MODULE = "tests._fake_provider"


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as the package import left it (built-ins only), and the fake module not yet
    imported: so a test proves that naming the module is what registers it. Both are restored
    afterwards."""
    built_in = {name: cls for name, cls in registry._PROVIDERS.items()
                if cls.__module__.startswith("cloud.providers.")}
    monkeypatch.setattr(registry, "_PROVIDERS", dict(built_in))
    imported = sys.modules.pop(FAKE_MODULE, None)
    monkeypatch.delenv("TRAINWISE_PROVIDER", raising=False)
    monkeypatch.delenv("TRAINWISE_PROVIDER_MODULES", raising=False)
    yield registry._PROVIDERS
    # The module as it was: a copy imported here registered into the table just dropped.
    sys.modules.pop(FAKE_MODULE, None)
    if imported is not None:
        sys.modules[FAKE_MODULE] = imported


# --- registering by naming the module -----------------------------------------------------------
def test_a_module_named_in_the_setting_registers_its_provider(fresh_registry, monkeypatch):
    with pytest.raises(UnknownProviderError, match="'steady'.*emulated, aws"):
        provider_name("steady")
    assert FAKE_MODULE not in sys.modules
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", f" {FAKE_MODULE} , ")
    assert provider_name("steady") == "steady"
    assert provider_names() == ("emulated", "aws", "kubernetes", "steady")
    fake = sys.modules[FAKE_MODULE]
    assert provider_class("steady") is fake.SteadyProvider
    monkeypatch.setenv("TRAINWISE_PROVIDER", "steady")
    assert provider_name() == "steady"
    built = gang.provider_for_run("p3.2xlarge", "us-west-2")
    assert isinstance(built, fake.SteadyProvider) and built.name == "steady"


def test_run_training_on_the_module_provider_trains_and_bills(fresh_registry, state, monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", FAKE_MODULE)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "steady")
    started = time.monotonic()
    # No provider object passed: the run builds its own from the settings (provider_for_run).
    summary = run(state, request())
    wall_s = time.monotonic() - started
    assert summary.status == "completed" and summary.steps == 6
    assert (summary.provider, summary.market, summary.nodes) == ("steady", "on_demand", 1)
    assert summary.zone == "steady-central-1a", "the provider's first zone"
    record = gang.read_gang(state / "runs" / "run-a")
    [node] = record["launched"]
    assert (node["provider"], node["price_usd_per_hour"]) == ("steady", 2.0)
    # Billed node-seconds: from the launch until the node was released at the end (just before
    # the record's clock reading), at the steady price; never more than the run's wall time.
    launched_at_s = record["history"][0]["provider_time_s"]
    held_s = record["provider_now_s"] - launched_at_s
    assert 0 < held_s <= wall_s
    assert summary.cost_usd == pytest.approx(held_s * 2.0 / 3600.0, rel=0.01)
    assert summary.cost_usd == record["cost_usd"] > 0
    assert summary.spot_share == 0.0 and summary.reclaims == 0
    # The fixed schedule is priced as the provider prices its nodes (its own list, no
    # changeover), so the saving compares two bills in the same prices; the AWS table knows
    # no "steady" zone, and the fixed schedule had no price at all before.
    assert record["fixed_on_demand_usd"] == pytest.approx(
        record["train_provider_s"] * 2.0 / 3600.0, rel=1e-9)


def test_the_module_providers_refusal_comes_before_training(fresh_registry, state, monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", FAKE_MODULE)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "steady")
    with pytest.raises(LaunchFailedError, match="on-demand nodes only"):
        run(state, request(market="spot"))
    assert not (state / "runs" / "run-a" / "telemetry").exists(), "nothing trained"


# --- errors -----------------------------------------------------------------------------------
def test_an_unknown_provider_lists_the_registered_ones(fresh_registry, monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER", "gcp")
    with pytest.raises(ValueError) as caught:
        provider_name()
    text = str(caught.value)
    assert "TRAINWISE_PROVIDER='gcp'" in text and "emulated, aws" in text
    assert "TRAINWISE_PROVIDER_MODULES" in text, "says how to register one"
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", FAKE_MODULE)
    with pytest.raises(UnknownProviderError, match="use one of emulated, aws, kubernetes, steady"):
        gang.provider_for_run("p3.2xlarge", "us-west-2")


def test_a_module_that_is_not_there_names_the_module_and_the_setting(fresh_registry,
                                                                      monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", f"{FAKE_MODULE},acme_clouds.gcp")
    with pytest.raises(ProviderModuleError) as caught:
        provider_name("steady")
    text = str(caught.value)
    assert "'acme_clouds.gcp'" in text and "cannot be found" in text and "PYTHONPATH" in text
    assert text.count("TRAINWISE_PROVIDER_MODULES") == 2, "names the setting and the fix"
    assert caught.value.module == "acme_clouds.gcp"


def test_a_module_that_fails_to_import_names_the_module_its_error_and_the_setting(
        fresh_registry, monkeypatch, tmp_path):
    (tmp_path / "broken_cloud.py").write_text("import acme_sdk_missing\n")
    (tmp_path / "raising_cloud.py").write_text("raise RuntimeError('no credentials file')\n")
    (tmp_path / "empty_cloud.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, said in [
        ("broken_cloud", "it imports 'acme_sdk_missing', which is not installed"),
        ("raising_cloud", "raised RuntimeError: no credentials file while being imported"),
        ("empty_cloud", "registers no provider"),
    ]:
        monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", module)
        with pytest.raises(ProviderModuleError) as caught:
            provider_names()
        text = str(caught.value)
        assert f"TRAINWISE_PROVIDER_MODULES names module {module!r}" in text and said in text
        assert text.endswith("remove it from TRAINWISE_PROVIDER_MODULES"), text
        assert isinstance(caught.value, settings.SettingError)


def test_preflight_refuses_a_bad_provider_setting_before_the_first_step(fresh_registry,
                                                                        monkeypatch, tmp_path):
    def problems() -> list[str]:
        with pytest.raises(preflight.PreflightError) as caught:
            preflight.check_services(state_dir=tmp_path / "state",
                                     duckdb_path=tmp_path / "state" / "t.duckdb",
                                     tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     store=None)
        return caught.value.problems

    preflight.check_provider()  # emulated: nothing to check
    monkeypatch.setenv("TRAINWISE_PROVIDER", "aws")
    # What a node is launched with, well formed (no EC2 call checks that they exist); their
    # absence is tests/test_cloud_provider_aws.py's.
    for name, value in (("TRAINWISE_EC2_IMAGE_ID", "ami-0abc1234"),
                        ("TRAINWISE_EC2_INSTANCE_PROFILE", "trainwise-node"),
                        ("TRAINWISE_EC2_SUBNET_IDS", "subnet-0abc1234"),
                        ("TRAINWISE_EC2_SECURITY_GROUP_IDS", "sg-0abc1234")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", "localhost:5000")
    [problem] = problems()
    assert problem.startswith("compute provider: TRAINWISE_EC2_ENDPOINT_URL='localhost:5000'")
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", "http://127.0.0.1:5000")
    preflight.check_provider()  # a well-formed override passes (no EC2 call)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "steady")
    monkeypatch.setenv("TRAINWISE_PROVIDER_MODULES", "acme_clouds.gcp")
    [problem] = problems()
    assert "compute provider: TRAINWISE_PROVIDER_MODULES names module 'acme_clouds.gcp'" in problem


# --- the decorator and what a provider class carries --------------------------------------------
def test_the_built_ins_register_on_import_and_carry_their_contract():
    assert provider_class("emulated") is EmulatedProvider
    assert provider_class("aws") is AwsProvider
    known = {s.name for s in settings.SETTINGS}
    for cls in (EmulatedProvider, AwsProvider):
        assert set(cls.setting_names) <= known, f"{cls.name} reads an undocumented setting"
        assert cls.for_run.__func__ is not ComputeProvider.for_run.__func__


def test_the_decorator_refuses_what_cannot_be_a_provider(fresh_registry):
    fake_module = pytest.importorskip(FAKE_MODULE)
    with pytest.raises(ValueError, match="lowercase word"):
        registry.register_provider("Steady Cloud")
    with pytest.raises(TypeError, match="subclass of cloud.providers.base.ComputeProvider"):
        registry.register_provider("plain")(type("Plain", (), {}))
    with pytest.raises(TypeError, match="define the classmethod for_run"):
        registry.register_provider("no_for_run")(type("NoForRun", (ComputeProvider,), {}))
    steady = fake_module.SteadyProvider
    with pytest.raises(ValueError, match="whose name is 'steady'"):
        registry.register_provider("other")(steady)
    impostor = type("Impostor", (steady,), {})
    with pytest.raises(ValueError, match="'steady' is already registered by "
                                         "tests._fake_provider.SteadyProvider"):
        registry.register_provider("steady")(impostor)
    # The same class again (its module imported a second time) replaces itself.
    assert registry.register_provider("steady")(steady) is steady
