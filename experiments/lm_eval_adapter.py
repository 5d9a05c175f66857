"""EleutherAI lm-evaluation-harness model ``kdn_jax``: a run trained here, scored on the harness's tasks.

    pip install -e '.[lm_eval]'
    kdn-lm-eval --model kdn_jax --model_args workdir=/tmp/lm --tasks wikitext,lambada_openai --batch_size 16
    python -m experiments.lm_eval_adapter --model kdn_jax ...   # the same command without the console script

lm_eval looks models up by name in its registry, which holds only the models of modules it has imported;
``kdn-lm-eval`` (and ``python -m experiments.lm_eval_adapter``) is lm_eval's own command line with this module
imported first, so every lm_eval option works as documented there. From Python::

    import lm_eval, experiments.lm_eval_adapter   # the import registers 'kdn_jax'
    lm_eval.simple_evaluate(model='kdn_jax', model_args={'workdir': '/tmp/lm'}, tasks=['wikitext'])

model_args: ``workdir`` (a run directory, or one checkpoint directory; required), ``step`` (default: the
latest), ``tokenizer`` (default: the run's corpus tokenizer.json), ``chunk`` (tokens per carried chunk;
default: the training length), ``seed`` (sampling), ``model`` (the run's name in lm_eval's results and
its ``--output_path`` folder; kdn-lm-eval sets it to ``<run>`` or ``<run>_step<N>``). ``--device`` picks
a JAX device (cpu, gpu / cuda, tpu, optionally ``:index``; lm_eval's command line passes ``cuda:0``
unless told otherwise, which runs on the CPU, with one warning line, where JAX has no GPU). A bad model
argument or option is one line (kdn-lm-eval exits with code 2), before any array is read. Every text is read as ``<|endoftext|>`` + text (the
document separator, which training saw before every document); inputs of any length are run chunk by
chunk with the recurrent state carried, never truncated. ``loglikelihood_rolling`` scores every token of a
document once with all of its context (the state carries it), not in windows.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from experiments import loading
from experiments.evaluation import request_runner

log = logging.getLogger(__name__)
DEFAULT_BATCH = 16
MODEL_ARGS = ("workdir", "step", "tokenizer", "chunk", "seed", "max_gen_toks", "model")


class SetupError(ValueError):
  """A bad model argument or lm_eval option, in one line naming it (kdn-lm-eval prints only the line)."""


def parse_device(spec: str) -> tuple[str, int]:
  """'cpu', 'gpu' / 'cuda', 'tpu', with an optional ':index' -> (JAX platform, index)."""
  name, _, index = str(spec).partition(":")
  platform = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}.get(name.lower())
  if platform is None or (index and not index.isdigit()):
    raise SetupError(
      f"device: expected cpu, gpu, cuda or tpu with an optional :index, got {spec!r}"
    )
  return platform, int(index or 0)


def check_model_args(model_args: dict) -> None:
  """One line for bad model_args, from their names and the run's directory alone (no array is read):
  kdn-lm-eval checks them before lm_eval indexes its tasks, which takes seconds."""
  unknown = sorted(set(model_args) - set(MODEL_ARGS))
  if unknown:
    hints = "".join(
      f" ({k}: did you mean {m[0]}?)"
      for k in unknown
      if (m := difflib.get_close_matches(k, MODEL_ARGS, n=1, cutoff=0.6))
    )
    raise SetupError(f"model_args: unknown {unknown}{hints}; expected {', '.join(MODEL_ARGS)}")
  if not model_args.get("workdir"):
    raise SetupError("model_args: workdir=<run directory or checkpoint> is required")
  try:
    loading.find(str(model_args["workdir"]), loading.as_step(model_args.get("step")))
  except (FileNotFoundError, ValueError) as e:
    raise SetupError(f"model_args: {e}") from None


def jax_device(spec: str | None):
  """'cpu', 'gpu' / 'cuda', 'tpu', with an optional ':index' -> that jax.Device (None: JAX's default).

  A GPU asked for where JAX has none is the CPU, with one warning line: lm_eval's command line asks for
  'cuda:0' by default, and a user who left ``--device`` out meant "the machine's accelerator, if any"."""
  import jax  # pylint: disable=g-import-not-at-top

  if spec is None or spec == "":
    return jax.devices()[0]
  platform, i = parse_device(spec)
  try:
    devices = jax.devices(platform)
  except RuntimeError:
    if platform != "gpu":
      raise SetupError(f"device: {spec!r}: JAX has no {platform} backend here") from None
    log.warning("kdn_jax: device %r: JAX has no GPU here; running on the CPU", spec)
    return jax.devices("cpu")[0]
  if i >= len(devices):
    raise SetupError(f"device: {spec!r}: index {i} is past the {len(devices)} {platform} device(s)")
  return devices[i]


def run_name(workdir: str, step=None) -> str:
  """'<run>' or '<run>_step<N>' for a run directory or one of its checkpoint directories."""
  path = os.path.normpath(os.path.abspath(str(workdir)))
  parent, base = os.path.split(path)
  if base.isdigit() and os.path.basename(parent) == "checkpoints":
    path, step = os.path.dirname(parent), base
  name = os.path.basename(path) or "run"
  return f"{name}_step{step}" if step not in (None, "") else name


def batch_rows(batch_size) -> int:
  if batch_size is None or str(batch_size).startswith("auto"):
    return DEFAULT_BATCH  # (no memory probing: one chunk's activations per row bound the memory)
  try:
    rows = int(batch_size)
  except ValueError:
    raise SetupError(
      f"batch_size: expected a positive integer or auto, got {batch_size!r}"
    ) from None
  if rows < 1:
    raise SetupError(f"batch_size: expected a positive integer or auto, got {batch_size!r}")
  return rows


def split_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids) with the continuation's ids taken from the encoding of the whole text,
  so a token that spans the boundary is scored as the model would see it; spaces at the context's end
  belong to the continuation (lm_eval's convention: context 'Q:' + continuation ' A')."""
  n = len(context) - len(context.rstrip())
  if n:
    context, continuation = context[:-n], context[-n:] + continuation
  whole = tok.encode(context + continuation).tolist()
  ctx = tok.encode(context).tolist() if context else []
  return whole[: len(ctx)], whole[len(ctx) :]


@register_model("kdn_jax")
class KdnJaxLM(LM):
  """lm_eval's LM interface over experiments.load(workdir, step)."""

  def __init__(
    self,
    workdir: str | None = None,
    step: int | None = None,
    tokenizer: str | None = None,
    chunk: int = 0,
    seed: int = 0,
    batch_size=None,
    max_batch_size=None,
    device=None,
    max_gen_toks: int = 256,
    model: str | None = None,
    **unknown,
  ):
    super().__init__()
    check_model_args({**unknown, "workdir": workdir, "step": step})
    self.name = str(model or run_name(workdir, step))
    self._device = jax_device(device)
    try:
      self.run = loading.load(str(workdir), step, tokenizer or None, device=self._device)
      # (raises, naming the argument, for runs without a text tokenizer)
      self.tok = self.run.tokenizer
    except (FileNotFoundError, ValueError) as e:
      raise SetupError(f"model_args: {e}") from None
    self.prefix = int(self.tok.eos_id)
    chunk = int(chunk) or int(self.run.config.data.seq_len)
    self.runner = request_runner.RequestRunner(
      self.run.model, chunk, batch_rows(batch_size), self.prefix
    )
    self.seed, self.max_gen_toks = int(seed), int(max_gen_toks)
    log.info(
      "kdn_jax: %s: %s (step %d) on %s, chunk %d, batch %d",
      self.name,
      self.run.checkpoint,
      self.run.step,
      self._device,
      chunk,
      self.runner.batch,
    )

  def _in_context(self, fn, *args, **kw):
    import jax  # pylint: disable=g-import-not-at-top

    with jax.default_device(self._device):  # (the run's kernel configs are in its model)
      return fn(*args, **kw)

  # ------------------------------------------------------------------------------------- lm_eval API
  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    seqs, scored, where, out = [], [], [], [(0.0, True)] * len(requests)
    for k, req in enumerate(requests):
      context, continuation = req.args
      ctx, cont = split_pair(self.tok, context, continuation)
      if cont:  # an empty continuation has probability 1
        seqs.append(np.asarray([self.prefix] + ctx + cont, np.int32))
        scored.append(len(cont))
        where.append(k)
    res = self._in_context(
      self.runner.score, seqs, scored, on_batch=self._bar(len(seqs), disable_tqdm)
    )
    for k, r in zip(where, res):
      out[k] = r
    for req, r in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood", req.args, r)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    seqs, where, out = [], [], [0.0] * len(requests)
    for k, req in enumerate(requests):
      ids = self.tok.encode(req.args[0]).tolist()
      if ids:
        seqs.append(np.asarray([self.prefix] + ids, np.int32))
        where.append(k)
    res = self._in_context(
      self.runner.score,
      seqs,
      [len(s) - 1 for s in seqs],
      on_batch=self._bar(len(seqs), disable_tqdm),
    )
    for k, (lp, _) in zip(where, res):
      out[k] = lp
    for req, lp in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, lp)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups: dict = {}
    for k, req in enumerate(requests):
      context, kw = req.args
      opts = self._gen_options(dict(kw or {}))
      groups.setdefault(repr(sorted((n, v) for n, v in opts.items() if n != "until")), []).append(
        (k, opts)
      )
    out: list = [None] * len(requests)
    bar = self._bar(len(requests), disable_tqdm)
    for members in groups.values():
      opts = members[0][1]
      prompts = [
        np.asarray([self.prefix] + self.tok.encode(requests[k].args[0]).tolist(), np.int32)
        for k, _ in members
      ]
      stops = [o["until"] for _, o in members]

      def stop(i, ids, stops=stops):
        return ids[-1] == self.prefix or any(u in self.tok.decode(ids) for u in stops[i])

      gen = self._in_context(
        self.runner.generate,
        prompts,
        opts["max_gen_toks"],
        stop,
        temperature=opts["temperature"],
        top_k=opts["top_k"],
        seed=self.seed,
        on_batch=bar,
      )
      for (k, o), ids in zip(members, gen):
        out[k] = self._trim(ids, o["until"])
        self.cache_hook.add_partial("generate_until", requests[k].args, out[k])
    return out

  # ---------------------------------------------------------------------------------------- helpers
  def _gen_options(self, kw: dict) -> dict:
    until = kw.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    do_sample = bool(kw.pop("do_sample", False))
    temperature = float(kw.pop("temperature", 0.0) or 0.0)
    top_k = kw.pop("top_k", None)
    max_gen = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks)))
    kw.pop("top_p", None) if not do_sample else None
    if kw:
      raise ValueError(
        f"generate_until: unsupported generation arguments {sorted(kw)}; supported: until, "
        "max_gen_toks, do_sample, temperature, top_k"
      )
    if not do_sample:
      temperature = 0.0
    return {
      "until": until,
      "max_gen_toks": max_gen,
      "temperature": temperature,
      "top_k": None if top_k in (None, 0) else int(top_k),
    }

  def _trim(self, ids: list[int], until: list[str]) -> str:
    if ids and ids[-1] == self.prefix:
      ids = ids[:-1]
    text = self.tok.decode(ids)
    cut = min((text.find(u) for u in until if u and u in text), default=len(text))
    return text[:cut]

  def _bar(self, total: int, disable: bool):
    if disable or not total:
      return None
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top  (an lm_eval dependency)

    bar = tqdm(total=total, desc="kdn_jax", file=sys.stderr)
    return lambda n: bar.update(n) and None

  @property
  def tokenizer_name(self) -> str:
    return self.run.tokenizer_path or ""


def main():
  """lm_eval's command line with the ``kdn_jax`` model registered (the console script kdn-lm-eval).

  Two things on top of lm_eval's own: the run gets a name (``model=``, which lm_eval names its output
  folder after; it would otherwise pick a random one), and a bad model argument or option is one line
  and exit code 2 rather than a traceback."""
  from lm_eval._cli import HarnessCLI  # pylint: disable=g-import-not-at-top
  from lm_eval.utils import setup_logging  # pylint: disable=g-import-not-at-top

  setup_logging()
  parser = HarnessCLI()
  args = parser.parse_args()
  model_args = getattr(args, "model_args", None)
  try:
    if getattr(args, "model", None) == "kdn_jax" and isinstance(model_args, dict):
      check_model_args(model_args)
      if getattr(args, "device", None):
        parse_device(args.device)
      model_args.setdefault("model", run_name(model_args["workdir"], model_args.get("step")))
    parser.execute(args)
  except SetupError as e:
    print(f"kdn-lm-eval: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  main()
