"""Regenerates ``fsdp_speedloader/assets/default_corpus.txt.gz``, the built-in training corpus.

The text is the "topics" part of Python's own documentation (``pydoc_data.topics``, shipped with
CPython under the PSF license): about 450 KB of real English prose with code examples, enough to
see a small model's loss fall without downloading anything.

    python tools/make_default_corpus.py

The output depends only on the Python version that runs this script (the README records which).
"""

from __future__ import annotations

import argparse
import gzip
import platform
from pathlib import Path

from pydoc_data.topics import topics

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "fsdp_speedloader" / "assets" / "default_corpus.txt.gz"


def build_corpus_text() -> str:
    # Sorted so the corpus does not depend on dict order; the topics are sections of one manual,
    # so they form one document separated by blank lines.
    return "\n\n".join(topics[name].strip() for name in sorted(topics)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the .txt.gz")
    args = parser.parse_args()

    data = build_corpus_text().encode("utf-8")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the archive byte-identical across runs.
    args.output.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    print(f"wrote {args.output}: {len(data):,} bytes of text from pydoc_data.topics "
          f"(Python {platform.python_version()}), {args.output.stat().st_size:,} bytes compressed")


if __name__ == "__main__":
    main()
