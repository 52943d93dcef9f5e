"""Learned policies for trainwise's two control layers (issue 14).

- `rl.slow_obs` / `rl.fast_obs`: the fixed observation layouts and the discrete action menus,
  shared by the gymnasium environments and by the deployed policies.
- `rl.slow_env` / `rl.fast_env` (re-exported by `rl.envs`): `SlowEnv`, `FastEnv`.
- `rl.train`: PPO over vectorised environments, warm-started by behaviour cloning of the
  heuristic so that version 1 acts as the heuristic.
- `rl.policy_file`: plain npz weights + JSON header, loaded without unpickling.
- `rl.fast_path`: numpy forward pass used at decision time.
- `rl.gate`: promotion decision, candidate vs incumbent on held-out cells.

Only `assets/` imports Dagster; nothing here does.
"""
