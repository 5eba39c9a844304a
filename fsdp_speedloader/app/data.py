"""Training data: tokenizers, corpora, and the packed, resumable, rank-sharded loader.

Sources (``DataConfig.source``):

- ``default``: the corpus shipped in ``assets/`` (Python's documentation text), tokenized at load.
- ``synthetic``: uniform random tokens; no tokenizer, no files (throughput runs).
- ``text``: a .txt file (one document), a .jsonl file (one document per line, in ``text_field``) or
  a directory of those, read in file-name order; documents are joined with the tokenizer's EOS.
- ``tokens``: a token directory written by ``fsdp-speedloader-prepare`` (``app/prepare.py``; format in
  ``app/token_shards.py``), or a single pre-tokenized .bin file with its .json sidecar (the earlier format),
  read row by row as batches need them; or several of those mixed by weight (``data.mixture``, ``app/mixture.py``).

Held out (``data.val_path``, or ``data.val_fraction``: the last sequences of the stream, never trained on):
``val_batches`` gives each evaluation the same sequences. Document-aware packing (``data.document_mask``):
``apply_document_mask`` derives per-document positions from the EOS tokens of a packed batch.

Packing: the token stream is cut into ``num_sequences = num_tokens // seq_len`` non-overlapping
sequences (the tail is dropped). Each epoch visits them in a fresh order drawn from ``(seed, epoch)``
(for token files a :class:`KeyedPermutation`, computed per batch: no order array grows with the corpus);
every step takes the next ``world_size * batch_size`` sequences of that order and rank r keeps the
r-th ``batch_size`` of them. The position is global, so all ranks hold the same loader state.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import logging
import math
import os
import zlib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np
import torch

from fsdp_speedloader.app.config import TOKENIZER_FILES, DataConfig, default_tokenizer
from fsdp_speedloader.app.jsonl import JsonLineError, json_line_text
from fsdp_speedloader.app.mixture import MixtureLoader
from fsdp_speedloader.app.permutation import KeyedPermutation, check_same_seed
from fsdp_speedloader.app.token_shards import PREPARE_HINT, TOKEN_DTYPES, TokenDirectory, TokenStream, read_index, \
    token_dtype

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")
PREPARE_ONLY_SUFFIXES = (".parquet",)  # corpora that fsdp-speedloader-prepare reads into token shards

PathLike = Union[str, os.PathLike]
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus an end-of-sequence token 256. Needs no files."""

    vocab_size: int = 257
    eos_token_id: int = 256

    def __len__(self) -> int:
        # len(tokenizer) is Hugging Face's "every id the tokenizer can emit"; keep the same meaning.
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        # EOS has no bytes; sampled ids may cut a multi-byte character in half, hence "replace".
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_tokenizer(name: str) -> Any:
    """'bytes' -> :class:`ByteTokenizer`; anything else is a local Hugging Face tokenizer directory."""
    if name == "bytes":
        return ByteTokenizer()
    if not Path(name).is_dir():
        raise ValueError(f"data.tokenizer: {name!r} is neither 'bytes' nor an existing directory; use 'bytes' "
                         "or the path of a local Hugging Face tokenizer (a directory with tokenizer.json)")
    if not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):  # transformers' own message is a page long
        raise ValueError(f"data.tokenizer: {name!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); use 'bytes' "
                         "or the directory a Hugging Face tokenizer was saved to (save_pretrained)")
    from transformers import AutoTokenizer  # slow import, only paid by runs that use one

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer: cannot load a Hugging Face tokenizer from {name!r}: {e}") from e
    if tokenizer.eos_token_id is None:
        raise ValueError(f"data.tokenizer: the tokenizer in {name!r} has no eos_token, which separates "
                         "documents; set eos_token in its tokenizer_config.json")
    for how_it_was_read in ("local_files_only", "is_local"):  # not the tokenizer's: kept out of its saved copies
        tokenizer.init_kwargs.pop(how_it_was_read, None)
    return tokenizer


def _encode(tokenizer: Any, text: str, dtype: np.dtype) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        # Same ids as tokenizer.encode, without a Python int per byte (a large .txt is one document).
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    # No BOS/EOS per document (EOS goes between documents below); verbose=False silences the
    # "longer than model_max_length" warning: documents are cut into sequences later.
    return np.asarray(tokenizer.encode(text, add_special_tokens=False, verbose=False), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------


def read_default_corpus() -> str:
    """The built-in corpus (one document, about 466 KB of English text; see assets/README.md)."""
    # Regenerate with tools/make_default_corpus.py.
    data = (resources.files("fsdp_speedloader") / "assets" / "default_corpus.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


def _is_text(path: Path) -> bool:
    return path.name.endswith(TEXT_SUFFIXES)


def text_files(path: PathLike) -> list[Path]:
    """The files of a 'text' source: the .txt/.jsonl(.gz) file itself, or a directory's, sorted by name. A
    directory that also holds corpora only the prepare tool reads (.parquet) is refused: training on the rest
    would silently leave them out."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data.path: {str(p)!r} does not exist; point data.path at a .txt, .jsonl or .jsonl.gz file "
                         "or a directory of them")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and _is_text(f))
        unread = sorted(f.name for f in p.iterdir() if f.is_file() and f.name.endswith(PREPARE_ONLY_SUFFIXES))
        if unread:
            shown = ", ".join(unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
            raise ValueError(f"data.path: directory {str(p)!r} holds {shown}, which data=text does not read (it reads "
                             f".txt, .jsonl and .jsonl.gz); prepare the directory into token shards "
                             f"(fsdp-speedloader-prepare {str(p)!r} -o DIR, then data=tokens data.path=DIR), or move "
                             "those files out")
        if not files:
            raise ValueError(f"data.path: directory {str(p)!r} holds no .txt, .jsonl or .jsonl.gz files")
    elif _is_text(p):
        files = [p]
    else:
        raise ValueError(f"data.path: {str(p)!r} is not a .txt, .jsonl or .jsonl.gz file "
                         "(a pre-tokenized .bin file needs data.source=tokens; a .parquet corpus, "
                         "fsdp-speedloader-prepare)")
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data.path: {str(p)!r} is empty; it holds no text to train on")
    return files


def iter_documents(files: Iterable[Path], text_field: str = "text") -> Iterator[str]:
    """Yields one document at a time: a whole .txt file, or each line's ``text_field`` of a .jsonl(.gz)."""
    for f in files:
        if f.name.endswith((".jsonl", ".jsonl.gz")):
            yield from _iter_jsonl(f, text_field)
        else:
            try:
                yield f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"data.path: {str(f)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _lines(path: Path) -> Iterator[bytes]:
    """The lines of a .jsonl file, or of a gzipped one (.jsonl.gz); a damaged gzip stream is one line."""
    if not path.name.endswith(".gz"):
        with open(path, "rb") as fh:
            yield from fh
        return
    try:
        with gzip.open(path, "rb") as fh:
            yield from fh
    except (OSError, EOFError, zlib.error) as e:  # not gzip, cut short, or corrupt
        raise ValueError(f"data.path: {str(path)!r} is not a complete gzip file ({e}); re-compress it, or "
                         "decompress it to .jsonl") from None


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for line_number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            yield json_line_text(line, text_field, field_hint="set data.text_field to the field that holds the text")
        except JsonLineError as e:
            key = "data.text_field" if e.about_field else "data.path"
            raise ValueError(f"{key}: {str(path)!r} line {line_number}: {e}") from None


def iter_token_chunks(documents: Iterable[str], tokenizer: Any) -> Iterator[np.ndarray]:
    """Token ids of each document with one EOS between documents, as 1-D arrays of token_dtype."""
    dtype = token_dtype(len(tokenizer))
    eos = np.array([tokenizer.eos_token_id], dtype=dtype)
    first = True
    for text in documents:
        if not text:
            continue  # an empty document would only add a second EOS
        if not first:
            yield eos
        first = False
        yield _encode(tokenizer, text, dtype)


# ---------------------------------------------------------------------------------------------
# Token files of the earlier format: <name>.bin (raw little-endian ids) + <name>.bin.json (sidecar)
# ---------------------------------------------------------------------------------------------


def sidecar_path(path: PathLike) -> Path:
    return Path(f"{os.fspath(path)}.json")


def read_sidecar(path: PathLike) -> dict:
    """The checked sidecar of a .bin token file: dtype, vocab_size, num_tokens, tokenizer."""
    p, sidecar = Path(path), sidecar_path(path)
    fix = PREPARE_HINT
    if not p.is_file():
        raise ValueError(f"data.path: token file {str(p)!r} does not exist; {fix}")
    if not sidecar.is_file():
        raise ValueError(f"data.path: token file {str(p)!r} has no sidecar {sidecar.name!r} (dtype, vocab_size, "
                         f"num_tokens); {fix}")
    try:
        meta = json.loads(sidecar.read_text())
    except ValueError as e:
        raise ValueError(f"data.path: sidecar {str(sidecar)!r} is not valid JSON ({e}); {fix}") from None
    ok = (isinstance(meta, dict) and meta.get("dtype") in TOKEN_DTYPES
          and all(isinstance(meta.get(k), int) and meta[k] >= 0 for k in ("vocab_size", "num_tokens")))
    if not ok:
        raise ValueError(f"data.path: sidecar {str(sidecar)!r} needs dtype ('uint16' or 'uint32') and "
                         f"non-negative integers vocab_size and num_tokens, got {meta!r}; {fix}")
    if meta["vocab_size"] > 2**16 and meta["dtype"] == "uint16":
        raise ValueError(f"data.path: {str(p)!r} claims vocab_size={meta['vocab_size']} in uint16; {fix}")
    expected = meta["num_tokens"] * TOKEN_DTYPES[meta["dtype"]].itemsize
    if p.stat().st_size != expected:
        raise ValueError(f"data.path: {str(p)!r} holds {p.stat().st_size} bytes but its sidecar promises "
                         f"{meta['num_tokens']} {meta['dtype']} tokens ({expected} bytes); {fix}")
    if meta["num_tokens"] == 0:
        raise ValueError(f"data.path: token file {str(p)!r} is empty (0 tokens)")
    return meta


def read_token_source(path: PathLike) -> TokenStream:
    """The token stream of a token directory or a .bin file, read row by row as batches need: (num_tokens,)."""
    if Path(path).is_dir():
        return TokenDirectory(path)
    meta = read_sidecar(path)
    return TokenStream([(Path(path), meta["num_tokens"])], TOKEN_DTYPES[meta["dtype"]], meta["vocab_size"],
                       "its sidecar")


def token_source_meta(path: PathLike) -> dict:
    """vocab_size, num_tokens and tokenizer of a token directory (its index) or a .bin file (its sidecar)."""
    return read_index(path) if Path(path).is_dir() else read_sidecar(path)


# ---------------------------------------------------------------------------------------------
# The token stream of a config, and the checks run before any model is built
# ---------------------------------------------------------------------------------------------


def load_tokens(cfg: DataConfig) -> Union[np.ndarray, TokenStream]:
    """The whole token stream of a non-synthetic source without a mixture, (num_tokens,): read on demand from its
    files for 'tokens', tokenized (once per process) for 'default' and 'text'."""
    if cfg.source == "tokens":
        if cfg.mixture:
            raise ValueError("data.mixture: a mixture has one token stream per dataset; use build_loader")
        return read_token_source(cfg.path)
    if cfg.source == "synthetic":
        raise ValueError("data.source: 'synthetic' has no token stream; use build_loader")
    # File names, sizes and mtimes key the cache, so edited files are tokenized again.
    file_stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                       for f in (text_files(cfg.path) if cfg.source == "text" else ()))
    return _tokenize_corpus(cfg.source, file_stats, cfg.tokenizer, cfg.text_field)


@functools.lru_cache(maxsize=2)  # the training corpus and the held-out one (data.val_path)
def _tokenize_corpus(source: str, file_stats: tuple, tokenizer_name: str, text_field: str) -> np.ndarray:
    # Cached because validate_data (before the model is built) and build_loader both need it.
    tokenizer = build_tokenizer(tokenizer_name)
    if source == "default":
        documents: Iterable[str] = [read_default_corpus()]
    else:
        documents = iter_documents([Path(name) for name, _, _ in file_stats], text_field)
    chunks = list(iter_token_chunks(documents, tokenizer))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=token_dtype(len(tokenizer)))
    tokens.flags.writeable = False  # shared by every caller
    return tokens


# ---------------------------------------------------------------------------------------------
# The held-out set (data.val_path, data.val_fraction)
# ---------------------------------------------------------------------------------------------


def split_held_out(tokens: Union[np.ndarray, TokenStream], val_fraction: float,
                   seq_len: int) -> tuple[Union[np.ndarray, TokenStream], np.ndarray]:
    """(training, held-out) parts of a token stream: the held-out set is the last ``val_fraction`` of its whole
    sequences (at least one), the same whatever the seed, rank or world size; ``val_fraction=0``: none. Token files
    (a ``TokenStream``) stay on disk for training; only the held-out tokens are read."""
    num_sequences = len(tokens) // seq_len
    num_val = math.ceil(val_fraction * num_sequences) if val_fraction > 0 else 0
    cut = (num_sequences - num_val) * seq_len
    if isinstance(tokens, TokenStream):
        training = tokens if num_val == 0 else tokens.head(cut)
        return training, tokens.read(cut, num_sequences * seq_len)
    return tokens[:cut], tokens[cut : num_sequences * seq_len]


def load_val_tokens(cfg: DataConfig) -> np.ndarray:
    """The held-out token stream: ``data.val_path`` read as ``data.source`` reads ``data.path``, or the end of
    the training stream (``data.val_fraction``); empty when neither is set."""
    if cfg.val_path:
        try:
            tokens = load_tokens(_as_val_source(cfg))
            # A held-out token directory is read whole: an evaluation reads every one of its sequences anyway.
            return tokens.read(0, len(tokens)) if isinstance(tokens, TokenStream) else tokens
        except ValueError as e:  # read as data.path is: say which setting named it
            raise renamed(e, "data.val_path") from None
    return split_held_out(load_tokens(cfg), cfg.val_fraction, cfg.seq_len)[1]


def _as_val_source(cfg: DataConfig) -> DataConfig:
    source = "text" if cfg.source == "default" else cfg.source  # the default corpus' held-out set is text
    return dataclasses.replace(cfg, source=source, path=cfg.val_path, val_path=None, val_fraction=0.0, mixture=None)


def val_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int, rank: int = 0,
                world_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """Up to ``num_batches`` batches of this rank's held-out sequences, in order (no shuffling: every evaluation
    sees the same ones). Each global batch takes the next ``world_size * batch_size`` sequences and rank r keeps
    the r-th ``batch_size``, as the training loader does; a partial last batch is dropped."""
    num_sequences = len(tokens) // seq_len
    num_global = min(num_batches, num_sequences // (world_size * batch_size))
    sequences = tokens[: num_sequences * seq_len].reshape(num_sequences, seq_len)  # (S, s), a view
    out = []
    for b in range(num_global):
        first = (b * world_size + rank) * batch_size
        input_ids = torch.from_numpy(sequences[first : first + batch_size].astype(np.int64))  # (batch_size, s)
        out.append({"input_ids": input_ids, "labels": input_ids.clone()})
    return out


def check_held_out(cfg: DataConfig, *, vocab_size: int, global_batch_size: int) -> None:
    """ValueError naming what to change unless the held-out set holds one evaluation batch of
    ``global_batch_size`` sequences (and, from data.val_path, ids < vocab_size). Nothing to check without one."""
    if not cfg.has_validation:
        return
    if cfg.val_path:
        try:
            validate_data(_as_val_source(cfg), vocab_size=vocab_size)
        except ValueError as e:  # the held-out set is read as data.path is: say which setting named it
            raise renamed(e, "data.val_path") from None
        key, fix = "data.val_path", "use a larger held-out set or lower data.seq_len"
    else:
        key, fix = "data.val_fraction", "raise data.val_fraction or use data.val_path"
        if len(split_held_out(load_tokens(cfg), cfg.val_fraction, cfg.seq_len)[0]) == 0:
            raise ValueError(f"data.val_fraction: {cfg.val_fraction} holds out every sequence of the corpus and "
                             "leaves none to train on; lower data.val_fraction or use data.val_path")
    num_val = len(load_val_tokens(cfg)) // cfg.seq_len
    if num_val < global_batch_size:
        raise ValueError(f"{key}: the held-out set holds {num_val} sequences of data.seq_len={cfg.seq_len}, fewer "
                         f"than one evaluation batch of {global_batch_size} (ranks x num_sub_batches x "
                         f"sub_batch_size); {fix}")


# ---------------------------------------------------------------------------------------------
# Document-aware packing (data.document_mask)
# ---------------------------------------------------------------------------------------------


def eos_token_id(cfg: DataConfig) -> int:
    """The token that joins documents in ``cfg``'s stream: a token directory's own (its index, written by
    prepare with the tokenizer it used), else the tokenizer's EOS."""
    paths = [e["path"] for e in cfg.mixture] if cfg.mixture else [cfg.path] if cfg.source == "tokens" else []
    found = {read_index(p)["eos_token_id"] for p in paths if p and Path(p).is_dir()}
    if len(found) > 1:
        raise ValueError(f"data.mixture: its token directories end documents with different EOS ids {sorted(found)}; "
                         "prepare them with one tokenizer")
    return found.pop() if found else int(build_tokenizer(cfg.tokenizer).eos_token_id)


def document_position_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Positions that restart at each packed document: 0 at the start of a row and right after each EOS (an EOS
    ends its document). (B, s) -> (B, s). Given to the model as ``position_ids``, they make its attention
    block-causal per document (Hugging Face's packed-sequence masks) and its RoPE positions per document."""
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)  # (B, s)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def apply_document_mask(batch: dict[str, torch.Tensor], eos_token_id: int) -> dict[str, torch.Tensor]:
    """``batch`` with per-document ``position_ids``, and no target at a document's first token (predicting it
    would read the document before): the loss is the sum of each document's own loss, as if run alone."""
    position_ids = document_position_ids(batch["input_ids"], eos_token_id)
    return {**batch, "position_ids": position_ids, "labels": batch["labels"].masked_fill(position_ids == 0, -100)}


def check_prepared_with(cfg: DataConfig) -> None:
    """Token data (each dataset of a mixture, and ``data.val_path``): ValueError unless ``data.tokenizer`` is the
    tokenizer that prepared it (the same number of tokens and EOS id). A training run checks this after
    :func:`validate_data`: its checkpoints carry ``data.tokenizer``, and generation and export read the model's ids
    with it. A loader alone (``build_loader``) reads ids whatever made them."""
    if cfg.source != "tokens":
        return
    paths = [entry["path"] for entry in cfg.mixture] if cfg.mixture else [cfg.path]
    paths += [cfg.val_path] if cfg.val_path else []
    metas = [token_source_meta(path) for path in paths]
    tok = build_tokenizer(cfg.tokenizer)
    ours = (len(tok), int(tok.eos_token_id))
    for path, meta in zip(paths, metas):
        theirs = (meta["vocab_size"], meta.get("eos_token_id", ours[1]))  # an old .bin sidecar records no EOS
        if theirs != ours:
            raise ValueError(
                f"data.tokenizer: {path!r} was prepared with {meta.get('tokenizer')!r} ({theirs[0]} tokens, EOS "
                f"{theirs[1]}), but this run's tokenizer {cfg.tokenizer!r} has {ours[0]} tokens, EOS {ours[1]}; a "
                "checkpoint carries the run's tokenizer, so set data.tokenizer to the one that prepared the data "
                "(data.tokenizer=null takes it from the data where it can be loaded here)")


def tokenizer_difference(name: str, reference: str) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
    """((tokens, EOS id) of ``name``, the same of ``reference``) where the two tokenizers differ in either, else None:
    what a model's ids are checked by (:func:`check_prepared_with` compares the same two numbers)."""
    if name == reference or (name != "bytes" and reference != "bytes"
                             and Path(name).resolve() == Path(reference).resolve()):
        return None
    ours, theirs = build_tokenizer(name), build_tokenizer(reference)
    ours_id, theirs_id = (len(ours), int(ours.eos_token_id)), (len(theirs), int(theirs.eos_token_id))
    return None if ours_id == theirs_id else (ours_id, theirs_id)


def other_than_models_own(cfg: DataConfig, model_path: Optional[str]) -> Optional[str]:
    """Why ``data.tokenizer`` is not ``model_path``'s own tokenizer (another vocabulary size or EOS), if it is not
    and the checkpoint has one: a pretrained model trained on another tokenizer's ids learns new meanings for its
    ids, rarely what was meant. None otherwise."""
    own = default_tokenizer(model_path)
    if not model_path or own != model_path or (diff := tokenizer_difference(cfg.tokenizer, own)) is None:
        return None
    (tokens, eos), (own_tokens, own_eos) = diff
    return (f"data.tokenizer {cfg.tokenizer!r} ({tokens} tokens, EOS {eos}) is not model.path's own "
            f"tokenizer ({own_tokens} tokens, EOS {own_eos}): the pretrained model learns new meanings "
            f"for its ids, and the checkpoint and its export carry {cfg.tokenizer!r}")


def renamed(error: ValueError, key: str) -> ValueError:
    """``error`` of a path read as ``data.path`` is, naming ``key`` (the setting that gave the path: a mixture's
    entry, ``data.val_path``) wherever it says ``data.path``; any other error as it is."""
    from fsdp_speedloader.app.launch import UserError  # one found mid-run stays one (printed as one line there too)

    if not str(error).startswith("data.path:"):
        return error
    return (UserError if isinstance(error, UserError) else ValueError)(str(error).replace("data.path", key))


def _named_meta(key: str, path: PathLike) -> dict:
    """:func:`token_source_meta`, its errors naming ``key`` (a mixture's entry, ``data.mixture[i].path``)."""
    try:
        return token_source_meta(path)
    except ValueError as e:
        raise renamed(e, key) from None


def validate_data(cfg: DataConfig, *, vocab_size: int) -> None:
    """Checks that ``cfg`` yields at least one sequence of ids < vocab_size; ValueError says what to change."""
    if cfg.source == "synthetic":
        return
    if cfg.source == "tokens":
        paths = [entry["path"] for entry in cfg.mixture] if cfg.mixture else [cfg.path]
        keys = [f"data.mixture[{i}].path" for i in range(len(paths))] if cfg.mixture else ["data.path"]
        metas = [_named_meta(key, path) for key, path in zip(keys, paths)]
        for path, meta in zip(paths, metas):
            if meta["vocab_size"] > vocab_size:
                raise ValueError(f"model.vocab_size: {path!r} was tokenized with {meta['tokenizer']!r} (vocab_size="
                                 f"{meta['vocab_size']}), larger than the model's vocab_size={vocab_size}; use "
                                 f"model.vocab_size >= {meta['vocab_size']} or re-tokenize with a smaller tokenizer")
            if meta["vocab_size"] != metas[0]["vocab_size"]:
                raise ValueError(f"data.mixture: {path!r} was tokenized with {meta['tokenizer']!r} (vocab_size="
                                 f"{meta['vocab_size']}), {paths[0]!r} with {metas[0]['tokenizer']!r} (vocab_size="
                                 f"{metas[0]['vocab_size']}); prepare every dataset of a mixture with one tokenizer")
        # Each dataset of a mixture must give at least one sequence: check the smallest.
        num_tokens, corpus = min((meta["num_tokens"], repr(path)) for path, meta in zip(paths, metas))
    else:
        if cfg.source == "text":
            text_files(cfg.path)  # path errors first, before a tokenizer is loaded
        n_vocab = len(build_tokenizer(cfg.tokenizer))
        if n_vocab > vocab_size:
            raise ValueError(f"model.vocab_size: data.tokenizer={cfg.tokenizer!r} has {n_vocab} tokens but the "
                             f"model's vocab_size is {vocab_size}; use model.vocab_size >= {n_vocab} or a "
                             "smaller data.tokenizer")
        num_tokens = len(load_tokens(cfg))
        corpus = repr(cfg.path) if cfg.source == "text" else "the default corpus"
        if num_tokens == 0:
            raise ValueError(f"data.path: {corpus} holds no text (every document is empty)")
    if num_tokens < cfg.seq_len:
        raise ValueError(f"data.seq_len: {corpus} has {num_tokens} tokens, fewer than one sequence of "
                         f"data.seq_len={cfg.seq_len}; lower data.seq_len or use a larger corpus")


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def _check_loader_args(seq_len: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
    if seq_len < 1:
        raise ValueError(f"data.seq_len: got {seq_len}; must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size: got {batch_size}; must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got rank={rank} for world_size={world_size}; need 0 <= rank < world_size")
    if seed < 0:
        raise ValueError(f"data.seed: got {seed}; use a non-negative integer")


class TokenLoader:
    """Packed, resumable, rank-sharded batches of fixed-length sequences from one 1-D token array."""

    def __init__(self, tokens: Union[np.ndarray, TokenStream], *, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, order: Optional[str] = None) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D stream of token ids, got shape {tokens.shape}")
        _check_loader_args(seq_len, batch_size, rank, world_size, seed)
        self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = (
            seq_len, batch_size, rank, world_size, seed)
        self.num_sequences = len(tokens) // seq_len
        if self.num_sequences == 0:
            raise ValueError(f"data.seq_len: the corpus has {len(tokens)} tokens, fewer than one sequence of "
                             f"data.seq_len={seq_len}; lower data.seq_len or use a larger corpus")
        if self.num_sequences < batch_size * world_size and rank == 0:
            log.warning("data: the corpus gives %d sequences of data.seq_len=%d, fewer than one global batch of %d: "
                        "every step repeats sequences (an epoch is shorter than a step); use a larger corpus or a "
                        "smaller batch", self.num_sequences, seq_len, batch_size * world_size)
        # A view, or rows read on demand from token files: only the rows a batch picks are ever read.
        self.sequences = (tokens.sequences(seq_len) if isinstance(tokens, TokenStream)
                          else tokens[: self.num_sequences * seq_len].reshape(self.num_sequences, seq_len))  # (S, s)
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next global sequence
        # "keyed": a KeyedPermutation, for token files (no order array grows with the corpus). "permutation": an
        # order array, for a corpus tokenized in memory (the order those runs always had) and for a checkpoint of
        # token files saved before the keyed order (it resumes mid-epoch on the order it drew).
        if order not in (None, "keyed", "permutation"):
            raise ValueError(f"order: got {order!r}; use 'keyed' or 'permutation'")
        self.order = order or ("keyed" if isinstance(tokens, TokenStream) else "permutation")
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> Union[np.ndarray, KeyedPermutation]:
        if self.order == "permutation":
            return np.random.default_rng((self.seed, epoch)).permutation(self.num_sequences)
        return KeyedPermutation(self.num_sequences, (self.seed, epoch))

    def _take(self, count: int) -> np.ndarray:
        """The next ``count`` sequence indices of the global order, running into new epochs as needed."""
        taken = []
        while count > 0:
            n = min(count, self.num_sequences - self.position)
            taken.append(self._order[self.position : self.position + n])
            self.position += n
            count -= n
            if self.position == self.num_sequences:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
        return np.concatenate(taken)

    def next_batch(self) -> dict[str, torch.Tensor]:
        # Every rank walks the same global order and keeps its own slice: ranks never share a
        # sequence within a step (given enough sequences), and all hold the same state.
        global_ids = self._take(self.world_size * self.batch_size)  # (world_size * batch_size,)
        ids = global_ids[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]  # (batch_size,)
        input_ids = torch.from_numpy(self.sequences[ids].astype(np.int64))  # (batch_size, seq_len)
        # Hugging Face causal LMs shift labels themselves.
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def progress(self) -> dict:
        """For every log record: epochs done (a fraction: the position in this one) and the dataset's tokens."""
        return {"epoch": self.epoch + self.position / self.num_sequences,
                "dataset_tokens": self.num_sequences * self.seq_len}

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "position": int(self.position), "num_sequences": int(self.num_sequences),
                "order": self.order, "seed": int(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        if "mixture" in state:
            raise ValueError("data.mixture: the checkpoint was saved by a run with data.mixture; resume with that "
                             "mixture (data=mixture)")
        if "num_sequences" not in state:  # SyntheticLoader's state: a step count
            raise ValueError(f"data: the checkpoint was saved by a run with {SYNTHETIC_RUN}; resume with "
                             "data=synthetic, or start fresh: checkpoint.resume=null or another checkpoint.dir")
        if int(state["num_sequences"]) != self.num_sequences:
            raise ValueError(f"data: the checkpoint's loader ran over {state['num_sequences']} sequences but this "
                             f"corpus gives {self.num_sequences}; resume with the same data.path, data.tokenizer, "
                             "data.seq_len and data.val_fraction")
        if not 0 <= int(state["position"]) < self.num_sequences:
            raise ValueError(f"data: loader state position={state['position']} is out of range")
        check_same_seed(state, self.seed)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = state.get("order", "permutation")
        self._order = self._epoch_order(self.epoch)


SYNTHETIC_RUN = "data=synthetic (random tokens)"


class SyntheticLoader:
    """Uniform random tokens; batch k of rank r depends only on (seed, k, r), so it resumes exactly."""

    def __init__(self, *, vocab_size: int, seq_len: int, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError(f"model.vocab_size: got {vocab_size}; must be >= 1")
        _check_loader_args(seq_len, batch_size, rank, world_size, seed)
        self.vocab_size, self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = (
            vocab_size, seq_len, batch_size, rank, world_size, seed)
        self.step = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        # SeedSequence mixes the three ints well; seed + step + rank arithmetic would collide.
        key = np.random.SeedSequence((self.seed, self.step, self.rank)).generate_state(1, dtype=np.uint64)[0]
        generator = torch.Generator().manual_seed(int(key))
        input_ids = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len), generator=generator)
        self.step += 1
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def progress(self) -> dict:
        """No epochs or dataset size: the tokens are drawn afresh."""
        return {}

    def state_dict(self) -> dict:
        return {"step": int(self.step)}

    def load_state_dict(self, state: dict) -> None:
        if "step" not in state:  # a corpus's or a mixture's position
            raise ValueError(f"data: the checkpoint was saved by a run that read a corpus (data.mixture, "
                             f"data.path or the embedded one), this one has {SYNTHETIC_RUN}; resume with that run's "
                             "data settings, or start fresh: checkpoint.resume=null or another checkpoint.dir")
        self.step = int(state["step"])


def build_loader(cfg: DataConfig, *, vocab_size: int, batch_size: int, rank: int = 0,
                 world_size: int = 1) -> Union[TokenLoader, SyntheticLoader, MixtureLoader]:
    """The loader of ``cfg`` for one rank; ``batch_size`` is sequences per rank per step."""
    validate_data(cfg, vocab_size=vocab_size)
    if cfg.mixture:
        _check_loader_args(cfg.seq_len, batch_size, rank, world_size, cfg.seed)
        datasets = []
        for i, entry in enumerate(cfg.mixture):
            stream = read_token_source(entry["path"])
            stream.key = f"data.mixture[{i}].path"  # what its errors mid-run name
            datasets.append((entry["path"], stream.sequences(cfg.seq_len)))
        return MixtureLoader(datasets, [entry["weight"] for entry in cfg.mixture], batch_size=batch_size,
                             rank=rank, world_size=world_size, seed=cfg.seed)
    if cfg.source == "synthetic":
        return SyntheticLoader(vocab_size=vocab_size, seq_len=cfg.seq_len, batch_size=batch_size, rank=rank,
                               world_size=world_size, seed=cfg.seed)
    tokens = split_held_out(load_tokens(cfg), cfg.val_fraction, cfg.seq_len)[0]  # all of them without val_fraction
    return TokenLoader(tokens, seq_len=cfg.seq_len, batch_size=batch_size, rank=rank, world_size=world_size,
                       seed=cfg.seed)
