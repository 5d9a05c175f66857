"""The evaluation suites. Each takes an :class:`Context` (the restored run, its scorer and the settings)
and returns a JSON-ready dict that records its own settings beside its numbers.

  ppl           perplexity on the run's validation split (packed documents, normal initial state)
  position_ppl  PPL(t) up to ``max_len`` on long documents, chunked with the state carried; also the
                state statistics over time (``state_stats``) from the same pass
  effrem        EffRem_T(t) at T = 4x the training length (docs/math.md section 7)
  state_stats   memory / variance statistics per layer at chunk ends over a long input
  beta_eff      KDN write-strength distribution per layer (KDN layers only)
  retrieval     the run's retrieval task grids (MQAR / copy / passkey runs: their task over longer
                lengths; corpus LMs: S-NIAH-1/2/3)
  topic_floor   topic-source runs: excess NLL over the exact Bayes floor by position up to
                ``max_len`` (chunked, state carried), bootstrap intervals over documents and the
                length verdict (experiments/evaluation/topic_floor.py); also the state
                statistics of the same pass
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from experiments.data import pipeline, retrieval, token_files, topic_source
from experiments.data.tokenizer import BPETokenizer
from experiments.evaluation import bootstrap, long_context, plots, probes
from experiments.evaluation import topic_floor as floor_lib
from experiments.loading import LoadedRun

SUITES = ("ppl", "position_ppl", "effrem", "state_stats", "beta_eff", "retrieval", "topic_floor")
TOPIC_ONLY = ("topic_floor",)  # suites of runs trained on the topic source only
LM_DEFAULT = ("ppl", "position_ppl", "effrem", "beta_eff", "retrieval")
SYNTHETIC_DEFAULT = ("retrieval", "state_stats", "beta_eff")
TOPIC_DEFAULT = ("ppl", "topic_floor", "beta_eff")
SYNTHETIC_TASK = {"mqar": "mqar", "copying": "copy", "passkey": "passkey"}


@dataclasses.dataclass
class Settings:
  # position_ppl / state_stats / topic_floor length; 0: max(32768, 8 x training length), topic
  # runs max(8192, 128 x training length)
  max_len: int = 0
  chunk: int = 0  # tokens per carried chunk; 0: the training length
  num_sequences: int = 16  # long sequences for position_ppl / state_stats
  effrem_len: int = 0  # 0: 4 x training length
  effrem_points: int = 33
  effrem_sequences: int = 8
  batch: int = 8  # rows per forward (effrem, retrieval, beta_eff)
  probe_batches: int = 2  # validation batches probed for beta_eff
  retrieval_lengths: tuple = ()  # (): training length x 1, 2, 4, 8
  retrieval_examples: int = 32
  long_eval_path: str = ""  # overrides the run's data.long_eval_path
  tokenizer: str = ""  # overrides the run's corpus tokenizer
  seed: int = 0
  documents: int = floor_lib.DEFAULT_DOCS  # topic_floor: evaluation documents (bootstrap units)
  resamples: int = bootstrap.RESAMPLES  # topic_floor / position_ppl: bootstrap resamples


@dataclasses.dataclass
class Context:
  run: LoadedRun
  scorer: long_context.ChunkedScorer
  settings: Settings

  @property
  def data(self):
    return self.run.config.data

  @property
  def train_len(self) -> int:
    return int(self.data.seq_len)

  @property
  def is_lm(self) -> bool:
    return self.data.kind == "token_file"

  @property
  def is_topic(self) -> bool:
    return self.data.kind == "topic"

  @property
  def max_len(self) -> int:
    if self.is_topic:
      return self.settings.max_len or max(floor_lib.LATE[1], 128 * self.train_len)
    return self.settings.max_len or max(32768, 8 * self.train_len)

  def topic_source(self) -> topic_source.TopicSource:
    return topic_source.TopicSource(topic_source.params_from_config(self.data.topic))

  @property
  def chunk(self) -> int:
    return self.settings.chunk or self.train_len

  def long_eval(self) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document offsets) of the long-evaluation documents."""
    path = self.settings.long_eval_path or self.data.get("long_eval_path", "")
    if not path:
      raise ValueError(
        "--long_eval_path: the run has no data.long_eval_path (a corpus long_eval.npy or any "
        "token file with document boundaries)"
      )
    tokens = token_files.load_tokens(path)
    off = token_files.load_offsets(path, tokens, int(self.data.eos_id))
    if off is None:
      raise ValueError(
        f"--long_eval_path: {path!r} has no document boundaries (.docs.npy sidecar or data.eos_id)"
      )
    return tokens, off

  def data_label(self) -> str:
    """What the long sequences are drawn from, for titles: the long-eval token file, the topic
    source, or the run's task."""
    if self.is_lm:
      return self.settings.long_eval_path or self.data.get("long_eval_path", "")
    return "the topic source" if self.is_topic else f"{self.data.kind} examples"

  def bos(self):
    return int(self.data.eos_id) if int(self.data.eos_id) >= 0 else None

  def tokenizer(self) -> BPETokenizer:
    try:
      return self.run.tokenizer
    except (ValueError, FileNotFoundError) as e:
      raise ValueError(f"--{e} (S-NIAH needs the text tokenizer)") from e

  def long_sequences(self, length: int, n: int) -> np.ndarray:
    """[n', length + 1] token windows: long-eval documents (LM runs) or the run's task at ``length``."""
    if self.is_lm:  # spread over the documents from the seed (the bootstrap units)
      tokens, off = self.long_eval()
      return long_context.spread_windows(tokens, off, length, self.bos(), n, self.settings.seed)[0]
    if self.is_topic:  # [BOS, x_0 .. x_{length-1}] of evaluation documents
      src = self.topic_source()
      docs = floor_lib.evaluation_documents(src, n, length, self.settings.seed)
      inputs, targets = floor_lib.model_view(src, docs)
      return np.concatenate([inputs, targets[:, -1:]], axis=1)
    fn = retrieval.example_fn(
      *self._task_cell(length), seed=self.settings.seed + 7, **self.task_kw()
    )
    exs = [fn(i) for i in range(n)]
    return np.stack([np.concatenate([e["inputs"], e["targets"][-1:]]) for e in exs])

  def task_kw(self) -> dict:
    """The run's synthetic-task generator arguments (vocabulary, ...)."""
    kind = self.data.kind
    if kind == "mqar":
      return {
        "vocab_size": int(self.data.mqar.vocab_size),
        "power_a": float(self.data.mqar.power_a),
      }
    if kind == "copying":
      return {"vocab_size": int(self.data.copying.vocab_size)}
    return {
      "vocab_size": int(self.data.passkey.vocab_size),
      "digits": int(self.data.passkey.digits),
    }

  def _task_cell(self, length):
    task = SYNTHETIC_TASK[self.data.kind]
    point = {"mqar": int(self.data.mqar.num_kv_pairs), "copy": None, "passkey": 0.5}[task]
    return task, length, point


def default_suites(ctx: Context) -> tuple[str, ...]:
  """By the run's data, less :func:`default_skips`."""
  if ctx.is_topic:
    return TOPIC_DEFAULT
  skips = default_skips(ctx)
  return tuple(s for s in (LM_DEFAULT if ctx.is_lm else SYNTHETIC_DEFAULT) if s not in skips)


def default_skips(ctx: Context) -> dict[str, str]:
  """{suite: why} for the default suites that cannot run on this run (named with --suite, they raise)."""
  if ctx.is_lm and not ctx.is_topic and not ctx.run.has_tokenizer:
    return {
      "retrieval": f"S-NIAH needs the corpus tokenizer, and the run has none "
      f"({ctx.run.tokenizer_path or 'no data.corpus_dir'}; --tokenizer= names one)"
    }
  return {}


def check(ctx: Context, suites) -> None:
  """Every reason a requested suite cannot run, raised before any long work."""
  s = ctx.settings
  unknown = [x for x in suites if x not in SUITES]
  if unknown:
    raise ValueError(f"--suite: unknown suite(s) {unknown}; expected names from {list(SUITES)}")
  if s.max_len and s.max_len < ctx.train_len:
    raise ValueError(f"--max_len: {s.max_len} is shorter than the training length {ctx.train_len}")
  if ctx.is_lm and ({"position_ppl", "state_stats", "effrem"} & set(suites)):
    tokens, off = ctx.long_eval()
    longest = int(np.max(np.diff(off)))
    need = (
      max(
        ctx.max_len if {"position_ppl", "state_stats"} & set(suites) else 0,
        (s.effrem_len or 4 * ctx.train_len) if "effrem" in suites else 0,
      )
      + 1
    )
    if longest < need:
      raise ValueError(
        f"--max_len: the longest long-eval document has {longest} tokens, fewer than the "
        f"{need} this evaluation needs; lower --max_len / --effrem_len or use longer documents"
      )
  if not (ctx.is_lm or ctx.is_topic) and {"ppl", "position_ppl", "effrem"} & set(suites):
    raise ValueError(
      f"--suite: ppl, position_ppl and effrem need a language-model run (data.kind="
      f'"token_file" or "topic"); this run trained on {ctx.data.kind!r}'
    )
  if "topic_floor" in suites:
    if not ctx.is_topic:
      raise ValueError(
        f"--suite: topic_floor needs a run trained on the topic source "
        f'(data.kind="topic"); this run trained on {ctx.data.kind!r}'
      )
    if ctx.max_len < floor_lib.LATE[1]:
      raise ValueError(
        f"--max_len: topic_floor reads positions up to {floor_lib.LATE[1]}; got {ctx.max_len}"
      )
    if s.documents < 2:
      raise ValueError(
        f"--documents: topic_floor needs >= 2 documents for its intervals, got {s.documents}"
      )
  if ctx.is_topic and {"position_ppl", "state_stats", "effrem", "topic_floor"} & set(suites):
    need = max(ctx.max_len, s.effrem_len or 4 * ctx.train_len)
    if need > int(ctx.data.topic.doc_len):
      raise ValueError(
        f"--max_len: {need} positions exceed the topic documents "
        f"(data.topic.doc_len={ctx.data.topic.doc_len})"
      )
  if ctx.is_topic and "retrieval" in suites:
    raise ValueError("--suite: retrieval has no task for topic-source runs; use topic_floor")
  if "retrieval" in suites:
    retrieval_cells(ctx, dry_run=True)


# ------------------------------------------------------------------------------------------ suites
def ppl(ctx: Context) -> dict:
  batches = pipeline.make_eval_batches(ctx.run.config)
  nll_sum, count = 0.0, 0.0
  for b in batches:
    nll, _ = ctx.scorer.one_shot(b["inputs"], b["targets"], b.get("segment_ids"))
    nll_sum += float(np.sum(nll * b["mask"]))
    count += float(np.sum(b["mask"]))
  loss = nll_sum / max(count, 1.0)
  return {
    "loss": loss,
    "perplexity": float(np.exp(loss)),
    "tokens": int(count),
    "batches": len(batches),
    "seq_len": ctx.train_len,
    "eval_path": ctx.data.eval_path or ctx.data.train_path,
  }


def examples_hash(examples) -> str:
  """Which examples an evaluation scored: runs whose suites carry the same hash were measured on
  the same units, so their differences pair (experiments.compare)."""
  a = np.ascontiguousarray(np.asarray(examples))
  return hashlib.sha256(str(a.shape).encode() + a.astype(np.int64).tobytes()).hexdigest()[:16]


def _long_pass(ctx: Context, length: int, with_nll: bool) -> tuple[np.ndarray, list, np.ndarray]:
  seqs = ctx.long_sequences(length, ctx.settings.num_sequences)
  series = []

  def on_chunk(t_end, cache):
    series.append({"t": int(t_end), "layers": probes.state_stats(cache)})

  on_chunk(0, ctx.run.model.init_cache(len(seqs), length))  # the normal initial state
  progress = f"{'position_ppl' if with_nll else 'state_stats'} ({len(seqs)} x {length})"
  if not with_nll and ctx.run.model.has_prefix_states():
    # states only: read at the chunk ends from longer forwards, no logits (the same series)
    ctx.scorer.state_series(seqs[:, :-1], ctx.chunk, on_chunk, progress=progress)
    return None, series, seqs
  nll, _ = ctx.scorer.score(
    seqs[:, :-1], seqs[:, 1:], ctx.chunk, on_chunk=on_chunk, progress=progress
  )
  return nll, series, seqs


def _state_result(ctx, series, n, length) -> dict:
  return {
    "series": series,
    "chunk": ctx.chunk,
    "sequences": n,
    "length": length,
    "train_len": ctx.train_len,
  }


def position_ppl(ctx: Context) -> tuple[dict, dict, np.ndarray]:
  """Returns (position_ppl result, state_stats result, mean NLL per position [max_len])."""
  L = ctx.max_len
  nll, series, seqs = _long_pass(ctx, L, True)
  n = len(seqs)
  per_pos = nll.mean(axis=0).astype(np.float64)
  edges = long_context.position_buckets(L)
  centers, bppl = [], []
  for a, b in zip(edges[:-1], edges[1:]):
    centers.append(float(0.5 * (a + b - 1)) + 1.0)  # 1-based positions for the log axis
    bppl.append(float(np.exp(per_pos[a:b].mean())))
  centers, bppl = np.asarray(centers), np.asarray(bppl)
  # p*: the best bucket inside the training range, skipping its first eighth (little context, few
  # positions per bucket: noise, not length behaviour)
  inside = (centers <= ctx.train_len) & (centers >= ctx.train_len / 8)
  p_star = t_star = generalises_to = log_se = None
  if inside.any():
    i_star = int(np.argmin(np.where(inside, bppl, np.inf)))
    p_star, t_star = float(bppl[i_star]), float(centers[i_star])
    # the spread of that bucket's mean log-PPL over the sequences: p* is the minimum of such noisy
    # means, so it sits below the true bucket perplexity by about this much
    per_seq = nll[:, edges[i_star] : edges[i_star + 1]].mean(axis=1).astype(np.float64)
    log_se = (
      float(per_seq.std(ddof=1) / np.sqrt(len(per_seq))) if len(per_seq) > 1 else float("nan")
    )
    above = np.flatnonzero((centers >= t_star) & (bppl > p_star * (1 + 1e-9)))
    generalises_to = float(centers[above[0] - 1]) if len(above) else float(L)
  res = {
    "max_len": L,
    "sequences": n,
    "examples_hash": examples_hash(seqs),
    "data": ctx.data_label(),
    "chunk": ctx.chunk,
    "train_len": ctx.train_len,
    "perplexity": float(np.exp(per_pos.mean())),
    "bucket_edges": edges.tolist(),
    "bucket_center": centers.tolist(),
    "bucket_ppl": bppl.tolist(),
    "p_star": p_star,
    "t_star": t_star,
    "p_star_log_se": log_se,
    "p_star_buckets": int(inside.sum()),
    "generalises_to": generalises_to,
    "ppl_at": {
      str(t): float(np.exp(per_pos[max(0, t // 2) : t].mean()))
      for t in doubling_lengths(ctx.train_len, L)
    },
  }
  res.update(position_intervals(nll, edges, ctx.train_len, ctx.settings))
  return res, _state_result(ctx, series, n, L), per_pos


def doubling_lengths(train_len: int, max_len: int) -> list[int]:
  """T, 2T, 4T, ... up to max_len, and max_len itself: the ends of the bands [t/2, t) of ppl_at."""
  out, t = [], train_len
  while t < max_len:
    out.append(t)
    t *= 2
  return out + [max_len]


def position_intervals(nll, edges, train_len: int, settings: Settings) -> dict:
  """Bootstrap intervals over the windows (the units) of the bucket perplexities and of the ratio
  PPL@L / PPL@T, each PPL@t = exp(mean NLL over positions [t/2, t)) as in ``ppl_at``, L the
  evaluated length: the ratio is exp of the paired difference of the two ranges' mean NLL."""
  nll = np.asarray(nll, np.float64)
  L, kw = nll.shape[1], {"resamples": settings.resamples, "seed": settings.seed}
  per_window = np.stack([nll[:, a:b].mean(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
  buckets = bootstrap.mean(per_window, **kw)
  early = nll[:, max(0, train_len // 2) : train_len].mean(axis=1)
  late = nll[:, L // 2 : L].mean(axis=1)
  diff = bootstrap.paired_difference(late, early, **kw)
  return {
    # the bootstrap units, for intervals of differences between runs (experiments.compare)
    "bucket_nll_per_sequence": per_window.tolist(),
    "bucket_ppl_lo": np.exp(buckets.lo).tolist(),
    "bucket_ppl_hi": np.exp(buckets.hi).tolist(),
    "ratio": {
      "long_len": L,
      "train_len": train_len,
      "estimate": float(np.exp(diff.estimate)),
      "lo": float(np.exp(diff.lo)),
      "hi": float(np.exp(diff.hi)),
      "level": diff.level,
      "resamples": diff.resamples,
      "units": diff.units,
    },
  }


def state_stats(ctx: Context) -> dict:
  L = ctx.max_len if ctx.is_lm or ctx.is_topic else 8 * ctx.train_len
  _, series, seqs = _long_pass(ctx, L, False)
  n = len(seqs)
  return _state_result(ctx, series, n, L)


def effrem(ctx: Context) -> dict:
  s = ctx.settings
  T = s.effrem_len or 4 * ctx.train_len
  seqs = ctx.long_sequences(T, s.effrem_sequences)[:, :-1]
  ts = long_context.effrem_grid(T, s.effrem_points)
  vals = long_context.effective_remembrance(
    ctx.scorer, seqs, ts, batch=s.batch, progress=f"effrem ({len(seqs)} x {len(ts)} cuts, T={T})"
  )
  return {
    "T": T,
    "train_len": ctx.train_len,
    "sequences": len(seqs),
    "examples_hash": examples_hash(seqs),
    "t": ts.tolist(),
    "mean": vals.mean(0).tolist(),
    "std": vals.std(0).tolist(),
    "per_sequence": vals.tolist(),
  }


def beta_eff(ctx: Context) -> dict:
  batches = (
    pipeline.make_eval_batches(ctx.run.config)[: ctx.settings.probe_batches]
    if ctx.is_lm or ctx.is_topic
    else [{"inputs": w[:, :-1]} for w in [ctx.long_sequences(ctx.train_len, ctx.settings.batch)]]
  )
  acc: dict[int, list] = {}
  for b in batches:
    for i, v in probes.write_strengths(ctx.run.model, b["inputs"], b.get("segment_ids")).items():
      acc.setdefault(i, []).append(v)
  if not acc:
    return {"skipped": "no KDN layers in this model"}
  res = probes.beta_summary({i: np.concatenate(v) for i, v in acc.items()})
  res.update(seq_len=ctx.train_len, sequences=int(sum(len(b["inputs"]) for b in batches)))
  return res


def topic_floor(ctx: Context) -> tuple[dict, dict]:
  """Returns (topic_floor result, state_stats result of the same pass)."""
  s, length = ctx.settings, ctx.max_len
  src = ctx.topic_source()
  docs = floor_lib.evaluation_documents(src, s.documents, length, s.seed)
  inputs, targets = floor_lib.model_view(src, docs)
  series = []

  def on_chunk(t_end, cache):
    series.append({"t": int(t_end), "layers": probes.state_stats(cache)})

  on_chunk(0, ctx.run.model.init_cache(len(docs), length))  # the normal initial state
  nll, _ = ctx.scorer.score(
    inputs, targets, ctx.chunk, on_chunk=on_chunk, progress=f"topic_floor ({len(docs)} x {length})"
  )
  res = floor_lib.analyse(
    nll, src.bayes_nll(docs), ctx.train_len, seed=s.seed, resamples=s.resamples
  )
  res.update(
    chunk=ctx.chunk,
    seed=s.seed,
    source=ctx.data.topic.to_dict(),
    examples_hash=examples_hash(inputs),
    data=ctx.data_label(),
  )
  return res, _state_result(ctx, series, len(docs), length)


def retrieval_cells(ctx: Context, dry_run: bool = False) -> dict:
  """{task: cells} of the run's retrieval grids; ``dry_run`` only validates them (no examples)."""
  s = ctx.settings
  lengths = list(s.retrieval_lengths) or [ctx.train_len * f for f in (1, 2, 4, 8)]
  n = 1 if dry_run else s.retrieval_examples
  if ctx.is_lm:
    tok = ctx.tokenizer()
    # corpus-text haystack: the validation split (documents the model never trained on)
    hay = np.asarray(token_files.load_tokens(ctx.data.eval_path or ctx.data.train_path))
    shortest = max(retrieval.min_length(t, 0.0, tokenizer=tok) for t in ("snih1", "snih2", "snih3"))
    lengths = [x for x in lengths if x >= shortest] or [shortest]
    specs = {"snih1": {}, "snih2": {"haystack_tokens": hay}, "snih3": {"haystack_tokens": hay}}
    out = {
      t: retrieval.grid(t, lengths, None, n, s.seed, tokenizer=tok, **kw) for t, kw in specs.items()
    }
  else:
    task = SYNTHETIC_TASK[ctx.data.kind]
    kw = ctx.task_kw()
    if task == "mqar":
      base = int(ctx.data.mqar.num_kv_pairs)
      points = [
        p for p in (base, 2 * base, 4 * base) if p < kw["vocab_size"] // 2 - 1
      ]  # distinct keys
      cells = []
      for p in points:
        ok = [x for x in lengths if x >= retrieval.min_length("mqar", p, **kw)]
        if ok:
          cells += retrieval.grid("mqar", ok, [p], n, s.seed, **kw)
      out = {"mqar": cells}
    else:
      out = {task: retrieval.grid(task, lengths, None, n, s.seed, **kw)}
  return out


def run_retrieval(ctx: Context, gate: bool = False) -> dict:
  """Scores the retrieval grids. ``gate`` (the default LM suites): a task whose every cell at its shortest
  length scores 0 is not scored at the longer lengths, and the result says so (``skipped``)."""
  tasks = retrieval_cells(ctx)
  res, skipped = {}, {}
  for task, cells in tasks.items():
    rows, metric = [], plots.METRIC[task]
    shortest = min(c["length"] for c in cells)
    for c in cells:
      if (
        gate
        and c["length"] > shortest
        and not any(r[metric] > 0 for r in rows if r["length"] == shortest)
      ):
        skipped[task] = (
          f"{metric.replace('_', ' ')} 0 at every cell of the shortest length {shortest}: "
          f"lengths {sorted({x['length'] for x in cells if x['length'] > shortest})} not scored "
          "(a model that retrieves nothing there scores 0 beyond it); --suite=retrieval scores "
          "the whole grid"
        )
        print(f"  retrieval {task}: skipped the longer lengths: {skipped[task]}", flush=True)
        break
      ex = c["examples"]
      correct = _correct(ctx, ex)
      sc = retrieval.score(correct, ex["mask"])
      rows.append(
        {
          "task": task,
          "length": c["length"],
          "axis": c["axis"],
          c["axis"]: c[c["axis"]],
          "exact_match": sc["exact_match"],
          "token_accuracy": sc["token_accuracy"],
          "num_examples": sc["num_examples"],
          "train_len": ctx.train_len,
        }
      )
      print(
        f"  retrieval {task} length {c['length']} {c['axis']} {c[c['axis']]}: exact match "
        f"{sc['exact_match']:.3f}, token accuracy {sc['token_accuracy']:.3f}",
        flush=True,
      )
    res[task] = rows
  out = {
    "tasks": res,
    "examples_per_cell": ctx.settings.retrieval_examples,
    "seed": ctx.settings.seed,
    "train_len": ctx.train_len,
  }
  if skipped:
    out["skipped"] = skipped
  return out


def _correct(ctx: Context, ex: dict) -> np.ndarray:
  """Argmax-correct [N, T] over batches of rows; chunked with carried state past 4x the chunk."""
  b = ctx.settings.batch
  inputs, targets = ex["inputs"], ex["targets"]
  out = []
  for s in range(0, len(inputs), b):
    x, y = inputs[s : s + b], targets[s : s + b]
    if x.shape[1] <= 4 * ctx.chunk:
      _, c = ctx.scorer.one_shot(x, y)
    else:
      _, c = ctx.scorer.score(x, y, ctx.chunk)
    out.append(c)
  return np.concatenate(out)


def write_npy(path: str, arr: np.ndarray):
  tmp = f"{path}.tmp.npy"
  np.save(tmp, arr)
  os.replace(tmp, path)
