"""The last step of every benchmark script: print its markdown report and write it into the results folder."""
from __future__ import annotations

import os


def write_report(out_dir: str, filename: str, lines: list[str]) -> str:
    """Print lines as one markdown text and write it to out_dir/filename (the folder made if needed)."""
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, filename), "w") as f:
        f.write(text)
    return text
