"""The data partitions: the built-in data sets plus the datasets of the team's project file.

`DATA_PARTITIONS` stays the built-in ones (tinyshakespeare, mnist, pystdlib): every asset of the
chain handles them, and the loops over "every partition" (the forecast, the slow-policy sensor,
the curriculum check run with no partition) mean those. `USER_PARTITIONS` are the
`[datasets.NAME]` of TRAINWISE_PROJECT_FILE (docs/user_datasets.md): `data_shards` builds them;
the assets after it refuse them by name (`require_builtin`) until they can handle them.

The partitions definition is static, read once when the code location loads: adding a dataset
to the project file shows up after a reload of the code location (the UI's "Reload", or a
restart of `make ui`), not before.
"""

from collections.abc import Mapping

import dagster as dg

from trainwise import user_project

DATA_PARTITIONS = ("tinyshakespeare", "mnist", "pystdlib")


def partitions_for(project: user_project.Project) -> dg.StaticPartitionsDefinition:
    """The built-in partitions, then the project's datasets (in the file's order)."""
    return dg.StaticPartitionsDefinition([*DATA_PARTITIONS, *project.datasets])


PROJECT = user_project.load_project()  # a bad file fails the load, with its message
USER_DATASETS: Mapping[str, user_project.DatasetSpec] = PROJECT.datasets
USER_PARTITIONS = tuple(USER_DATASETS)
data_partitions = partitions_for(PROJECT)


def require_builtin(partition: str, asset: str) -> None:
    """Refuse a registered dataset in an asset that handles only the built-in partitions, with
    what is supported, rather than letting it fail deep inside (or misread the data)."""
    if partition in DATA_PARTITIONS:
        return
    raise dg.Failure(description=(
        f"partition {partition!r} is a registered dataset (TRAINWISE_PROJECT_FILE); {asset} "
        f"supports only the built-in partitions ({', '.join(DATA_PARTITIONS)}) for now. Its "
        f"data_shards are built (training.user_datasets.load_user_shards reads them); scores, "
        f"curricula and training on registered datasets come with issue 26."))
