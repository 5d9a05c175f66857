"""R lazy-load data (an R package's ``data/*.rdx`` + ``*.rdb``) read with the rdata package, and
hard-wrapped lines joined into paragraphs."""

from __future__ import annotations

import struct
import zlib

from experiments.data.corpus_fetch import SourceUnavailable
from experiments.data.text_formats.common import tidy


def _rdata():
  try:
    import rdata  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SourceUnavailable(
      "the rdata package is not installed (pip install -e '.[corpus]')"
    ) from e
  return rdata


def _r_object(serialized: bytes):
  rdata = _rdata()
  import warnings  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS"
    return rdata.conversion.convert(rdata.parser.parse_data(serialized, extension=".rds"))


def _unpack_rdb_blob(blob: bytes, compressed) -> bytes:
  """A blob of an R lazy-load database: 4-byte big-endian uncompressed length, then (type 1) zlib data,
  or (types 2/3) a type byte ``Z``/``2``/``X``/``0`` and zlib/bzip2/xz/raw data."""
  n = struct.unpack(">I", blob[:4])[0]
  if compressed in (2, 3):
    kind, payload = blob[4:5], blob[5:]
    if kind == b"Z":
      out = zlib.decompress(payload)
    elif kind == b"2":
      import bz2  # pylint: disable=g-import-not-at-top

      out = bz2.decompress(payload)
    elif kind == b"X":
      import lzma  # pylint: disable=g-import-not-at-top

      out = lzma.decompress(payload)
    else:
      out = payload
  elif compressed:
    out = zlib.decompress(blob[4:])
  else:
    return blob
  if len(out) != n:
    raise ValueError(f"lazy-load blob: {len(out)} bytes, header says {n}")
  return out


def read_lazyload_db(rdx_path: str, rdb_path: str) -> dict:
  """Objects of an R lazy-load database (``<name>.rdx`` index + ``<name>.rdb`` blobs), read with rdata:
  the .rdx is an RDS file holding ``list(variables = list(name = c(offset, length)), references,
  compressed)``; each variable is a serialized object at that offset of the .rdb."""
  rdata = _rdata()
  import warnings  # pylint: disable=g-import-not-at-top

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    index = rdata.conversion.convert(rdata.parser.parse_file(rdx_path))
  compressed = index.get("compressed", True)
  compressed = int(compressed[0]) if hasattr(compressed, "__len__") else int(compressed)
  with open(rdb_path, "rb") as f:
    rdb = f.read()
  out = {}
  for name, (off, length) in index["variables"].items():
    off, length = int(off), int(length)
    out[str(name)] = _r_object(_unpack_rdb_blob(rdb[off : off + length], compressed))
  return out


def unwrap_lines(lines) -> str:
  """Hard-wrapped lines (a novel as a character vector, one line each) to paragraphs: lines of a paragraph
  joined with spaces, blank lines between paragraphs."""
  paras, cur = [], []
  for line in lines:
    line = str(line).strip()
    if line:
      cur.append(line)
    elif cur:
      paras.append(" ".join(cur))
      cur = []
  if cur:
    paras.append(" ".join(cur))
  return tidy("\n\n".join(paras))
