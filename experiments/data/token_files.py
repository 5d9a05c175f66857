"""Token files: 1-D ``.npy`` arrays of token ids (read as memmaps), optionally ``.array_record`` files whose
records are little-endian int32 token sequences (one document per record).

Document boundaries, when known, come from a ``<name>.docs.npy`` sidecar beside ``<name>.npy`` (int64
offsets [n_docs + 1], document i = tokens[off[i]:off[i+1]], as ``experiments.data.prepare`` writes), from
the records of an ``.array_record`` file, or else from a separator token (``eos_id``)."""

from __future__ import annotations

import os

import numpy as np


class TokenFileError(ValueError):
  """A token file (or its sidecar) that cannot be used; the message names the file and what was expected."""


def docs_path(path: str) -> str:
  """The offsets sidecar of a ``.npy`` token file."""
  return path[: -len(".npy")] + ".docs.npy"


def _array_record_docs(path: str) -> list[np.ndarray]:
  from array_record.python import array_record_module as arm  # pylint: disable=g-import-not-at-top

  try:
    reader = arm.ArrayRecordReader(path)
    records = reader.read_all()
  except Exception as e:  # pylint: disable=broad-except  (the reader raises bare RuntimeErrors)
    raise TokenFileError(f"{path}: not a readable .array_record file ({_first_line(e)})") from None
  bad = [i for i, r in enumerate(records) if len(r) % 4]
  if bad:
    raise TokenFileError(
      f"{path}: record {bad[0]} has {len(records[bad[0]])} bytes; expected little-endian "
      "int32 token ids (a multiple of 4 bytes)"
    )
  return [np.frombuffer(r, dtype="<i4") for r in records]


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _load_npy(path: str, what: str) -> np.ndarray:
  """A memmapped .npy array; a file that is not one (empty, truncated, other bytes) is a TokenFileError."""
  if os.path.getsize(path) == 0:
    raise TokenFileError(f"{path}: empty file; expected a .npy array of {what}")
  try:
    return np.load(path, mmap_mode="r", allow_pickle=False)
  except (ValueError, EOFError, OSError) as e:
    raise TokenFileError(
      f"{path}: not a readable .npy array of {what} ({_first_line(e)})"
    ) from None


def load_offsets(path: str, tokens: np.ndarray, eos_id: int = -1) -> np.ndarray | None:
  """Document offsets [n_docs + 1] of a token file, or None when its boundaries are unknown.

  A ``.docs.npy`` sidecar must fit the token file: 1-D integer offsets increasing from 0 to its length,
  and, with a separator (eos_id >= 0), every document ending with it (as experiments.data.prepare writes
  them); one that does not is a TokenFileError rather than boundaries of some other file."""
  if path.endswith(".npy") and os.path.exists(docs_path(path)):
    side = docs_path(path)
    raw = _load_npy(side, "document offsets")
    if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer):
      raise TokenFileError(
        f"{side}: expected 1-D integer document offsets, got shape {raw.shape} dtype {raw.dtype}"
      )
    off = np.asarray(raw, np.int64)
    if len(off) < 2 or off[0] != 0 or off[-1] != len(tokens) or np.any(np.diff(off) <= 0):
      raise TokenFileError(
        f"{side}: expected increasing document offsets from 0 to {len(tokens)} (the length "
        f"of {path}), got {len(off)} offsets from {off[0] if len(off) else None} to "
        f"{off[-1] if len(off) else None}"
      )
    if eos_id >= 0:
      ends = np.asarray(tokens[off[1:] - 1])
      wrong = np.flatnonzero(ends != eos_id)
      if len(wrong):
        i = int(wrong[0])
        raise TokenFileError(
          f"{side}: document {i} ends at token {int(off[i + 1]) - 1} (id {int(ends[i])}), not "
          f"at the separator eos_id={eos_id}: these offsets do not belong to {path}, or "
          "data.eos_id is not its separator"
        )
    return off
  if path.endswith(".array_record"):
    lens = [len(d) for d in _array_record_docs(path)]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
  if eos_id >= 0:  # every document ends with (and includes) eos_id; a trailing rest is one more
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    return np.unique(np.concatenate([[0], ends, [len(tokens)]])).astype(np.int64)
  return None


def load_tokens(path: str) -> np.ndarray:
  """The token ids of a file as a 1-D integer array (a memmap for .npy); a file that is not one is a
  TokenFileError naming it."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"data file not found: {path!r}")
  if path.endswith(".npy"):
    arr = _load_npy(path, "token ids")
    if arr.ndim != 1:
      raise TokenFileError(f"{path}: expected a 1-D token array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise TokenFileError(f"{path}: expected integer token ids, got dtype {arr.dtype}")
    return arr
  if path.endswith(".array_record"):
    docs = _array_record_docs(path)
    return np.concatenate(docs) if docs else np.zeros((0,), np.int32)
  raise TokenFileError(f"{path}: unsupported token file type (use .npy or .array_record)")


_SLICE = 1 << 24  # ids read at a time: a memmap is never loaded whole
_RANGES = {}  # (path, size, mtime) -> (min id, max id): a file is scanned once per process


def id_range(path: str, tokens: np.ndarray) -> tuple[int, int]:
  """(smallest, largest) token id of a non-empty file."""
  st = os.stat(path)
  key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
  if key not in _RANGES:
    parts = [np.asarray(tokens[a : a + _SLICE]) for a in range(0, len(tokens), _SLICE)]
    _RANGES[key] = (min(int(p.min()) for p in parts), max(int(p.max()) for p in parts))
  return _RANGES[key]


def check_ids(path: str, tokens: np.ndarray, vocab_size: int):
  """Every id in [0, vocab_size): a negative id would wrap around in the embedding lookup and one past the
  vocabulary reads no row (NaN loss), so neither may reach the model."""
  if not len(tokens):
    return
  lo, hi = id_range(path, tokens)
  if lo >= 0 and hi < vocab_size:
    return
  bad = lo if lo < 0 else hi
  for a in range(0, len(tokens), _SLICE):
    hits = np.flatnonzero(np.asarray(tokens[a : a + _SLICE]) == bad)
    if len(hits):
      raise TokenFileError(
        f"{path}: token id {bad} at position {a + int(hits[0])} is outside [0, "
        f"vocab_size={vocab_size}) (ids from {lo} to {hi}); use a model vocabulary that "
        "covers the file"
      )


def open_token_file(
  path: str, *, min_tokens: int, vocab_size: int, eos_id: int = -1, pack_documents: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
  """(tokens, document offsets or None) of a token file checked for use: readable, 1-D integer ids in
  [0, vocab_size), at least ``min_tokens`` of them (a window is seq_len + 1), and a fitting sidecar."""
  tokens = load_tokens(path)
  if len(tokens) < min_tokens:
    raise TokenFileError(
      f"{path}: {len(tokens)} tokens, fewer than the {min_tokens} of one window "
      f"(seq_len + 1); use a longer file or a shorter data.seq_len"
    )
  check_ids(path, tokens, vocab_size)
  offsets = load_offsets(path, tokens, eos_id) if pack_documents else None
  return tokens, offsets


def check_run_files(config):
  """Opens every token file a run config names (config.data.train_path, eval_path, long_eval_path) as the
  loader will, before anything is built; raises FileNotFoundError for a missing file and ConfigError for one
  that cannot be used, naming the key."""
  from experiments import schema  # pylint: disable=g-import-not-at-top

  d = config.data
  if d.kind != "token_file":
    return
  vocab = int(config.model.vocab_size)
  windows = {
    "train_path": d.seq_len + 1,
    "eval_path": (d.eval_seq_len or d.seq_len) + 1,
    "long_eval_path": 2,
  }
  for key, min_tokens in windows.items():
    path = d[key]
    if not path:
      continue
    if not os.path.exists(path):
      raise FileNotFoundError(
        f"config.data.{key}: data file not found: {path!r}; make one with `python -m "
        f"experiments.data.make_token_file {path}` (synthetic documents) or `python -m experiments.data.prepare "
        "--out=<dir>` (a text corpus, then --config.data.corpus_dir=<dir>), or point "
        f"--config.data.{key} to an existing .npy / .array_record token file"
      )
    try:
      open_token_file(
        path,
        min_tokens=min_tokens,
        vocab_size=vocab,
        eos_id=int(d.eos_id),
        pack_documents=bool(d.pack_documents) or key == "long_eval_path",
      )
    except TokenFileError as e:
      raise schema.ConfigError(f"config.data.{key}: {e}") from None


def segment_ids(offsets: np.ndarray, start: int, length: int) -> np.ndarray:
  """Segment id (0, 1, ...) of the inputs ``tokens[start:start + length]`` of a packed window.

  Input position p belongs to the document whose first TARGET is p + 1: document i's inputs are
  ``tokens[off[i] - 1 : off[i+1] - 1]`` (the previous document's last token, its EOS, acts as BOS), so
  every target token of document i is predicted from document i's own context only."""
  p = np.arange(start, start + length) + 1
  doc = np.searchsorted(offsets, p, side="right") - 1
  return (doc - doc[0]).astype(np.int32)


class WindowSource:
  """Random access to non-overlapping windows of ``seq_len + 1`` tokens (packed documents).

  With ``offsets`` (document boundaries) each window also carries ``segment_ids``: the model restarts
  from its initial state wherever a new document begins inside the window."""

  def __init__(self, tokens: np.ndarray, seq_len: int, offsets: np.ndarray | None = None):
    self.tokens, self.seq_len, self.offsets = tokens, seq_len, offsets
    self.n = (len(tokens) - 1) // seq_len
    if self.n <= 0:
      raise ValueError(
        f"token file has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
      )

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    start = i * self.seq_len
    w = np.asarray(self.tokens[start : start + self.seq_len + 1], np.int32)
    out = {"inputs": w[:-1], "targets": w[1:], "mask": np.ones(self.seq_len, np.float32)}
    if self.offsets is not None:
      out["segment_ids"] = segment_ids(self.offsets, start, self.seq_len)
    return out


def documents(tokens: np.ndarray, eos_id: int) -> list[tuple[int, int]]:
  """[start, end) spans of documents; each ends with (and includes) ``eos_id``; a trailing rest counts."""
  ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
  starts = np.concatenate([[0], ends[:-1]]) if len(ends) else np.zeros((0,), np.int64)
  spans = [(int(a), int(b)) for a, b in zip(starts, ends) if b - a >= 2]
  last = int(ends[-1]) if len(ends) else 0
  if len(tokens) - last >= 2:
    spans.append((last, len(tokens)))
  return spans


class TBTTSource:
  """Batches for truncated BPTT: ``batch_size`` stable slots, each reading its own documents in order in
  chunks of ``seq_len`` tokens. Element ``n`` is the whole (per-process) batch of step ``n``; a row has
  ``reset=True`` where a new document begins (its state must restart). The last chunk of a document is
  padded (``mask`` 0). Documents are dealt to slots round-robin after a seeded shuffle; an epoch ends when
  the shortest slot stream runs out."""

  def __init__(self, tokens, eos_id, seq_len, global_batch, seed, process_index=0, process_count=1):
    self.tokens, self.seq_len = tokens, seq_len
    docs = documents(tokens, eos_id)
    if len(docs) < global_batch:
      raise ValueError(
        f"tbtt needs at least global_batch_size={global_batch} documents, found {len(docs)}"
      )
    order = np.random.default_rng(seed).permutation(len(docs))
    local = global_batch // process_count
    slots = range(process_index * local, (process_index + 1) * local)
    streams = []
    for s in slots:
      chunks = []
      for d in order[s::global_batch]:
        a, b = docs[d]
        n = -(-(b - a - 1) // seq_len)
        chunks += [(a + c * seq_len, b, c == 0) for c in range(n)]
      streams.append(chunks)
    self.steps = min(len(c) for c in streams)
    self.streams = [c[: self.steps] for c in streams]

  def __len__(self):
    return self.steps

  def __getitem__(self, n):
    b, t = len(self.streams), self.seq_len
    out = {
      "inputs": np.zeros((b, t), np.int32),
      "targets": np.zeros((b, t), np.int32),
      "mask": np.zeros((b, t), np.float32),
      "reset": np.zeros((b,), bool),
    }
    for r, stream in enumerate(self.streams):
      start, end, first = stream[n]
      w = np.asarray(self.tokens[start : min(start + t + 1, end)], np.int32)
      m = len(w) - 1
      out["inputs"][r, :m] = w[:-1]
      out["targets"][r, :m] = w[1:]
      out["mask"][r, :m] = 1.0
      out["reset"][r] = first
    return out
