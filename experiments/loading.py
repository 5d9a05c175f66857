"""Loads a trained run in one call: its model (parameters of one checkpoint, on one device), its config
and, for runs trained on a prepared text corpus, its tokenizer.

    import experiments
    run = experiments.load('/tmp/lm')                      # a workdir: its latest checkpoint
    run = experiments.load('/tmp/lm/checkpoints/2000')     # one step directory
    run = experiments.load('/tmp/lm', step=1000)
    logits, _ = run.model(tokens)                          # tokens [B, T] int32 -> [B, T, vocab]
    ids = run.tokenizer.encode('Some text')                # the corpus BPE (text runs only)

Every problem (no checkpoint, a missing step, a checkpoint whose parameters do not fit the model its
config builds, a tokenizer that does not fit the model) raises one line naming the argument, before any
array is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import os

import ml_collections

from experiments import kernel_config, schema
from experiments.data import corpus
from experiments.data.tokenizer import BPETokenizer
from experiments.runner import checkpoint as ckpt_lib
from kdn_jax.layers.options import option


@dataclasses.dataclass
class LoadedRun:
  """A restored run. ``tokenizer`` is read on first use and raises when the run has none."""

  workdir: str
  config: ml_collections.ConfigDict
  model: object  # an NNX module (kdn_jax.models.lm.LanguageModel for the runner's runs)
  step: int
  checkpoint: str  # the step directory the parameters came from
  tokenizer_path: (
    str | None
  )  # tokenizer.json: the override given to load, else the run's corpus one

  @functools.cached_property
  def tokenizer(self) -> BPETokenizer:
    if not self.tokenizer_path:
      raise ValueError(
        f"tokenizer: the run trained on {self.config.data.kind!r} data, not on a prepared text "
        "corpus (config.data.corpus_dir), so it has no text tokenizer; pass tokenizer=<path "
        "to tokenizer.json>"
      )
    if not os.path.exists(self.tokenizer_path):
      raise FileNotFoundError(
        f"tokenizer: {self.tokenizer_path!r} does not exist (the run's corpus moved or "
        "was deleted?); pass tokenizer=<path to tokenizer.json>"
      )
    tok = BPETokenizer.load(self.tokenizer_path)
    vocab = int(self.config.model.vocab_size)
    if tok.vocab_size > vocab:
      raise ValueError(
        f"tokenizer: {self.tokenizer_path!r} has {tok.vocab_size} tokens, more than the "
        f"model's vocabulary ({vocab}); it is not the tokenizer this run trained with"
      )
    return tok

  @property
  def has_tokenizer(self) -> bool:
    return bool(self.tokenizer_path) and os.path.exists(self.tokenizer_path)


def _config_from(record: dict, workdir: str) -> ml_collections.ConfigDict:
  cfg = record.get("config")
  if cfg is None:
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
      raise FileNotFoundError(
        f"workdir: {workdir!r} has no run config (config.json or a checkpoint record "
        "with one); was it written by experiments.train?"
      )
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
  return ml_collections.ConfigDict(cfg)


def find(workdir: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoints directory, step) of ``workdir`` (a run directory, its checkpoints directory or one
  step directory); ``step`` None = the latest (or the step directory's)."""
  try:
    root, latest = ckpt_lib.find_checkpoint(workdir)
  except FileNotFoundError as e:
    raise FileNotFoundError(f"workdir: {e}") from e
  named = os.path.basename(os.path.abspath(workdir).rstrip("/"))
  if (
    named.isdigit()
    and os.path.dirname(os.path.abspath(workdir)) == root
    and step not in (None, latest)
  ):
    raise ValueError(f"step: {step} differs from the step directory given as workdir ({workdir!r})")
  if step is None:
    return root, latest
  if not os.path.isdir(os.path.join(root, str(step), "state")):
    have = sorted(int(s) for s in os.listdir(root) if s.isdigit())
    raise FileNotFoundError(f"step: no checkpoint for step {step} in {root} (have {have})")
  return root, step


def as_step(step) -> int | None:
  """``step`` as a checkpoint step: an integer, or None (also for '') for the latest."""
  if step is None or step == "":
    return None
  try:
    return operator.index(step)
  except TypeError:
    raise ValueError(f"step: expected an integer or None, got {step!r}") from None


def saved_steps(workdir: str) -> list[int]:
  """Every saved checkpoint step of ``workdir`` (a run directory or its checkpoints directory),
  ascending."""
  root, _ = find(workdir)
  return sorted(
    int(s)
    for s in os.listdir(root)
    if s.isdigit() and os.path.isdir(os.path.join(root, s, "state"))
  )


def _other_steps(root: str, step: int) -> str:
  """'; other saved steps: [...]' for the message about an unreadable step (evaluation never moves
  it: training sets it aside when it resumes)."""
  others = [s for s in saved_steps(root) if s != step]
  return f"; other saved steps: {others}" if others else "; no other step is saved"


def _run_dir(root: str) -> str:
  return os.path.dirname(root) if os.path.basename(root) == "checkpoints" else root


def _build_model(config):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  try:
    cls = schema.import_object(config.model_factory)
    # (config.kernels: the run's kernel configs, which the model passes down to its ops)
    return cls(config.model, rngs=nnx.Rngs(int(config.seed)), **kernel_config.model_kwargs(config))
  except (ImportError, AttributeError, KeyError, ValueError, TypeError) as e:
    raise ValueError(
      f"workdir: the run's model (model_factory {config.get('model_factory')!r}) does not "
      f"build with this version of kdn_jax: {type(e).__name__}: {e}"
    ) from e


def check_info_scale_override(config, value) -> str:
  """``value`` as the model's ``info_scale`` for a run whose KDN layers keep mu fixed (a learned mu is a
  parameter: overriding it would change the parameters, not only mu)."""
  from kdn_jax.layers.kdn_mixer import (  # pylint: disable=g-import-not-at-top
    INFO_SCALES,
    info_scale_text,
    resolve_info_scale,
  )
  from kdn_jax.models.config import layer_mixers  # pylint: disable=g-import-not-at-top

  m = config.model
  if not any(x in ("kdn_diag", "kdn_iso") for x in layer_mixers(m)):
    raise ValueError(
      f"--override_info_scale: the run has no KDN layer (mixers {sorted(set(layer_mixers(m)))})"
    )
  if str(option(m, "info_scale")) == "learned":
    raise ValueError(
      "--override_info_scale: the run learned mu (a parameter per head); the fixed-weight "
      "probe needs a run trained with a fixed mu"
    )
  text = info_scale_text(value)  # as model_config keeps it
  try:
    if text == "learned" or resolve_info_scale(text, int(m.head_dim)) is None:
      raise ValueError
  except ValueError:
    raise ValueError(
      f"--override_info_scale: expected one of {[x for x in INFO_SCALES if x != 'learned']} or "
      f"a positive number, got {value!r}"
    ) from None
  return text


def load(
  workdir: str,
  step: int | None = None,
  tokenizer: str | None = None,
  device=None,
  model_overrides: dict | None = None,
) -> LoadedRun:
  """Restores ``workdir``'s checkpoint (the latest, or ``step``) into a new model on one device.

  ``workdir``: a run directory written by experiments.train, its ``checkpoints`` directory, or one
  ``checkpoints/<step>`` directory. ``tokenizer``: a tokenizer.json (or corpus directory) to use instead of
  the run's corpus tokenizer. ``device``: a jax.Device for the parameters (default: the first device).
  ``model_overrides``: model config keys replaced before the model is built (only ``info_scale``: mu,
  which is no parameter when fixed: the fixed-weight beta_eff probe), the parameters unchanged."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  root, step = find(workdir, as_step(step))
  try:
    record = ckpt_lib.read_record(os.path.join(root, str(step)))
  except ckpt_lib.CheckpointCorruptError as e:
    raise ValueError(f"workdir: {e}{_other_steps(root, step)}") from None
  run_dir = _run_dir(root)
  config = _config_from(record, run_dir)
  for key, value in (model_overrides or {}).items():
    if key != "info_scale":
      raise ValueError(f"model_overrides: only info_scale can be replaced, got {key!r}")
    config.model.info_scale = check_info_scale_override(config, value)
  device = device or jax.devices()[0]
  with jax.default_device(device):
    model = _build_model(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  on_device = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), nnx.to_pure_dict(params)
  )
  try:
    restored, _ = ckpt_lib.restore_params(os.path.join(root, str(step)), abstract)
  except ckpt_lib.CheckpointCorruptError as e:  # damaged files or failed checksums
    raise ValueError(f"workdir: {e}{_other_steps(root, step)}") from None
  except ValueError as e:
    raise ValueError(
      f"workdir: {e}; the run config it was saved with builds a different model"
    ) from e
  nnx.replace_by_pure_dict(params, restored)
  if tokenizer:
    tok_path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
  else:
    tok_path = corpus.tokenizer_path(config)
  return LoadedRun(
    run_dir,
    config,
    nnx.merge(graphdef, params, rest),
    step,
    os.path.join(root, str(step)),
    tok_path,
  )
