"""Moves a prepared corpus to a machine that reaches no registry and takes at most ~64 MiB per command.

    python3 experiments/data/ship.py pack --corpus=/tmp/kdn_code --ship=/tmp/kdn_code_ship   # here
    python3 experiments/data/ship.py stage --ship=/tmp/kdn_code_ship --part=0 --into=.ship    # here, per part
    python3 experiments/data/ship.py receive --parts=.ship --stage=/tmp/kdn_ship --out=/tmp/kdn_code  # there

``pack`` writes the corpus's files (token files, offsets, tokenizer, manifest, splits) as one xz-compressed
tar cut into parts of at most ``--part_mb`` MB, and ``ship.json``: every part's size and sha256, the
whole stream's sha256, every file's sha256 and each split's token count. ``stage`` puts ``ship.json`` and
one part into a folder of the repository that git ignores (it travels when the device command carries
it). ``receive``, run there once per part, checks the part's hash and keeps it in ``--stage`` (a folder
that outlives the command while the machine stays held); once every part is there it joins them, checks
the stream's hash, unpacks into ``--out`` and checks every file's hash and every split's token count
against the manifest (the last line says ``ship: ok``). docs/corpus.md gives the whole sequence.

Standard library and numpy only, and runnable as a script: the device image lacks grain, which importing
``experiments.data`` needs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np

SHIP_JSON = "ship.json"
PART = "part-{:03d}.xz"
# ~64 MiB travel per command, less the ~15 MB working tree that travels with it
DEFAULT_PART_MB = 48
CORPUS_FILES = ("tokenizer.json", "manifest.json", "splits.json")


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def corpus_files(corpus: str) -> list[str]:
  """The files a trainer needs: the split token files and offsets, and the small json files."""
  with open(os.path.join(corpus, "manifest.json"), encoding="utf-8") as f:
    splits = json.load(f)["splits"]
  return list(CORPUS_FILES) + [f"{s}{e}" for s in splits for e in (".npy", ".docs.npy")]


def split_tokens(corpus: str) -> dict[str, int]:
  """Tokens per split as the token files hold them (the offsets' last entry must agree)."""
  with open(os.path.join(corpus, "manifest.json"), encoding="utf-8") as f:
    splits = json.load(f)["splits"]
  out = {}
  for s in splits:
    n = len(np.load(os.path.join(corpus, f"{s}.npy"), mmap_mode="r"))
    end = int(np.load(os.path.join(corpus, f"{s}.docs.npy"))[-1])
    if n != end:
      raise ValueError(f"{s}.npy holds {n} tokens but its offsets end at {end}")
    out[s] = n
  return out


class _PartWriter(io.RawIOBase):
  """A write-only stream that cuts what it is given into files of at most ``part_bytes``."""

  def __init__(self, folder: str, part_bytes: int):
    self.folder, self.part_bytes, self.parts, self._f, self._n = folder, part_bytes, [], None, 0
    self._hash = hashlib.sha256()

  def writable(self):
    return True

  def write(self, b) -> int:
    b = memoryview(b)
    done = 0
    while done < len(b):
      if self._f is None or self._n >= self.part_bytes:
        self._next()
      k = min(len(b) - done, self.part_bytes - self._n)
      self._f.write(b[done : done + k])
      self._hash.update(b[done : done + k])
      self._n += k
      done += k
    return done

  def _next(self):
    if self._f is not None:
      self._f.close()
    self.parts.append(PART.format(len(self.parts)))
    self._f, self._n = open(os.path.join(self.folder, self.parts[-1]), "wb"), 0

  def close(self):
    if self._f is not None:
      self._f.close()
      self._f = None
    super().close()


def _compress(path: str, writer: _PartWriter, preset: int, log) -> None:
  """xz of ``path`` into ``writer``: the xz tool on every core where it is there (a 0.5 GB corpus takes
  minutes on one core), else Python's lzma."""
  size = os.path.getsize(path)
  if shutil.which("xz"):
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    cmd = ["xz", f"-{preset}", f"-T{threads}", "-c", path]
    log(f"ship: {' '.join(cmd)} ({size / 1e6:.1f} MB)")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
      shutil.copyfileobj(proc.stdout, writer, 1 << 20)
    if proc.returncode:
      raise RuntimeError(f"xz exited with {proc.returncode}")
    return
  log(f"ship: xz not found; compressing {size / 1e6:.1f} MB with Python's lzma on one core")
  with open(path, "rb") as src, lzma.open(writer, "wb", preset=preset) as xz:
    shutil.copyfileobj(src, xz, 1 << 20)


def pack(
  corpus: str, ship: str, part_mb: float = DEFAULT_PART_MB, preset: int = 6, log=print
) -> dict:
  """Writes ``<ship>/part-NNN.xz`` and ``<ship>/ship.json`` for the corpus in ``corpus``."""
  if part_mb <= 0:
    raise ValueError(f"--part_mb: expected > 0, got {part_mb}")
  if not os.path.exists(os.path.join(corpus, "manifest.json")):
    raise FileNotFoundError(
      f"--corpus: no manifest.json in {corpus!r} (a prepared corpus expected)"
    )
  names = corpus_files(corpus)
  tokens = split_tokens(corpus)
  os.makedirs(ship, exist_ok=True)
  for f in os.listdir(ship):
    if f.startswith("part-") or f == SHIP_JSON:
      os.remove(os.path.join(ship, f))
  files = {n: {"bytes": os.path.getsize(os.path.join(corpus, n)), "sha256": ""} for n in names}
  tar_path = os.path.join(ship, "corpus.tar")
  with tarfile.open(tar_path, "w") as tar:
    for n in names:
      files[n]["sha256"] = sha256_file(os.path.join(corpus, n))
      tar.add(os.path.join(corpus, n), arcname=n)
  writer = _PartWriter(ship, int(part_mb * 1e6))
  _compress(tar_path, writer, preset, log)
  writer.close()
  os.remove(tar_path)
  parts = [
    {
      "name": p,
      "bytes": os.path.getsize(os.path.join(ship, p)),
      "sha256": sha256_file(os.path.join(ship, p)),
    }
    for p in writer.parts
  ]
  info = {
    "parts": parts,
    "stream_sha256": writer._hash.hexdigest(),
    "files": files,
    "tokens": tokens,
  }
  with open(os.path.join(ship, SHIP_JSON), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  total = sum(p["bytes"] for p in parts)
  log(
    f"ship: {len(parts)} parts, {total / 1e6:.1f} MB xz for "
    f"{sum(v['bytes'] for v in files.values()) / 1e6:.1f} MB; tokens {tokens}"
  )
  return info


def _clear(folder: str, arg: str) -> None:
  """Empties a parts folder, refusing one that holds anything but parts and ship.json (a mistyped
  ``--into=.`` must not empty a checkout)."""
  os.makedirs(folder, exist_ok=True)
  names = os.listdir(folder)
  foreign = [
    n for n in names if not (n == SHIP_JSON or (n.startswith("part-") and n.endswith(".xz")))
  ]
  if foreign:
    raise ValueError(
      f"{arg}: {folder!r} holds other files than parts ({foreign[:3]}); name a folder of its own"
    )
  for n in names:
    os.remove(os.path.join(folder, n))


def stage(ship: str, part: int, into: str) -> str:
  """Leaves ``ship.json`` and part ``part`` (only) in ``into``; returns the part's path there."""
  with open(os.path.join(ship, SHIP_JSON), encoding="utf-8") as f:
    info = json.load(f)
  if not 0 <= part < len(info["parts"]):
    raise ValueError(f"--part: expected 0..{len(info['parts']) - 1}, got {part}")
  _clear(into, "--into")
  shutil.copy(os.path.join(ship, SHIP_JSON), into)
  name = info["parts"][part]["name"]
  shutil.copy(os.path.join(ship, name), into)
  return os.path.join(into, name)


def receive(parts: str, stage_dir: str, out: str, log=print) -> bool:
  """Keeps the parts in ``parts`` (hash-checked) in ``stage_dir``; once all are there, unpacks them into
  ``out`` and checks every file and token count. Returns whether the corpus is complete in ``out``."""
  with open(os.path.join(parts, SHIP_JSON), encoding="utf-8") as f:
    info = json.load(f)
  os.makedirs(stage_dir, exist_ok=True)
  staged = os.path.join(stage_dir, SHIP_JSON)
  if os.path.exists(staged):
    with open(staged, encoding="utf-8") as f:
      if json.load(f)["stream_sha256"] != info["stream_sha256"]:  # another corpus: start over
        _clear(stage_dir, "--stage")
  shutil.copy(os.path.join(parts, SHIP_JSON), staged)
  for p in info["parts"]:
    src = os.path.join(parts, p["name"])
    if os.path.exists(src):
      got = sha256_file(src)
      if got != p["sha256"]:
        raise ValueError(
          f"{p['name']}: sha256 {got} != {p['sha256']} (a broken transfer; send it again)"
        )
      shutil.copy(src, os.path.join(stage_dir, p["name"]))
      log(f"ship: received {p['name']} ({p['bytes'] / 1e6:.1f} MB)")
  missing = [
    p["name"] for p in info["parts"] if not os.path.exists(os.path.join(stage_dir, p["name"]))
  ]
  if missing:
    log(
      f"ship: {len(info['parts']) - len(missing)}/{len(info['parts'])} parts here; still to send: {missing}"
    )
    return False
  return unpack(stage_dir, out, info, log)


class _PartReader(io.RawIOBase):
  def __init__(self, paths: list[str]):
    self.paths, self._f, self._hash = list(paths), None, hashlib.sha256()

  def readable(self):
    return True

  def readinto(self, b) -> int:
    while True:
      if self._f is None:
        if not self.paths:
          return 0
        self._f = open(self.paths.pop(0), "rb")
      n = self._f.readinto(b)
      if n:
        self._hash.update(memoryview(b)[:n])
        return n
      self._f.close()
      self._f = None


def unpack(stage_dir: str, out: str, info: dict, log=print) -> bool:
  reader = _PartReader([os.path.join(stage_dir, p["name"]) for p in info["parts"]])
  os.makedirs(out, exist_ok=True)
  with (
    lzma.open(io.BufferedReader(reader, 1 << 20), "rb") as xz,
    tarfile.open(fileobj=xz, mode="r|") as tar,
  ):
    for m in tar:
      if m.name not in info["files"] or not m.isfile():
        raise ValueError(f"unexpected member {m.name!r} in the shipped stream")
      tmp = os.path.join(out, m.name + ".tmp")
      with tar.extractfile(m) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
      os.replace(tmp, os.path.join(out, m.name))
  if reader._hash.hexdigest() != info["stream_sha256"]:
    raise ValueError(
      "the joined parts' sha256 differs from ship.json's (a part is stale or broken)"
    )
  bad = [n for n, v in info["files"].items() if sha256_file(os.path.join(out, n)) != v["sha256"]]
  if bad:
    raise ValueError(f"files differ from the packed ones: {bad}")
  tokens = split_tokens(out)
  with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
    manifest_tokens = {s: v["tokens"] for s, v in json.load(f)["splits"].items()}
  if tokens != info["tokens"] or tokens != manifest_tokens:
    raise ValueError(
      f"token counts {tokens} differ from ship.json {info['tokens']} / manifest {manifest_tokens}"
    )
  log(f"ship: ok: {out} holds {len(info['files'])} files, hashes match; tokens {tokens}")
  return True


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python3 experiments/data/ship.py", description=__doc__.split("\n")[0]
  )
  sub = p.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("pack", help="cut a prepared corpus into xz parts + ship.json")
  a.add_argument("--corpus", required=True)
  a.add_argument("--ship", required=True, help="folder for the parts and ship.json")
  a.add_argument("--part_mb", type=float, default=DEFAULT_PART_MB)
  a.add_argument("--preset", type=int, default=6, help="xz preset (0-9)")
  s = sub.add_parser("stage", help="put ship.json and one part into a folder that travels")
  s.add_argument("--ship", required=True)
  s.add_argument("--part", type=int, required=True)
  s.add_argument("--into", required=True)
  r = sub.add_parser(
    "receive", help="(on the device) keep a part; unpack and check when all are there"
  )
  r.add_argument("--parts", required=True, help="the carried folder")
  r.add_argument("--stage", required=True, help="where the parts wait between commands")
  r.add_argument("--out", required=True, help="the corpus directory to create")
  args = p.parse_args(argv)
  try:
    if args.cmd == "pack":
      pack(args.corpus, args.ship, args.part_mb, args.preset)
    elif args.cmd == "stage":
      print(f"ship: staged {stage(args.ship, args.part, args.into)}")
    else:
      receive(args.parts, args.stage, args.out)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    print(f"ship: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
