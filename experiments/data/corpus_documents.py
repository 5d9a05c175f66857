"""The documents of one corpus source, extracted once: ``<out>/docs/<source>.jsonl`` (one
``{"name", "text"}`` per line, names unique within the source, no EOS inside a text) and the
selection counts a generator source returns."""

from __future__ import annotations

import json
import os
import time

from experiments.data import corpus_fetch, corpus_files
from experiments.data.corpus_fetch import SourceUnavailable
from experiments.data.corpus_sources import Source
from experiments.data.tokenizer import EOS


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def selection_path(out: str, source: str) -> str:
  """Where a source's selection counts (what its generator returned) are kept beside its documents."""
  return os.path.join(out, "docs", f"{source}.selection.json")


def extract_source(src: Source, out: str, cache_dir: str, refresh: bool = False, log=print) -> dict:
  """Documents of one source, from ``<out>/docs/<name>.jsonl`` when there, else extracted (and saved).

  Returns ``{'status': 'ok', 'documents': [...], 'cached': bool, 'seconds': s}`` or ``{'status':
  'unavailable', 'reason': str}``; an unavailable source prints one line.
  """
  path = os.path.join(out, "docs", f"{src.name}.jsonl")
  if os.path.exists(path) and not refresh:
    return {"status": "ok", "documents": read_jsonl(path), "cached": True, "seconds": 0.0}
  t = time.time()
  log(f"prepare: source '{src.name}': extracting ...")
  token = corpus_fetch.FETCH_LOG.set(log)  # each download says 'cached' or 'downloading'
  try:
    docs, names = [], {}
    it = iter(src.fn(cache_dir))
    while True:
      try:
        d = next(it)
      except StopIteration as stop:  # a generator source may return its selection counts
        selection = stop.value if isinstance(stop.value, dict) else None
        break
      name, text = (
        str(d["name"]),
        d["text"].replace(EOS, "<|endoftext |>"),
      )  # no EOS inside a document
      if name in names:  # names are unique within a source
        names[name] += 1
        name = f"{name}#{names[name]}"
      names.setdefault(name, 1)
      docs.append({"name": name, "text": text})
    if not docs:
      raise SourceUnavailable("no documents extracted")
  except SourceUnavailable as e:
    reason = str(e)
  except Exception as e:  # pylint: disable=broad-except  # a broken download / archive must not stop the rest
    reason = f"{type(e).__name__}: {e}"
  else:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if selection is not None:
      corpus_files.atomic_json(selection_path(out, src.name), selection)
    elif os.path.exists(selection_path(out, src.name)):
      os.remove(selection_path(out, src.name))

    def write(f):
      for d in docs:
        f.write((json.dumps(d, ensure_ascii=False) + "\n").encode())

    corpus_files.atomic_write(path, write)
    return {"status": "ok", "documents": docs, "cached": False, "seconds": time.time() - t}
  finally:
    corpus_fetch.FETCH_LOG.reset(token)
  reason = " ".join(reason.split())
  log(f"prepare: source '{src.name}' unavailable: {reason}; continuing without it")
  return {"status": "unavailable", "reason": reason}
