import math

from controllers.slow_types import ClusterSummary, Progress


def test_mean_time_between_preemptions_from_counts():
    cluster = ClusterSummary(nodes=4, spot_nodes=3, on_demand_nodes=1, preemptions_observed=3,
                             observed_for_s=5400.0, checkpoint_cost_s=12.0)
    assert cluster.mean_time_between_preemptions_s == 1800.0
    calm = ClusterSummary(4, 4, 0, 0, 5400.0, 12.0)
    assert calm.mean_time_between_preemptions_s == math.inf


def test_progress_fraction():
    assert Progress(work_done=250.0, work_total=1000.0, elapsed_s=60.0,
                    time_left_s=600.0).fraction_done == 0.25
    assert math.isnan(Progress(0.0, 0.0, 0.0, 0.0).fraction_done)
