"""Deep RL benchmark: fast-path latency and an out-of-sample evaluation of the learned policies."""
