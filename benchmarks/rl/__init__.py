"""Deep RL benchmark: fast-path latency and an out-of-sample evaluation of the learned policies
(`run.py`), and the time of one scheduled retraining of each layer (`retraining.py`)."""
