"""Price catalog, spot prices from a discount or the Spot Advisor, interruption bands."""

from __future__ import annotations

import pytest

from cloud.prices import (
    CANT_BE_LATE_SPOT_USD_PER_HOUR,
    default_advisor_path,
    instance_for_trace,
    instance_type,
    interruption_band,
    node_prices,
    node_shape_of,
    on_demand_price,
    spot_advisor,
    spot_price_from_advisor,
    spot_price_from_discount,
)

needs_advisor = pytest.mark.skipif(
    not default_advisor_path().is_file(), reason="no Spot Advisor feed"
)


@pytest.mark.parametrize(
    "name, region, usd",
    [
        ("p3.2xlarge", "us-west-2", 3.06),
        ("p3.16xlarge", "us-east-1", 24.48),
        ("p2.xlarge", "us-west-2", 0.90),
        ("p2.8xlarge", "us-west-2", 7.20),
        ("p4d.24xlarge", "us-east-1", 32.77),
        ("g4dn.xlarge", "us-east-2", 0.526),
        ("g5.xlarge", "us-east-1", 1.006),
    ],
)
def test_list_prices(name, region, usd):
    assert on_demand_price(name, region) == pytest.approx(usd)


def test_unknown_type_and_region_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown instance type 'p9.huge'; valid: .*p3.2xlarge"):
        on_demand_price("p9.huge", "us-west-2")
    with pytest.raises(
        ValueError, match=r"in region 'mars-1'; valid regions: us-east-1, us-east-2, us-west-2"
    ):
        on_demand_price("p3.2xlarge", "mars-1")


def test_gpus_per_type():
    assert instance_type("p3.16xlarge").gpus == 8
    assert instance_type("p2.xlarge").gpu_model == "K80"


def test_spot_price_from_a_stated_discount_reproduces_the_papers_price():
    # Can't Be Late: 0.9731 USD/h against 3.06 USD/h is a 68.2% discount.
    assert spot_price_from_discount(3.06, 0.682) == pytest.approx(
        CANT_BE_LATE_SPOT_USD_PER_HOUR, abs=1e-3
    )
    with pytest.raises(ValueError, match="discount=1.2 must be in"):
        spot_price_from_discount(3.06, 1.2)


@needs_advisor
def test_spot_advisor_saving_and_band():
    entry = spot_advisor("p3.2xlarge", "us-west-2")
    assert entry.saving_percent == 71
    assert entry.interruption_band == ">20%" and entry.interruption_band_index == 4
    assert spot_price_from_advisor("p3.2xlarge", "us-west-2") == pytest.approx(3.06 * 0.29)
    assert interruption_band("g4dn.12xlarge", "us-west-2") == "10-15%"
    assert interruption_band("p4d.24xlarge", "us-east-2") == "5-10%"


@needs_advisor
def test_spot_advisor_unknowns_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"no region 'mars-1'; valid: .*us-west-2"):
        spot_advisor("p3.2xlarge", "mars-1")
    with pytest.raises(ValueError, match="has no 'p9.huge' in us-west-2"):
        spot_advisor("p9.huge", "us-west-2")


@pytest.mark.parametrize(
    "zone_file, instance",
    [
        ("us-west-2a_v100_1.json", "p3.2xlarge"),
        ("us-west-2b_v100_8.json", "p3.16xlarge"),
        ("us-west-2a_k80_1.json", "p2.xlarge"),
        ("us-west-2b_k80_8.json", "p2.8xlarge"),
    ],
)
def test_instance_for_trace(zone_file, instance):
    # From the folder's collection.toml (or, without the data, the legacy shape table).
    assert instance_for_trace("availability-1node-aws-2022-10", zone_file) == instance


def test_instance_for_trace_reads_the_collection_not_the_name(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "collection.toml").write_text(
        'provider = "aws"\nvalue_meaning = "available_count"\nnodes_per_file = 1\n'
        '[files."us-west-2a_k80_1.json"]\nzone = "us-west-2a"\ninstance_type = "g5.xlarge"\n'
    )
    assert instance_for_trace("mine", "us-west-2a_k80_1.json", tmp_path) == "g5.xlarge"
    with pytest.raises(ValueError, match="'other.json' is not described in .*collection.toml"):
        instance_for_trace("mine", "other.json", tmp_path)


def test_instance_for_trace_of_an_absent_folder_refuses_unknown_shapes(tmp_path):
    assert instance_for_trace("gone", "us-west-2a_v100_1.json", tmp_path) == "p3.2xlarge"
    with pytest.raises(ValueError, match="does not exist and .* no known legacy node shape"):
        instance_for_trace("gone", "us-west-2a_h100_8.json", tmp_path)


def test_node_shape_labels():
    assert node_shape_of("p3.2xlarge") == "v100_1" and node_shape_of("p2.8xlarge") == "k80_8"
    assert node_shape_of("a2-highgpu-8g") == "a2-highgpu-8g"


def test_prices_stated_in_the_metadata_win_for_any_cloud_and_type():
    prices = node_prices("a2-highgpu-8g", "us-central1", "gcp", 29.39, 8.82, where="f.json")
    assert (prices.on_demand_usd_per_hour, prices.spot_usd_per_hour) == (29.39, 8.82)
    assert prices.on_demand_source == prices.spot_source == "collection.toml"


@pytest.mark.parametrize(
    "args, message",
    [
        (("a2-highgpu-8g", "us-central1", "gcp"), "no on-demand price for f.json: .*AWS list"),
        (("a2-highgpu-8g", "us-central1", "gcp", 29.39), "no spot price for f.json: .*AWS only"),
        (("p9.huge", "us-east-1", "aws"), "no on-demand price for f.json: unknown instance type"),
    ],
)
def test_a_missing_price_names_the_file_and_the_keys(args, message):
    with pytest.raises(ValueError, match=message) as error:
        node_prices(*args, where="f.json")
    assert "on_demand_usd_per_hour = ... and spot_usd_per_hour = ..." in str(error.value)


@needs_advisor
def test_aws_prices_fall_back_to_the_list_and_the_advisor():
    prices = node_prices("p3.2xlarge", "us-west-2", "aws")
    assert prices.on_demand_usd_per_hour == 3.06
    assert prices.spot_usd_per_hour == pytest.approx(spot_price_from_advisor("p3.2xlarge",
                                                                             "us-west-2"))
    # An on-demand price stated for a listed type still takes the advisor's saving.
    stated = node_prices("p3.2xlarge", "us-west-2", "aws", on_demand_usd_per_hour=4.0)
    assert stated.spot_usd_per_hour == pytest.approx(4.0 * 0.29)
