"""The code location loads as the webserver loads it: Definitions builds lazily, so a clash of an
asset and a job of the same name, an unresolvable asset job or a missing resource only shows up
when the repository is resolved. The UI then shows an empty graph and no jobs."""

import dagster as dg

from pipelines.definitions import defs


def test_the_code_location_is_loadable():
    dg.Definitions.validate_loadable(defs)


def test_every_rollback_job_is_named_apart_from_its_asset():
    repository = defs.get_repository_def()
    job_names = {job.name for job in repository.get_all_jobs()}
    assert {"curriculum_rollback", "champion_rollback"} <= job_names
    assets = {key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()}
    assert not (job_names & assets), f"jobs named like assets: {sorted(job_names & assets)}"
