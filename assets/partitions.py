"""The data partitions: one per training data set."""

import dagster as dg

DATA_PARTITIONS = ("tinyshakespeare", "mnist", "pystdlib")
data_partitions = dg.StaticPartitionsDefinition(list(DATA_PARTITIONS))
