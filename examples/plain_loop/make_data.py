"""Writes data/blobs.jsonl: 240 rows of a small 3-class task, the same bytes on every machine
(numpy's PCG64 from a fixed seed, numbers rounded to 4 decimals). Run it only to regenerate."""

import json
from pathlib import Path

import numpy as np

N_ROWS, N_FEATURES, N_CLASSES = 240, 4, 3

generator = np.random.Generator(np.random.PCG64(7))
centres = generator.normal(scale=2.0, size=(N_CLASSES, N_FEATURES))
labels = generator.integers(0, N_CLASSES, size=N_ROWS)
x = np.round(centres[labels] + generator.normal(size=(N_ROWS, N_FEATURES)), 4)
out = Path(__file__).parent / "data" / "blobs.jsonl"
out.parent.mkdir(exist_ok=True)
with out.open("w") as file:
    for i in range(N_ROWS):
        file.write(json.dumps({"row_id": i, "features": x[i].tolist(),
                               "label": int(labels[i])}) + "\n")
print(f"wrote {out} ({N_ROWS} rows)")
