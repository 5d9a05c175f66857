"""The code corpus (``prepare --recipe=linux_c``) on a small synthetic kernel tarball: the generated-file
rules, dedupe, long_val held out before the tokenizer is trained, parallel encoding, and shipping the
corpus in parts (experiments/data/ship.py). No network: the .deb is found in the cache."""

import io
import json
import os
import tarfile
import time

import numpy as np
import pytest

from experiments.data import corpus_files, corpus_tokenize, linux_code, prepare, ship
from experiments.data.tokenizer import BPETokenizer

NAMES = (
  "buf len dev ret priv skb page node lock flags state count queue entry ops list irq mask".split()
)


def code(seed: int, n_funcs: int, ident: str = "") -> str:
  """C-like text; ``ident`` (when given) is used all through it, so a tokenizer trained on it learns it."""
  rng = np.random.default_rng(seed)
  out = [f"// SPDX-License-Identifier: GPL-2.0\n#include <linux/{NAMES[seed % len(NAMES)]}.h>\n"]
  for k in range(n_funcs):
    a, b, c = (NAMES[i] for i in rng.integers(0, len(NAMES), 3))
    use = f"\t{ident}({a}, {b});\n" * 3 if ident else ""
    out.append(
      f"static int {a}_{b}_{k}(struct {c} *{a}, int {b})\n{{\n\tint ret = 0;\n\n"
      f"\tif (!{a})\n\t\treturn -EINVAL;\n{use}\tspin_lock(&{a}->lock);\n\t{a}->{c} = {b};\n"
      f"\tspin_unlock(&{a}->lock);\n\treturn ret;\n}}\n\n"
    )
  return "".join(out)


REG_HEADER = "".join(f"#define regFOO_{i}_BASE_IDX 0x{i:04x}\n" for i in range(300))
TABLE = (
  "static const u32 tbl[] = {\n"
  + "".join(f"\t0x{i:08x}, 0x{i * 7:08x}, 0x{i * 13:08x}, 0x{i * 31:08x},\n" for i in range(200))
  + "};\n"
)
SMALL_DEFINES = "".join(f"#define CLK_{i} {i}\n" for i in range(20))  # short: kept
LONG_IDENTS = [f"zq{a}{b}xfrob" for a in "bcdfghjk" for b in "mnp"][:12]


def tree_files() -> dict[str, str]:
  files = {f"kernel/mod_{i}.c": code(i, 6) for i in range(40)}
  files.update(
    {f"drivers/long/file_{k}.c": code(100 + k, 40, ident) for k, ident in enumerate(LONG_IDENTS)}
  )
  files["drivers/gpu/drm/amd/include/asic_reg/gc/gc_9_0_sh_mask.h"] = REG_HEADER
  files["drivers/net/wireless/rtw/table.c"] = TABLE + code(7, 1)
  files["include/dt-bindings/clock/small.h"] = SMALL_DEFINES
  files["include/linux/list.h"] = code(500, 5)
  files["tools/include/linux/list.h"] = code(500, 5)  # an identical copy: dropped, include/ kept
  files["Documentation/readme.txt"] = "not C"
  files["arch/x86/entry.S"] = "not C either"
  return files


def write_fake_package(cache: str, files: dict[str, str]) -> None:
  """What apt_tree finds: the .deb (any file) in the cache and its unpacked tree with the tarball."""
  os.makedirs(os.path.join(cache, "apt"), exist_ok=True)
  open(os.path.join(cache, "apt", f"{linux_code.PACKAGE}_6.1.0-1_all.deb"), "wb").close()
  tree = os.path.join(cache, "tree", linux_code.PACKAGE)
  os.makedirs(os.path.join(tree, "usr", "src"))
  open(os.path.join(tree, ".complete"), "w").close()
  with tarfile.open(os.path.join(tree, "usr", "src", f"{linux_code.PACKAGE}.tar.xz"), "w:xz") as t:
    for path, text in files.items():
      data = text.encode()
      info = tarfile.TarInfo(f"{linux_code.PACKAGE}/{path}")
      info.size = len(data)
      t.addfile(info, io.BytesIO(data))


KW = dict(vocab_size=600, val_fraction=0.1, long_val_docs=4, long_val_tokens=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = tmp_path_factory.mktemp("code")
  cache, out = str(root / "cache"), str(root / "out")
  write_fake_package(cache, tree_files())
  m = prepare.build(out, [linux_code.linux_c_source()], cache, log=[].append, **KW)
  return root, out, m


def test_data_lines():
  text = (
    "#define regFOO 0x1234\n#define FOO__BAR_MASK 0x0000ff00L\n#define X (1UL)\n"
    "#define Y (u32)0x5\n  0x01, 0x02, 0x03, /* c */\n{ 1, 2, 3 },\n#define BAZ -1\n\n"
    "int x = 5;\n#define BAR(x) ((x) + 1)\n#define Z BIT(3)\n\treturn 0;\n}\n"
    "0x12, 0x34, FOO\n"
  )
  assert linux_code.data_line_counts(text) == (7, 13)
  # a near-miss line of thousands of numbers fails in linear time (no backtracking over digit splits)
  near_miss = ", ".join(["123456789"] * 3000) + ", FOO\n"
  t = time.perf_counter()
  assert linux_code.data_line_counts(near_miss * 3) == (0, 3)
  assert time.perf_counter() - t < 2.0


def test_rules_and_dedupe():
  files = tree_files()
  members = [(p, t.encode()) for p, t in files.items()]
  it = linux_code.select_files(members)
  docs = []
  while True:
    try:
      docs.append(next(it))
    except StopIteration as stop:
      stats = stop.value
      break
  kept = {d["name"] for d in docs}
  c_files = [p for p in files if p.endswith((".c", ".h"))]
  assert stats["files"] == len(c_files) and stats["kept"]["files"] == len(kept) == len(c_files) - 3
  drop = stats["dropped"]
  ex = {r: [e.split(" (")[0] for e in v["examples"]] for r, v in drop.items()}
  assert ex["generated_path"] == ["drivers/gpu/drm/amd/include/asic_reg/gc/gc_9_0_sh_mask.h"]
  assert ex["data_lines"] == ["drivers/net/wireless/rtw/table.c"]
  assert ex["duplicate"] == ["tools/include/linux/list.h"]
  assert {"include/linux/list.h", "include/dt-bindings/clock/small.h"} <= kept
  assert stats["kept"]["bytes"] + sum(d["bytes"] for d in drop.values()) == stats["bytes"]
  assert linux_code.drop_reasons(members, workers=2) == linux_code.drop_reasons(members, workers=1)


def test_recipe_build_holds_long_val_out_before_the_tokenizer(built):
  _, out, m = built
  names = json.load(open(os.path.join(out, "splits.json")))
  everything = {n for s in names.values() for n in s}
  assert not any(
    "asic_reg" in n or "rtw/table.c" in n or n.startswith("linux_c/tools/") for n in everything
  )
  sel = m["sources"]["linux_c"]["selection"]
  assert sel["kept"]["files"] == m["sources"]["linux_c"]["documents"] == len(everything)
  assert {r: v["files"] for r, v in sel["dropped"].items()} == {
    "generated_path": 1,
    "data_lines": 1,
    "duplicate": 1,
  }
  long_val = names[prepare.LONG_VAL]
  assert len(long_val) == KW["long_val_docs"] and not set(long_val) & set(names["train"])
  _, off = corpus_files.load_split(out, prepare.LONG_VAL)
  assert np.all(np.diff(off) >= KW["long_val_tokens"])
  # every long file uses its own identifier all through: the tokenizer learnt the train files' ones as
  # a single token, and never saw the long_val files' ones
  tok = BPETokenizer.load(out)
  ident = {f"linux_c/drivers/long/file_{k}.c": s for k, s in enumerate(LONG_IDENTS)}
  in_train = [ident[n] for n in names["train"] if n in ident]
  assert in_train and all(len(tok.encode(s)) == 1 for s in in_train)
  assert all(len(tok.encode(ident[n])) > 1 for n in long_val)


def test_parallel_encoding_matches_one_process(built):
  _, out, _ = built
  tok = BPETokenizer.load(out)
  texts = [code(i, 3) for i in range(12)]
  one = corpus_tokenize.tokenize_documents(tok, texts, "t", [].append, batch_bytes=2000, workers=1)
  two = corpus_tokenize.tokenize_documents(tok, texts, "t", [].append, batch_bytes=2000, workers=2)
  assert (
    [e.tolist() for e in one]
    == [e.tolist() for e in two]
    == [tok.encode(t).tolist() for t in texts]
  )
  assert one[0].dtype == np.uint16


def test_ship_round_trip(built, tmp_path):
  _, out, m = built
  parts_dir, carried, stage, dest = (
    str(tmp_path / d) for d in ("parts", "carried", "stage", "dest")
  )
  info = ship.pack(out, parts_dir, part_mb=0.004, log=[].append)
  n = len(info["parts"])
  assert n >= 3 and all(p["bytes"] <= 4000 for p in info["parts"])
  assert info["tokens"] == {s: v["tokens"] for s, v in m["splits"].items()}
  for k in reversed(range(n)):  # in any order; only the last one unpacks
    ship.stage(parts_dir, k, carried)
    assert sorted(os.listdir(carried)) == sorted([ship.SHIP_JSON, info["parts"][k]["name"]])
    assert ship.receive(carried, stage, dest, log=[].append) == (k == 0)
  for f in ship.corpus_files(out):
    assert open(os.path.join(dest, f), "rb").read() == open(os.path.join(out, f), "rb").read()
  # a part damaged on the way is refused by name
  ship.stage(parts_dir, 1, carried)
  path = os.path.join(carried, info["parts"][1]["name"])
  data = bytearray(open(path, "rb").read())
  data[10] ^= 1
  open(path, "wb").write(data)
  with pytest.raises(ValueError, match=info["parts"][1]["name"]):
    ship.receive(carried, stage, dest, log=[].append)
  assert ship.main(["pack", f"--corpus={out}", f"--ship={parts_dir}", "--part_mb=0"]) == 1
  with pytest.raises(ValueError, match="--into: .* holds other files"):  # never empties a checkout
    ship.stage(parts_dir, 0, str(tmp_path))


def test_recipe_cli_checks_sources(tmp_path):
  with pytest.raises(SystemExit):
    prepare.main([f"--out={tmp_path}", "--recipe=linux_c", "--sources=linux-doc-6.1"])
  assert prepare.RECIPES["linux_c"].vocab_size == 8192
