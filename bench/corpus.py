"""A real text corpus on every machine: the running interpreter's standard library, bytes as tokens.

`read_corpus()` is the reusable reader (the convergence benchmark trains on it; an example
or a stream can share it): one document per source file, tokens are the file's bytes
(vocabulary 256), and each file goes to the training or the held-out side by a hash of its
path relative to the corpus root, so the split is the same on every machine that has the file.

Why the documents are not whole files: the stdlib's files range from 64 bytes to 750 KB
(median about 6.5 KB), so at a CPU-sized window (512 bytes) almost every file would be cut
into window-sized pieces and no short documents would be left. The length of a file's
document is its size mapped to the window's scale by a square root,

    length = round(window * sqrt(size / size_ref)),  clamped to [min_length, size],

with `size_ref` the `ref_quantile` (0.99) file size. The map keeps the order of the sizes
and their long tail (the largest files still exceed the window, and are cut to pieces by
`split_documents` like any long document) and compresses the range, so most tokens sit in
short documents as in the paper's §2 (`stats()["short_token_share"]` reports the share of
tokens in documents shorter than half the window). Which text fills the document: in epoch
0 the file's first `length` bytes; in a later epoch a slice of the same length starting at
a line boundary picked by a hash of (path, epoch), so later passes over the training files
read new text at the same lengths.

    wlb-opt bench corpus [--corpus DIR] [--window W]   prints the corpus statistics
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..cost_args import count

EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")
"""Directory names never read: installed packages differ between machines; caches are not text."""


def stdlib_root() -> Path:
    """The standard library's source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def heldout_by_path(rel_path: str, heldout_per_mille: int) -> bool:
    """True when the file at `rel_path` (posix, relative to the corpus root) is held out:
    the first 8 bytes of its SHA-256, mod 1000, fall below `heldout_per_mille`."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < heldout_per_mille


def _is_text(raw: bytes) -> bool:
    return b"\x00" not in raw[:4096]


@dataclass(frozen=True)
class TextCorpus:
    """Files of one corpus root with their document lengths at `window` (see the module docstring)."""

    root: Path
    paths: tuple
    """Relative posix paths, sorted."""
    contents: tuple
    """The bytes of each file."""
    lengths: np.ndarray
    """Document length (tokens = bytes) of each file at the window."""
    heldout: np.ndarray
    """True for held-out files."""
    window: int

    @property
    def train_files(self) -> np.ndarray:
        return np.flatnonzero(~self.heldout)

    @property
    def heldout_files(self) -> np.ndarray:
        return np.flatnonzero(self.heldout)

    def document(self, file: int, epoch: int = 0) -> bytes:
        """The document of `file` in `epoch`: `lengths[file]` bytes of the file (the first ones
        in epoch 0, else a slice starting at a line boundary chosen by a hash of (path, epoch))."""
        raw, length = self.contents[file], int(self.lengths[file])
        room = len(raw) - length
        if epoch == 0 or room == 0:
            return raw[:length]
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        digest = hashlib.sha256(f"{self.paths[file]}\n{epoch}".encode("utf-8")).digest()
        start = int.from_bytes(digest[:8], "big") % (room + 1)
        newline = raw.find(b"\n", start, room)  # begin after a newline when one is in range
        start = newline + 1 if newline >= 0 else start
        return raw[start:start + length]

    def tokens(self, file: int, epoch: int = 0) -> np.ndarray:
        """`document(file, epoch)` as uint8 token ids."""
        return np.frombuffer(self.document(file, epoch), dtype=np.uint8)

    def stats(self) -> dict:
        """Files, documents and tokens of each side, the share of tokens in documents shorter
        than half the window, the documents at least a window long, length percentiles."""
        lengths, w = self.lengths, self.window
        pct = np.percentile(lengths, [10, 50, 90, 99]).tolist() if len(lengths) else [0] * 4
        return dict(
            root=str(self.root), window=w, files=len(self.paths),
            train_files=int((~self.heldout).sum()), heldout_files=int(self.heldout.sum()),
            train_tokens_per_epoch=int(lengths[~self.heldout].sum()), heldout_tokens=int(lengths[self.heldout].sum()),
            short_token_share=float(lengths[lengths < w // 2].sum() / max(1, lengths.sum())),
            documents_at_least_window=int((lengths >= w).sum()), longest=int(lengths.max(initial=0)),
            length_p10_p50_p90_p99=[float(x) for x in pct],
            bytes_read=int(sum(len(c) for c in self.contents)))


def _read_files(root: Path, suffixes: tuple | None, min_bytes: int) -> tuple[tuple, tuple]:
    """(relative posix paths, contents) of the corpus files under `root`, sorted by path."""
    paths, contents = [], []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (not path.is_file() or path.is_symlink() or any(part in EXCLUDED_DIRS for part in rel.parts)
                or (suffixes is not None and not path.name.endswith(suffixes))):
            continue
        try:
            raw = path.read_bytes()
        except OSError:
            continue  # unreadable files are not part of the corpus
        if len(raw) >= min_bytes and _is_text(raw):
            paths.append(rel.as_posix())
            contents.append(raw)
    return tuple(paths), tuple(contents)


def read_corpus(root: str | Path | None = None, window: int = 512, *, suffixes: Sequence[str] | None = None,
                heldout_per_mille: int = 100, exponent: float = 0.5, ref_quantile: float = 0.99,
                min_length: int = 16, min_bytes: int = 64) -> TextCorpus:
    """Read a text corpus (see the module docstring).

    Args:
        root: folder to read (default: `stdlib_root()`, and then `suffixes` defaults to ".py").
            Every regular file below it (symlinks and EXCLUDED_DIRS skipped) of at least
            `min_bytes` bytes whose first 4 KB hold no NUL byte is one document.
        window: training context in tokens; the lengths are scaled to it.
        suffixes: file name endings to keep (None: every text file).
        heldout_per_mille: held-out files per thousand (by `heldout_by_path`).
        exponent, ref_quantile: the length map `window * (size / size_ref) ** exponent`,
            size_ref the `ref_quantile` file size; lengths are clamped to [min_length, size].
    """
    for name, value, low in (("window", window, 2), ("min_length", min_length, 2), ("min_bytes", min_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not (isinstance(heldout_per_mille, int) and 0 < heldout_per_mille < 1000):
        raise ValueError(f"heldout_per_mille must be an integer in 1..999, got {heldout_per_mille!r}")
    if not 0 < exponent <= 1:
        raise ValueError(f"exponent must be in (0, 1], got {exponent!r}")
    if not 0 < ref_quantile <= 1:
        raise ValueError(f"ref_quantile must be in (0, 1], got {ref_quantile!r}")
    if root is None:
        root, suffixes = stdlib_root(), (".py",) if suffixes is None else suffixes
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"corpus root {str(root)!r} is not a directory")
    paths, contents = _read_files(root, None if suffixes is None else tuple(suffixes), min_bytes)
    if not paths:
        raise ValueError(f"no text files of at least {min_bytes} bytes under {str(root)!r}"
                         + (f" with suffixes {list(suffixes)}" if suffixes else ""))
    sizes = np.array([len(c) for c in contents], dtype=np.float64)
    ref = float(np.quantile(sizes, ref_quantile))
    lengths = np.round(window * (sizes / ref) ** exponent)
    lengths = np.minimum(np.maximum(lengths, min_length), sizes).astype(np.int64)
    heldout = np.array([heldout_by_path(p, heldout_per_mille) for p in paths], dtype=bool)
    if heldout.all() or not heldout.any():
        raise ValueError(f"the split of {len(paths)} files put all of them on one side; use a larger corpus "
                         f"or another heldout_per_mille (got {heldout_per_mille})")
    return TextCorpus(root=root, paths=tuple(paths), contents=tuple(contents), lengths=lengths,
                      heldout=heldout, window=window)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wlb-opt bench corpus", description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="folder of text files (default: this interpreter's standard library, *.py)")
    p.add_argument("--window", type=count, default=512, help="training context in tokens (default 512)")
    args = p.parse_args(argv)
    try:
        corpus = read_corpus(args.corpus, args.window)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(corpus.stats(), indent=2))
    return 0
