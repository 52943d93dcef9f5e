"""The live slow tick's market view of a run on aws (issue 27 item 2), against a real
moto_server on loopback: EC2's spot prices per zone, a zone held back after the run was
reclaimed or refused spot there, and the allocation policy moving the run on that view."""

from __future__ import annotations

import json

import boto3
import pytest

from cloud.providers.aws import AwsProvider
from tests import servers
from tests.test_slow_tick_market import PARTITION, WALL_AT, _state
from trainwise import gang, market_view, settings, slow_tick
from trainwise.market_view_aws import RECLAIM_MEMORY_S, spot_setbacks

REGION = "us-west-2"
TYPE = "g4dn.xlarge"  # moto offers it in us-west-2a, -2b and -2c


@pytest.fixture(scope="module")
def moto_url(tmp_path_factory):
    with servers.moto(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def aws_env(monkeypatch, moto_url):
    # moto accepts any credentials; test values only. The sensor's view is built from settings.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("TRAINWISE_EC2_ENDPOINT_URL", moto_url)
    monkeypatch.setattr(market_view, "wall_now_s", lambda: WALL_AT)


def _ec2_prices(url: str) -> dict[str, float]:
    """What EC2 itself answers, read with boto3 directly (not through the provider)."""
    ec2 = boto3.client("ec2", endpoint_url=url, region_name=REGION)
    return {p["AvailabilityZone"]: float(p["SpotPrice"])
            for p in ec2.describe_spot_price_history(InstanceTypes=[TYPE])["SpotPriceHistory"]
            if p["InstanceType"] == TYPE}


def _aws_run(run_id: str, history: list[dict], *, zone: str = "us-west-2a",
             market: str = "spot"):
    # 200 steps of 0.1 s done of 200,000: about 5.6 h of work left, worth a move to spot.
    run_dir = _state(run_id, max_steps=200_000)
    request = json.loads((run_dir / "request.json").read_text())
    request["instance_type"] = TYPE
    request["deadline_s"] = 12 * 3600.0  # ample slack: only the market moves the run
    (run_dir / "request.json").write_text(json.dumps(request))
    (run_dir / "gang.json").write_text(json.dumps({
        "provider": "aws", "instance_type": TYPE, "market": market, "zone": zone, "nodes": 1,
        "reclaims": sum(h["event"] == "notice" for h in history),
        "allocation": {"market": market, "zone": zone, "nodes": 1, "reason": "the request",
                       "source": "request"},
        "history": history}))
    return run_dir


def _view(run_dir):
    from telemetry.reader import read_run_events

    request = json.loads((run_dir / "request.json").read_text())
    return market_view.market_view(read_run_events(run_dir / "telemetry" / run_dir.name),
                                   request, gang.read_gang(run_dir))


def _launch(at_s: float, zone: str, market: str = "spot", why: str = "start") -> dict:
    return {"event": "launch", "reason": f"{why}: 1 x {TYPE} {market} in {zone}",
            "provider_time_s": at_s, "wall_time_s": at_s, "market": market, "zone": zone}


def _reclaim(at_s: float) -> dict:
    return {"event": "notice", "reason": "reclaimed by aws: spot instance-action",
            "provider_time_s": at_s, "wall_time_s": at_s}


def test_spot_prices_now_are_ec2s_for_every_zone_that_offers_the_type(aws_env, moto_url):
    provider = AwsProvider.for_run(TYPE, REGION)
    prices_now = provider.spot_prices_now(TYPE)
    assert prices_now == _ec2_prices(moto_url)
    assert set(prices_now) == {"us-west-2a", "us-west-2b", "us-west-2c"}
    # A type EC2 does not offer in the region has no price anywhere; an unknown one is refused.
    assert provider.spot_prices_now("p3.2xlarge") == {}
    with pytest.raises(ValueError, match="nope.large"):
        provider.spot_prices_now("nope.large")


def test_a_zone_the_run_was_just_reclaimed_in_is_held_back(aws_env, moto_url):
    started = WALL_AT - 3 * 3600
    run_dir = _aws_run("r-aws-reclaimed", [
        _launch(started, "us-west-2a"), _reclaim(WALL_AT - 600),
        _launch(WALL_AT - 500, "us-west-2a", "on_demand", why="fallback to on-demand")],
        market="on_demand")
    view = _view(run_dir)
    obs = view.observation
    assert obs is not None, view.reason
    assert {"us-west-2a", "us-west-2b", "us-west-2c"} <= set(obs.zones)
    available = dict(zip(obs.zones, obs.spot_available_by_zone, strict=True))
    assert available["us-west-2a"] == 0  # reclaimed there 10 min ago, then refused spot
    assert available["us-west-2b"] == available["us-west-2c"] == 1
    ec2 = _ec2_prices(moto_url)
    for zone, price in zip(obs.zones, obs.spot_price_usd_per_hour_by_zone, strict=True):
        if zone in ec2:
            assert price == ec2[zone]
    assert all(d > 0 for d in obs.on_demand_price_usd_per_hour_by_zone)
    # Job time from gang.json's first record; the reclaim at that time; the held node.
    assert obs.time_s == pytest.approx(3 * 3600)
    assert obs.preemption_times_s == (pytest.approx(3 * 3600 - 600),)
    assert (obs.zone, obs.spot_nodes, obs.on_demand_nodes) == ("us-west-2a", 0, 1)
    assert obs.tick_s == settings.sensor_interval_s()
    assert "us-west-2a: spot refused 8 min ago" in view.reason
    assert "describe_spot_price_history" in view.reason

    # A zone where the run holds spot now holds it; an hour on, a lost zone is offered again.
    run_dir = _aws_run("r-aws-old-reclaim", [
        _launch(started, "us-west-2b"), _reclaim(WALL_AT - RECLAIM_MEMORY_S - 60),
        _launch(WALL_AT - RECLAIM_MEMORY_S, "us-west-2c", why="replacement after reclaimed"),
        _reclaim(WALL_AT - 60),
        _launch(WALL_AT - 30, "us-west-2c", why="replacement after reclaimed")],
        zone="us-west-2c")
    obs = _view(run_dir).observation
    available = dict(zip(obs.zones, obs.spot_available_by_zone, strict=True))
    assert (available["us-west-2b"], available["us-west-2c"]) == (1, 1)


def test_setbacks_are_reclaims_in_the_zone_held_and_spot_refusals():
    history = [_launch(10.0, "us-west-2a"), _reclaim(20.0),
               _launch(30.0, "us-west-2b", "on_demand", why="fallback to on-demand"),
               {"event": "restore", "reason": "step 40", "provider_time_s": 35.0},
               _reclaim(40.0)]
    assert spot_setbacks(history) == [("us-west-2a", 20.0, "reclaimed"),
                                      ("us-west-2b", 30.0, "spot refused"),
                                      ("us-west-2b", 40.0, "reclaimed")]


def test_the_slow_tick_keeps_a_run_out_of_the_zone_it_was_just_reclaimed_in(aws_env):
    # Two runs on on-demand in us-west-2a with ample slack: the allocation policy, seeing EC2's
    # spot prices, moves the calm one to spot in its home zone and the one that was reclaimed
    # there 10 minutes ago (and fell back to on-demand) to spot in another zone. Before this
    # view, a run on aws kept its nodes whatever the market did.
    calm = _aws_run("r-aws-calm", [_launch(WALL_AT - 2 * 3600, "us-west-2a", "on_demand")],
                    market="on_demand")
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    assert tick.run_id == "r-aws-calm"
    assert "market view: EC2 spot prices in us-west-2" in tick.action.reason
    slow_tick.apply_run_decisions(settings.home_dir(), tick)
    wanted = gang.read_allocation(calm)
    assert wanted is not None and wanted.source == "slow_policy", tick.action.reason
    assert (wanted.market, wanted.zone) == ("spot", "us-west-2a")

    reclaimed = _aws_run("r-aws-tick", [
        _launch(WALL_AT - 2 * 3600, "us-west-2a"), _reclaim(WALL_AT - 600),
        _launch(WALL_AT - 500, "us-west-2a", "on_demand", why="fallback to on-demand")],
        market="on_demand")
    tick = slow_tick.decide(settings.home_dir(), PARTITION)
    assert tick.run_id == "r-aws-tick"
    slow_tick.apply_run_decisions(settings.home_dir(), tick)
    wanted = gang.read_allocation(reclaimed)
    assert wanted is not None and wanted.source == "slow_policy", tick.action.reason
    assert wanted.market == "spot" and wanted.zone in ("us-west-2b", "us-west-2c"), wanted
