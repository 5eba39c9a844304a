"""Tokenizes a text corpus once into a memory-mappable token file for ``data.source=tokens``.

    python tools/prepare_data.py --input corpus/ --tokenizer bytes --output data/train.bin
    python train.py data.source=tokens data.path=data/train.bin

--input is what data.path names for data.source=text: a .txt file (one document), a .jsonl file (one
document per line, text in --text-field) or a directory of those (file-name order). Documents stream
through the tokenizer one at a time and are appended to --output as raw little-endian uint16 ids
(uint32 for vocabularies over 65,536), with the tokenizer's EOS between documents. <output>.json
records dtype, vocab_size, num_tokens and tokenizer; it is written last, so a run that dies midway
leaves a file that training refuses.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fsdp_speedloader.app.data import build_tokenizer, iter_documents, text_files, write_token_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a .txt/.jsonl file or a directory of them (data.path)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes' or a local Hugging Face tokenizer directory (data.tokenizer)")
    parser.add_argument("--output", required=True, type=Path, help="the .bin file to write (sidecar: <output>.json)")
    parser.add_argument("--text-field", default="text", help="field holding the text in .jsonl files (data.text_field)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        files = text_files(args.input)
        tokenizer = build_tokenizer(args.tokenizer)
        meta = write_token_file(args.output, iter_documents(files, args.text_field), tokenizer, args.tokenizer)
    except ValueError as e:
        parser.error(str(e))
    if meta["num_tokens"] == 0:
        parser.error(f"{args.input} holds no text (every document is empty)")
    print(f"wrote {args.output}: {meta['num_tokens']:,} {meta['dtype']} tokens from {len(files)} file(s), "
          f"vocab_size={meta['vocab_size']}, in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
