"""Writes data/points.jsonl: 200 rows of a small regression task, the same bytes on every machine
(numpy's PCG64 from a fixed seed, numbers rounded to 4 decimals). Run it only to regenerate."""

import json
from pathlib import Path

import numpy as np

N_ROWS, N_FEATURES = 200, 6

generator = np.random.Generator(np.random.PCG64(2024))
x = np.round(generator.normal(size=(N_ROWS, N_FEATURES)), 4)
weights = generator.normal(size=N_FEATURES)
y = np.round(np.sin(x @ weights) + 0.1 * generator.normal(size=N_ROWS), 4)
out = Path(__file__).parent / "data" / "points.jsonl"
out.parent.mkdir(exist_ok=True)
with out.open("w") as file:
    for i in range(N_ROWS):
        file.write(json.dumps({"point_id": 1000 + i, "x": x[i].tolist(), "y": float(y[i])}) + "\n")
print(f"wrote {out} ({N_ROWS} rows)")
