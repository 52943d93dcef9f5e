"""Writes data/passages.jsonl: 300 passages of 64 characters, the opening of Shakespeare's plays
as collected in Karpathy's tinyshakespeare (public domain text), one JSON row each with a stable
integer id. Run it only to regenerate, with the path of a copy of that text:

    python examples/hf_trainer/make_data.py /path/to/tinyshakespeare.txt
"""

import json
import sys
from pathlib import Path

N_ROWS, CHARS = 300, 64
DEFAULT_SOURCE = Path("/work/shared/data/corpora/tinyshakespeare.txt")

source = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SOURCE
text = source.read_text(encoding="utf-8")[:N_ROWS * CHARS]
if len(text) < N_ROWS * CHARS or not text.isascii():
    raise SystemExit(f"{source}: expected at least {N_ROWS * CHARS} ASCII characters")
out = Path(__file__).parent / "data" / "passages.jsonl"
out.parent.mkdir(exist_ok=True)
with out.open("w", encoding="utf-8") as file:
    for i in range(N_ROWS):
        passage = text[i * CHARS:(i + 1) * CHARS]
        file.write(json.dumps({"passage_id": 1000 + i, "text": passage}) + "\n")
print(f"wrote {out} ({N_ROWS} rows, {out.stat().st_size} bytes)")
