"""Document-length data: built-in length distributions, a real length file, and the cutting
of a document stream into global batches.

The planner core, the CLI (`wlb-opt pack --dist`), the examples and the benchmarks all draw
their workloads from here, so this module imports only `documents` (numpy otherwise).

The stream model: documents arrive i.i.d. from a distribution; the data loader cuts
consecutive global batches of `tokens_per_batch` tokens from the stream (a document belongs to
the batch in which it starts), then documents longer than the window are cut into
window-sized pieces (`wlb_opt.split_documents`), the same for every method.

"default" (fixed here, never retuned):
    body: lognormal with median 600 tokens and sigma 0.8 (short web pages, code files, turns);
    tail: with probability 0.0015 a document is log-uniform on [65536, 163840] tokens
          (books, long reports, repositories), cut to the window afterwards.
    Calibration (run `python -m wlb_opt.bench.data` to reproduce): with the 7B model,
    (tp, cp, pp, dp) = (8, 2, 4, 1) on H100 and window 131072, documents shorter than half
    the window carry 83% of tokens (paper §2: more than 75%), and Plain-4D packing of N=4
    sequences has a mean PP imbalance of 1.47 +- 0.02 over 300 steps (paper Table 2: 1.44).
    Chosen by a scan over the tail probability in {0.0012, 0.0015, 0.0018, 0.0022} with the
    body fixed (on other seeds); nothing else was tuned, and nothing is retuned later.
"light": lognormal with median 2000 and sigma 0.6, no tail: a light-tailed control.
"heavy": the default body with a heavier, longer tail: with probability 0.003 a document is
         log-uniform on [32768, 524288] tokens (up to four windows), so about 40% of tokens
         are in documents >= 32768 (default: 18%). Fixed before any packer was run on it:
         a third shape the outlier-delay defaults were not tuned on.
"real":  lengths of text files found on the build machine (`REAL_FILE`, shipped next to this
         module; rebuilt by `python -m wlb_opt.bench.data --make-real`), sampled with
         replacement.
"code" / "prose": the source-code files only (.py, .h, .c, ...: median ~700 tokens, 0.8%
         of files >= 32K tokens) and the prose files only (.rst, .txt, .md, .html and the
         changelogs of /usr/share/doc: median ~240 tokens, a heavier tail, 2.5% >= 32K)
         of the same kind of machine, shipped in `wlb_opt/bench/` (`KIND_FILES`; rebuilt by
         `python -m wlb_opt.bench.data --make-kinds`), sampled with replacement. Two shapes
         the outlier-delay defaults were not tuned on.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Literal

import numpy as np

from ._validate import check_int, validate_lengths
from .documents import split_documents

Distribution = Literal["default", "light", "heavy", "real", "code", "prose"]
DEFAULT_SEED = 20250301
DEFAULT_PARAMS = dict(body_median=600.0, body_sigma=0.8, tail_prob=0.0015, tail_low=65536, tail_high=163840)
LIGHT_PARAMS = dict(body_median=2000.0, body_sigma=0.6, tail_prob=0.0, tail_low=65536, tail_high=163840)
HEAVY_PARAMS = dict(body_median=600.0, body_sigma=0.8, tail_prob=0.003, tail_low=32768, tail_high=524288)
REAL_FILE = Path(__file__).with_name("real_lengths.npy")
"""Token estimates of text files (one document each; see `wlb_opt.bench.data.make_real_lengths`)."""
KIND_FILES: dict[str, str] = {"code": "code_lengths.npy", "prose": "prose_lengths.npy"}
"""File names, inside the `wlb_opt.bench` package folder, of the "code" and "prose" lengths."""
DISTRIBUTIONS: dict[str, object] = {"default": DEFAULT_PARAMS, "light": LIGHT_PARAMS, "heavy": HEAVY_PARAMS,
                                    "real": "wlb_opt/real_lengths.npy",
                                    "code": "wlb_opt/bench/code_lengths.npy", "prose": "wlb_opt/bench/prose_lengths.npy"}
"""The built-in distributions: name -> mixture parameters (or the file sampled)."""

GlobalBatch = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(pieces, piece_ids, offsets) as returned by `split_documents`."""


def _mixture(rng: np.random.Generator, n: int, body_median: float, body_sigma: float, tail_prob: float,
             tail_low: float, tail_high: float) -> np.ndarray:
    body = np.exp(rng.normal(np.log(body_median), body_sigma, n))
    tail = np.exp(rng.uniform(np.log(tail_low), np.log(tail_high), n))
    lengths = np.where(rng.random(n) < tail_prob, tail, body)
    return np.maximum(1, np.round(lengths)).astype(np.int64)


def real_lengths() -> np.ndarray:
    """The shipped real length file (token estimates of text files), as int64."""
    if not REAL_FILE.exists():
        raise FileNotFoundError(f"{REAL_FILE} is missing; rebuild it with `python -m wlb_opt.bench.data --make-real`")
    return np.load(REAL_FILE).astype(np.int64)


def kind_file(kind: str) -> Path:
    """Path of the shipped "code" or "prose" length file. The folder of `wlb_opt.bench` is
    located without importing it (this core module imports no benchmark)."""
    if kind not in KIND_FILES:
        raise ValueError(f"kind must be one of {sorted(KIND_FILES)}, got {kind!r}")
    spec = importlib.util.find_spec("wlb_opt.bench")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the wlb_opt.bench package (which ships the code / prose length files) is missing")
    return Path(list(spec.submodule_search_locations)[0]) / KIND_FILES[kind]


def kind_lengths(kind: str) -> np.ndarray:
    """The shipped "code" or "prose" length file (token estimates of files), as int64."""
    return _load_kind(kind).copy()


@functools.lru_cache(maxsize=None)
def _load_kind(kind: str) -> np.ndarray:
    path = kind_file(kind)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; rebuild it with `python -m wlb_opt.bench.data --make-kinds`")
    return np.load(path).astype(np.int64)


def sample_documents(n: int, dist: Distribution = "default", seed: int = DEFAULT_SEED) -> np.ndarray:
    """`n` document lengths (tokens, uncut) from a named distribution."""
    n = check_int("n", n, 0)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    if dist == "default":
        return _mixture(rng, n, **DEFAULT_PARAMS)
    if dist == "light":
        return _mixture(rng, n, **LIGHT_PARAMS)
    if dist == "heavy":
        return _mixture(rng, n, **HEAVY_PARAMS)
    if dist == "real":
        return rng.choice(real_lengths(), size=n, replace=True)
    if dist in KIND_FILES:
        return rng.choice(_load_kind(dist), size=n, replace=True)
    raise ValueError(f"unknown length distribution {dist!r}; valid: {sorted(DISTRIBUTIONS)}")


def document_stream(n_tokens: int, dist: Distribution = "default", seed: int = DEFAULT_SEED) -> np.ndarray:
    """Document lengths of a stream holding at least `n_tokens` tokens (the shortest prefix
    of the stream that does; none for 0)."""
    n_tokens = check_int("n_tokens", n_tokens, 0)
    seed = check_int("seed", seed, 0)
    if n_tokens == 0:
        return np.zeros(0, dtype=np.int64)
    out, total, chunk, k = [], 0, 4096, 0
    while total < n_tokens:
        part = sample_documents(chunk, dist, seed + 7919 * k) if k else sample_documents(chunk, dist, seed)
        out.append(part)
        total += int(part.sum())
        k += 1
    lengths = np.concatenate(out)
    stop = int(np.searchsorted(np.cumsum(lengths), n_tokens)) + 1
    return lengths[:stop]


def global_batches(dist: Distribution, window: int, tokens_per_batch: int, n_batches: int,
                   seed: int = DEFAULT_SEED, lengths: np.ndarray | None = None) -> list[GlobalBatch]:
    """`n_batches` consecutive global batches cut from one stream.

    Returns a list of (pieces, piece_ids, offsets): each batch holds the documents that start
    within its `tokens_per_batch` tokens of the stream, cut to `window`. Ids are positions in
    the stream, so they are unique across batches. `lengths` overrides the sampled stream.
    """
    window = check_int("window", window, 1)
    tokens_per_batch = check_int("tokens_per_batch", tokens_per_batch, 1)
    n_batches = check_int("n_batches", n_batches, 0)
    if lengths is None:
        lengths = document_stream(tokens_per_batch * n_batches, dist, seed)
    elif len(np.atleast_1d(lengths)):
        lengths = validate_lengths(lengths)
    else:
        lengths = np.zeros(0, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    which = starts // tokens_per_batch
    batches = []
    for b in range(n_batches):
        idx = np.flatnonzero(which == b)
        batches.append(split_documents(lengths[idx], window, ids=idx))
    return batches


def global_batch(dist: Distribution, window: int, tokens_per_batch: int, seed: int = DEFAULT_SEED) -> GlobalBatch:
    """One global batch (pieces, piece_ids, offsets); see global_batches."""
    return global_batches(dist, window, tokens_per_batch, 1, seed)[0]
