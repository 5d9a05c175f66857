"""RULER-style single-needle retrieval (S-NIAH-1/2/3) examples: a needle "key -> value" sentence placed
at a depth of a haystack (repeated noise, or a slice of a corpus's tokens), a query, and the value as
the scored answer. experiments/data/retrieval.py's docstring gives the layout; ``retrieval.grid`` builds
the grids of these examples."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence

import numpy as np

from experiments.data import synthetic

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " One of the special magic numbers for {key} is:"  # then ' {value}' and '.'
QUERY = (
  "\nWhat is the special magic number for {key} mentioned in the provided text? The special magic "
  "number for {key} mentioned in the provided text is"
)  # then the answer ' {value}'

ADJECTIVES = (
  "amber",
  "ancient",
  "bitter",
  "brave",
  "brisk",
  "calm",
  "clever",
  "cosmic",
  "crimson",
  "curious",
  "dusty",
  "eager",
  "elegant",
  "faded",
  "fierce",
  "fluffy",
  "frozen",
  "gentle",
  "gloomy",
  "golden",
  "graceful",
  "hollow",
  "humble",
  "icy",
  "jolly",
  "keen",
  "lively",
  "lonely",
  "lucky",
  "mellow",
  "misty",
  "modest",
  "noble",
  "odd",
  "patient",
  "polite",
  "proud",
  "quiet",
  "rapid",
  "restless",
  "rusty",
  "shiny",
  "silent",
  "silver",
  "sleepy",
  "sturdy",
  "swift",
  "tidy",
  "violet",
  "wise",
  "witty",
  "zealous",
)
NOUNS = (
  "anchor",
  "badger",
  "banjo",
  "beacon",
  "biscuit",
  "canyon",
  "castle",
  "cobra",
  "comet",
  "compass",
  "cottage",
  "crystal",
  "dolphin",
  "falcon",
  "feather",
  "fiddle",
  "forest",
  "garden",
  "glacier",
  "harbor",
  "helmet",
  "island",
  "jigsaw",
  "kettle",
  "lantern",
  "lemon",
  "lobster",
  "meadow",
  "mitten",
  "nebula",
  "orchard",
  "otter",
  "parrot",
  "pebble",
  "pigeon",
  "puzzle",
  "quarry",
  "rabbit",
  "ribbon",
  "saddle",
  "salmon",
  "spider",
  "teapot",
  "thimble",
  "tiger",
  "tulip",
  "turnip",
  "valley",
  "violin",
  "walrus",
  "whistle",
  "zebra",
)

DEFAULTS = {  # the S-NIAH tasks' keyword arguments and their defaults
  "value_digits": 7,
  "adjectives": ADJECTIVES,
  "nouns": NOUNS,
  "snap": 32,
  "drop_eos": True,
  "max_tries": 100,
}


@functools.lru_cache(maxsize=8)
def _sentence_end_ids(tokenizer) -> np.ndarray:
  """Ids whose text ends a sentence (. ! ? optionally followed by quotes/brackets, or a newline)."""
  ids = []
  for i in range(tokenizer.vocab_size):
    s = tokenizer.decode([i])
    t = s.rstrip("\"')]\u201d\u2019")
    if s.endswith("\n") or (t and t[-1] in ".!?"):
      ids.append(i)
  return np.asarray(ids, np.int64)


@functools.lru_cache(maxsize=8)
def _noise_unit(tokenizer) -> np.ndarray:
  return np.asarray(tokenizer.encode(" " + NOISE), np.int64)


@functools.lru_cache(maxsize=8)
def _max_key_overhead(tokenizer, adjectives: tuple, nouns: tuple) -> int:
  """max over keys of len(NEEDLE(key)) + len(QUERY(key)) in tokens."""
  best = 0
  for a in adjectives:
    for n in nouns:
      key = f"{a}-{n}"
      n_tok = len(tokenizer.encode(NEEDLE.format(key=key))) + len(
        tokenizer.encode(QUERY.format(key=key))
      )
      best = max(best, n_tok)
  return best


def _value_token_bound(kind: str, digits: int) -> int:
  return 1 + (
    36 if kind == "uuid" else digits
  )  # ' ' + value, at most one token per byte (all ASCII)


def snih_min_length(
  tokenizer,
  *,
  value_kind: str = "number",
  value_digits: int = 7,
  adjectives: Sequence[str] = ADJECTIVES,
  nouns: Sequence[str] = NOUNS,
) -> int:
  """The shortest ``seq_len`` for which every S-NIAH example fits (needle + query + answer, empty haystack);
  an upper bound over all keys and values (values are bounded by one token per byte)."""
  over = (
    _max_key_overhead(tokenizer, tuple(adjectives), tuple(nouns))
    + len(tokenizer.encode("."))
    + 2 * _value_token_bound(value_kind, value_digits)
  )
  return over - 1  # the sequence holds seq_len + 1 tokens


def _corpus_slice(tokens: np.ndarray, start: int, n: int, eos_id: int | None) -> np.ndarray:
  """``n`` tokens read circularly from ``start``, EOS tokens dropped when ``eos_id`` is not None."""
  total = len(tokens)
  parts, got, pos, scanned = [], 0, start % total, 0
  while got < n:
    if scanned >= total:
      raise ValueError(f"haystack_tokens holds fewer than {n} non-EOS tokens")
    take = min(n - got, total - pos)
    chunk = np.asarray(tokens[pos : pos + take], np.int64)
    scanned += take
    pos = (pos + take) % total
    if eos_id is not None:
      chunk = chunk[chunk != eos_id]
    parts.append(chunk)
    got += len(chunk)
  return np.concatenate(parts)[:n] if parts else np.zeros((0,), np.int64)


def _insert_pos(hay: np.ndarray, depth: float, ends: np.ndarray, snap: int) -> int:
  size = len(hay)
  target = int(round(depth * size))
  w = min(snap, size // 10)
  cand = np.arange(max(0, target - w), min(size, target + w) + 1)
  ok = (cand == 0) | (cand == size) | np.isin(hay[np.maximum(cand - 1, 0)], ends)
  if not ok.any():
    return target
  c = cand[ok]
  return int(c[np.argmin(np.abs(c - target))])


def _draw_value(rng: np.random.Generator, kind: str, digits: int) -> str:
  if kind == "uuid":
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))
  return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def snih_example(
  index: int,
  *,
  seed: int,
  seq_len: int,
  depth: float,
  tokenizer,
  haystack_tokens: np.ndarray | None = None,
  value_kind: str = "number",
  value_digits: int = 7,
  adjectives: Sequence[str] = ADJECTIVES,
  nouns: Sequence[str] = NOUNS,
  snap: int = 32,
  drop_eos: bool = True,
  max_tries: int = 100,
  return_meta: bool = False,
):
  """One S-NIAH example (see the module docstring). ``haystack_tokens=None``: the noise haystack (snih1);
  else a slice of that corpus (snih2/3). ``value_kind``: 'number' (``value_digits`` digits) or 'uuid'.
  Returns the example dict, or ``(example, meta)`` with ``return_meta``."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"snih: depth must be in [0, 1], got {depth}")
  if value_kind not in ("number", "uuid"):
    raise ValueError(f"snih: value_kind must be 'number' or 'uuid', got {value_kind!r}")
  rng = np.random.default_rng([int(seed), int(index)])
  offset_frac = rng.random()
  # The longest haystack any key/value could need (overhead >= 0); the example's haystack is a prefix of it,
  # and a key/value is drawn until neither occurs in this (superset) haystack's text.
  n_max = seq_len + 1
  if haystack_tokens is None:
    unit = _noise_unit(tokenizer)
    hay_max = np.tile(unit, -(-n_max // len(unit)))[:n_max]
    hay_text = (NOISE + " " + NOISE).lower()  # everything the tiled noise can contain
    hay_start = 0
  else:
    total = len(haystack_tokens)
    if total == 0:
      raise ValueError("haystack_tokens is empty")
    hay_start = int(offset_frac * max(total - n_max + 1, 1))
    eos = getattr(tokenizer, "eos_id", None) if drop_eos else None
    hay_max = _corpus_slice(haystack_tokens, hay_start, n_max, eos)
    hay_text = tokenizer.decode(hay_max).lower()
  for _ in range(max_tries):
    key = f"{adjectives[rng.integers(len(adjectives))]}-{nouns[rng.integers(len(nouns))]}"
    value = _draw_value(rng, value_kind, value_digits)
    if key.lower() not in hay_text and value.lower() not in hay_text:
      break
  else:
    raise ValueError(
      f"snih: no key/value absent from the haystack in {max_tries} draws (seed={seed}, "
      f"index={index}); use other adjectives/nouns or more value digits"
    )
  answer = np.asarray(tokenizer.encode(" " + value), np.int64)
  needle = np.concatenate(
    [
      np.asarray(tokenizer.encode(NEEDLE.format(key=key)), np.int64),
      answer,
      np.asarray(tokenizer.encode("."), np.int64),
    ]
  )
  query = np.asarray(tokenizer.encode(QUERY.format(key=key)), np.int64)
  size = seq_len + 1 - len(needle) - len(query) - len(answer)
  if size < 0:
    raise ValueError(
      f"snih: seq_len={seq_len} is too short for the needle + query + answer "
      f"({len(needle) + len(query) + len(answer)} tokens)"
    )
  hay = hay_max[:size]
  pos = _insert_pos(hay, depth, _sentence_end_ids(tokenizer), snap)
  seq = np.concatenate([hay[:pos], needle, hay[pos:], query, answer])
  assert len(seq) == seq_len + 1, (len(seq), seq_len)
  ex = synthetic._pack(seq, np.arange(seq_len - len(answer), seq_len), seq_len)  # pylint: disable=protected-access
  if not return_meta:
    return ex
  return ex, {
    "key": key,
    "value": value,
    "needle_start": pos,
    "needle_len": len(needle),
    "haystack_len": size,
    "answer_len": len(answer),
    "haystack_start": hay_start,
  }
