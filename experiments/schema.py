"""Run-config schema shared by every ``configs/*.py`` file, plus validation.

A run config has the sections ``model`` (the model ConfigDict from ``kdn_jax.models.config.model_config``),
``data``, ``train``, ``optim``, ``mesh``, ``checkpoint``, ``kernels``, ``logging`` and a few top-level keys. Configs are
locked (``config_flags`` locks them; ``base_config`` returns a locked dict too), so an override of an unknown
key fails at start naming the key; :func:`validate` checks values and names the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import os
from typing import Any

import ml_collections

from experiments import kernel_config

INITIAL_STATES = ("zero", "random_noise", "fitted_noise", "state_passing", "tbtt")
DATA_KINDS = ("mqar", "copying", "passkey", "token_file", "topic")
NAN_POLICIES = ("halt", "skip")
DEFAULT_MODEL_FACTORY = "kdn_jax.models.lm:LanguageModel"

FAMILIES = ("hmm", "dirichlet")  # data.topic.family


@functools.cache
def mixers() -> tuple[str, ...]:
  """The mixer names a config may give, in the registry's order (the registry builds them);
  looked up on first use, so that reading a config's schema does not import jax."""
  from kdn_jax.layers import registry  # pylint: disable=g-import-not-at-top

  return tuple(registry.MIXERS)


def __getattr__(name):
  if name == "MIXERS":
    return mixers()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_arg(arg: str, presets: tuple[str, ...], config_name: str):
  """'<preset>[,<mixer>][,<initial_state>]' -> (preset, mixer, initial_state).

  Raises ConfigError naming the first bad token and the valid choices for its position."""
  parts = [p for p in (arg or presets[0]).split(",") if p]
  preset = parts[0]
  if preset not in presets:
    raise ConfigError(
      f"{config_name}:{arg}: unknown preset {preset!r}; valid presets: {', '.join(presets)}"
    )
  known = mixers()
  found_mixers = [p for p in parts[1:] if p in known]
  strategies = [p for p in parts[1:] if p in INITIAL_STATES]
  for p in parts[1:]:
    if p not in known and p not in INITIAL_STATES:
      raise ConfigError(
        f"{config_name}:{arg}: unknown token {p!r}; after the preset give at most one mixer "
        f"({', '.join(known)}) and one initial state ({', '.join(INITIAL_STATES)})"
      )
  for kind, found in (("mixer", found_mixers), ("initial state", strategies)):
    if len(found) > 1:
      raise ConfigError(
        f"{config_name}:{arg}: more than one {kind} ({', '.join(found)}); give at most one"
      )
  return preset, (found_mixers or ["kdn_diag"])[0], (strategies or ["zero"])[0]


class ConfigError(ValueError):
  """A run config has an invalid value; the message names the key."""


@dataclasses.dataclass(frozen=True)
class TopicParams:
  vocab_size: int = 512
  num_topics: int = 16
  zipf_exponent: float = 1.1
  switch_prob: float = 1.0 / 2048
  doc_len: int = 65536
  seed: int = 0
  family: str = "hmm"
  concentration: float = 0.1

  def check(self, where: str = "topic source") -> None:
    """Raises ValueError naming the first bad parameter as ``<where>.<name>``."""
    rules = (
      ("vocab_size", self.vocab_size >= 2, "must be >= 2"),
      ("num_topics", self.num_topics >= 2, "must be >= 2 (a switch moves to another topic)"),
      ("zipf_exponent", self.zipf_exponent >= 0, "must be >= 0"),
      ("switch_prob", 0.0 <= self.switch_prob <= 1.0, "must be in [0, 1]"),
      ("doc_len", self.doc_len >= 1, "must be positive"),
      ("family", self.family in FAMILIES, f"must be one of {', '.join(FAMILIES)}"),
      ("concentration", self.concentration > 0, "must be > 0"),
    )
    for name, ok, expected in rules:
      if not ok:
        raise ValueError(f"{where}.{name}: {expected}, got {getattr(self, name)!r}")

  @property
  def bos_id(self) -> int:
    return self.vocab_size

  @property
  def model_vocab(self) -> int:
    """Token ids a model must cover: the vocabulary and BOS."""
    return self.vocab_size + 1


def params_from_config(cfg) -> TopicParams:
  """TopicParams from a run config's ``data.topic`` section (a key it lacks keeps its default)."""
  defaults = TopicParams()
  return TopicParams(
    **{
      f.name: type(getattr(defaults, f.name))(cfg.get(f.name, getattr(defaults, f.name)))
      for f in dataclasses.fields(TopicParams)
    }
  )


def base_config() -> ml_collections.ConfigDict:
  """Every key a run config may have, with defaults. ``model`` is filled by the experiment config."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # 'module:attr' of the model class; the class takes (model_cfg, rngs=nnx.Rngs(seed)).
  c.model_factory = DEFAULT_MODEL_FACTORY
  c.model = ml_collections.ConfigDict()

  c.data = d = ml_collections.ConfigDict()
  d.kind = "mqar"  # one of DATA_KINDS
  d.seq_len = 128  # training sequence (chunk) length
  d.eval_seq_len = 0  # 0: same as seq_len (longer to test length generalisation)
  d.global_batch_size = 32
  d.eval_batch_size = 32
  d.shuffle_seed = 0
  d.prefetch = 2  # batches prefetched by a grain thread (0: off)
  d.read_threads = 4  # grain threads reading/generating examples
  d.train_path = ""  # token_file: .npy (1-D token memmap) or .array_record
  d.eval_path = ""
  d.long_eval_path = (
    ""  # token_file: long documents for length evaluation (experiments/evaluate.py)
  )
  d.corpus_dir = ""  # a prepared corpus (experiments/data/prepare.py): fills the empty paths
  d.eos_id = -1  # token_file: document separator (>=0 needed for tbtt)
  d.pack_documents = True  # token_file: windows carry segment_ids where documents begin (when the
  # boundaries are known: <name>.docs.npy, array_record records, or eos_id)
  d.num_train_examples = 1_000_000  # synthetic tasks: size of the (index-addressed) train set
  d.num_eval_examples = 512
  # mqar.mixture: '' = every row has num_kv_pairs pairs at seq_len; else comma-separated cells
  # '<seq_len>:<pairs>[:<weight>]' drawn per row with those relative weights, each row right-padded to
  # data.seq_len (experiments/data/mqar_mixture.py), e.g. '64:4:5,128:8,256:16,256:32,256:64'.
  d.mqar = ml_collections.ConfigDict(
    dict(vocab_size=8192, num_kv_pairs=8, eval_num_kv_pairs=0, power_a=0.01, mixture="")
  )
  # copying: copy_len symbols per example; min_copy_len > 0 draws each example's length uniformly from
  # [min_copy_len, copy_len] (0: always copy_len); eval_copy_len > 0 fixes the validation length.
  d.copying = ml_collections.ConfigDict(
    dict(vocab_size=32, copy_len=16, eval_copy_len=0, min_copy_len=0)
  )
  # passkey: tbtt_chunks bounds a TBTT document's length in chunks of seq_len (experiments/data/
  # passkey_tbtt.py)
  d.passkey = ml_collections.ConfigDict(dict(vocab_size=64, digits=5, tbtt_chunks=4))
  # topic: the synthetic sources with an exact floor (experiments/data/topic_source.py), generated
  # on the fly: family 'hmm' (slow-switching topics: num_topics, zipf_exponent, switch_prob) or
  # 'dirichlet' (each document its own unigram law ~ Dirichlet(concentration)). The model needs
  # vocab_size + 1 ids (BOS = vocab_size). Training windows come from num_train_docs documents of
  # doc_len tokens; validation from num_eval_examples other documents.
  d.topic = ml_collections.ConfigDict(dict(dataclasses.asdict(TopicParams()), num_train_docs=16384))

  c.train = t = ml_collections.ConfigDict()
  t.num_steps = 1000
  t.initial_state = "zero"  # one of INITIAL_STATES
  # Post-training: start a new run from the parameters of another run (its workdir, or one checkpoint
  # directory <workdir>/checkpoints/<step>); fresh optimizer, step 0, this run's initial_state. Ignored
  # once this workdir has a checkpoint of its own (resume).
  t.init_from = ""
  t.noise_std = 0.1  # random_noise sigma
  t.state_reset_prob = 0.1  # state_passing per-sequence reset probability
  t.fitted_noise_beta = 0.1  # weight of the previous estimate (0.9 current / 0.1 previous)
  t.nan_policy = "halt"  # 'halt' or 'skip' the step on a non-finite loss
  # Learning rates trained at once in one process (experiments/runner/lr_sweep.py; () = one run at
  # optim.learning_rate): members share the initial parameters and batches, each gets workdir/lr<rate>/.
  t.lr_sweep = ()
  # Seeds trained at once with every rate (experiments/runner/lr_sweep.py), e.g. '0,1,2': the member of
  # seed s trains as the run with seed=s and data.shuffle_seed=s would (its own initial parameters and
  # data order). '' = one member per rate at config.seed.
  t.seeds = ""
  # > 0: the loss and accuracy read the model's logits only at the first loss_positions scored positions of
  # each row (identical values; no [B, T, vocab] logits): MQAR scores num_kv_pairs positions. 0: everywhere.
  t.loss_positions = 0
  t.log_every = 10
  t.eval_every = 0  # 0: only at the end
  t.eval_batches = 4
  t.z_loss = 0.0

  c.optim = o = ml_collections.ConfigDict()
  o.learning_rate = 3e-4
  o.warmup_steps = 100
  o.min_lr_ratio = 0.1  # cosine decays to min_lr_ratio * learning_rate
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.clip_norm = 1.0  # <= 0: no clipping
  # Parameters whose path contains one of these (comma-separated, case-sensitive) get no weight decay.
  o.no_decay = (
    "A_log,dt_bias,norm,variance_raw,init_var,initial_variance,bias,/D"  # /D: Mamba-2's skip
  )

  c.mesh = m = ml_collections.ConfigDict()
  m.data = -1  # -1 fills the remaining devices
  m.fsdp = 1
  m.tensor = 1
  m.context = 1  # devices one sequence's T is split over (context parallelism)
  m.distributed = False  # call jax.distributed.initialize() (env-configured cluster)
  # logical axis -> mesh axis ('' = replicated); a dim that does not divide is replicated.
  m.rules = ml_collections.ConfigDict(
    dict(vocab="tensor", embed="fsdp", mlp="tensor", heads="tensor", kv="", lowrank="", conv="")
  )

  c.checkpoint = k = ml_collections.ConfigDict()
  k.enabled = True
  k.every_steps = 500
  k.keep = 3
  # Comma-separated steps saved (also off the every_steps grid) and never deleted, besides the
  # newest `keep`: e.g. '1000,2500,5000' for a trend over training tokens. '' = none.
  k.keep_steps = ""
  k.async_save = True

  # Pallas kernel options (experiments/kernel_config.py specs, e.g. delta_rule='num_stages=2'):
  # DeltaRuleConfig / GainConfig / ConvConfig fields over their defaults; exact, speed only.
  # '' = the defaults.
  c.kernels = ml_collections.ConfigDict(dict(delta_rule="", gain="", conv=""))

  c.logging = g = ml_collections.ConfigDict()
  g.tensorboard = True
  g.plot = True
  c.lock()
  return c


@functools.cache
def _schema() -> ml_collections.ConfigDict:
  """The defaults, built once and only read (base_config hands out a fresh dict to fill)."""
  return base_config()


def setting(config, key: str):
  """``config``'s value at the dotted ``key`` (a ConfigDict, or a plain dict as a checkpoint record
  keeps it), or the schema's default where the config lacks it (one saved before the key
  existed): the one place such defaults are read."""
  node = config
  for part in key.split("."):
    if part not in node:
      return _get(_schema(), key)
    node = node[part]
  return node


def _fail(key: str, msg: str):
  raise ConfigError(f"config.{key}: {msg}")


def _one_of(c, key, options):
  val = _get(c, key)
  if val not in options:
    _fail(key, f"invalid value {val!r}; expected one of {list(options)}")


def _get(c, key):
  node = c
  for part in key.split("."):
    node = node[part]
  return node


def _dotted_keys(node, prefix: str = "") -> list[str]:
  out = []
  for key in node.keys():
    out.append(f"{prefix}{key}")
    if isinstance(node[key], ml_collections.ConfigDict):
      out += _dotted_keys(node[key], f"{prefix}{key}.")
  return out


def did_you_mean(key: str, config: ml_collections.ConfigDict | None = None) -> str:
  """' (did you mean 'optim.learning_rate'?)' for a mistyped dotted key (optionally 'config.'-prefixed),
  from the keys of ``config`` (default: the schema, with the model's keys), or ''."""
  key = key.removeprefix("config.")
  if config is None:
    config = base_config()
    from kdn_jax.models import config as model_config_lib  # pylint: disable=g-import-not-at-top

    known = _dotted_keys(config) + [f"model.{k}" for k in model_config_lib.DEFAULTS]
  else:
    known = _dotted_keys(config)
  section, _, leaf = key.rpartition(".")
  leaves = {k: k.rpartition(".")[2] for k in known}

  def with_leaf(names):
    return [k for k in known if leaves[k] in names]

  # the same leaf in another section first (a key put in the wrong section, e.g. train.learning_rate:
  # the section's own close names would hide it), then a close leaf in the same section, then a close
  # leaf or key anywhere (never the key's own section: 'train' is no answer to 'train.lr')
  same = [leaves[k] for k in known if k.rpartition(".")[0] == section]
  close = (
    difflib.get_close_matches(key, with_leaf({leaf}), n=1, cutoff=0.0)
    or [
      f"{section}.{m}".lstrip(".") for m in difflib.get_close_matches(leaf, same, n=1, cutoff=0.6)
    ]
    or with_leaf(difflib.get_close_matches(leaf, set(leaves.values()), n=1, cutoff=0.8))[:1]
    or difflib.get_close_matches(
      key, [k for k in known if not key.startswith(f"{k}.")], n=1, cutoff=0.75
    )
  )
  return f" (did you mean 'config.{close[0]}'?)" if close else ""


def check_keys(
  config: ml_collections.ConfigDict,
  schema: ml_collections.ConfigDict | None = None,
  prefix: str = "",
):
  """Fails on keys the schema does not know (``model`` is checked against the model's own schema)."""
  schema = base_config() if schema is None else schema
  for key in config.keys():
    full = f"{prefix}{key}"
    if key not in schema:
      _fail(full, "unknown key" + did_you_mean(full))
    if key == "model" and not prefix:
      continue
    if isinstance(config[key], ml_collections.ConfigDict) and isinstance(
      schema[key], ml_collections.ConfigDict
    ):
      check_keys(config[key], schema[key], prefix=f"{full}.")


MESH_AXES = ("data", "fsdp", "tensor", "context")


def _check_mesh_values(config):
  """The mesh's sizes as values: each positive or -1 (fills the devices left), at most one -1; the
  device count they must fit is check_mesh's."""
  dims = [int(config.mesh[n]) for n in MESH_AXES]
  for n, v in zip(MESH_AXES, dims):
    if v == 0 or v < -1:
      _fail(f"mesh.{n}", f"invalid value {v}; use a positive size or -1")
  if sum(v == -1 for v in dims) > 1:
    _fail("mesh", "at most one of data/fsdp/tensor/context may be -1")


def check_mesh(config, num_devices: int, process_count: int = 1) -> tuple[int, int, int, int]:
  """The checks that need the devices, on a config whose values passed :func:`validate`: the mesh
  fits ``num_devices`` and the batches and lengths split over it; returns the resolved (data, fsdp,
  tensor, context) shape (-1 filled in)."""
  dims = [int(config.mesh[n]) for n in MESH_AXES]
  known = math.prod(v for v in dims if v != -1)
  if -1 in dims:
    if num_devices % known:
      _fail(
        "mesh",
        f"fixed axes {dict(zip(MESH_AXES, dims))} (product {known}) do not divide the "
        f"{num_devices} devices",
      )
    dims[dims.index(-1)] = num_devices // known
  elif known != num_devices:
    _fail(
      "mesh",
      f"mesh {dict(zip(MESH_AXES, dims))} has {known} devices but {num_devices} are available",
    )
  data, fsdp, _, context = dims
  d = config.data
  batch_par = data * fsdp
  for key in ("global_batch_size", "eval_batch_size"):
    if d[key] % batch_par:
      _fail(f"data.{key}", f"{d[key]} is not divisible by data*fsdp = {batch_par}")
    if d[key] % process_count:
      _fail(f"data.{key}", f"not divisible by the {process_count} processes")
  for key in ("seq_len", "eval_seq_len"):
    if d[key] % context:  # eval_seq_len 0 (= seq_len) passes
      _fail(
        f"data.{key}",
        f"{d[key]} is not divisible by mesh.context = {context} (each device "
        "holds an equal slice of T)",
      )
  return tuple(dims)


def _check_finite(node, prefix: str = ""):
  """Every float of the config is a number: a NaN passes no comparison (clip_norm=nan turned clipping
  off) and an infinite rate or weight trains nothing but NaN, so neither is meant."""
  for key in node.keys():
    val = node[key]
    if isinstance(val, ml_collections.ConfigDict):
      _check_finite(val, f"{prefix}{key}.")
    elif isinstance(val, float) and not math.isfinite(val):
      _fail(f"{prefix}{key}", f"must be a finite number, got {val}")
    elif isinstance(val, (tuple, list)):
      for v in val:
        if isinstance(v, float) and not math.isfinite(v):
          _fail(f"{prefix}{key}", f"must hold finite numbers, got {tuple(val)}")


def _check_model(config):
  """The model's own checks (kdn_jax.models.config.validate_config) on config.model as the flags left
  it, as config errors naming the key (another model_factory brings its own schema)."""
  if config.model_factory != DEFAULT_MODEL_FACTORY:
    return
  from kdn_jax.models import config as model_config_lib  # pylint: disable=g-import-not-at-top

  try:
    model_config_lib.validate_config(config.model)
  except model_config_lib.ModelConfigError as e:
    raise ConfigError(f"config.model.{e.key}: {e.msg}") from None


def validate(config: ml_collections.ConfigDict):
  """Checks a run config's keys and values, nothing that needs the devices (the Trainer's
  :func:`check_mesh`); raises ConfigError naming the first bad key."""
  check_keys(config)
  check_values(config)
  return config


def check_values(config: ml_collections.ConfigDict):
  """Every value of a run config whose keys passed :func:`check_keys`; pure (no devices, no
  files); raises ConfigError naming the first bad key."""
  m = config.model
  for key in ("vocab_size", "num_layers", "d_model", "mixer"):
    if key not in m:
      _fail(f"model.{key}", "missing (config.model must come from model_config(size, ...))")
  _one_of(config, "model.mixer", mixers())
  _check_finite(config)
  _check_model(config)
  if ":" not in config.model_factory:
    _fail("model_factory", f'expected "module:attr", got {config.model_factory!r}')

  try:  # (parsed against the kernels' config classes; applied by the Trainer)
    kernel_config.resolve(config.get("kernels") or {})
  except ValueError as e:
    raise ConfigError(str(e)) from None

  d = config.data
  _one_of(config, "data.kind", DATA_KINDS)
  for key in (
    "seq_len",
    "global_batch_size",
    "eval_batch_size",
    "num_eval_examples",
    "num_train_examples",
  ):
    if int(d[key]) <= 0:
      _fail(f"data.{key}", f"must be positive, got {d[key]}")
  if d.eval_seq_len < 0:
    _fail("data.eval_seq_len", "must be >= 0")
  if d.read_threads <= 0:
    _fail("data.read_threads", "must be positive")
  if d.prefetch < 0:
    _fail("data.prefetch", "must be >= 0")
  if d.kind == "token_file" and not d.train_path and not d.corpus_dir:
    _fail("data.train_path", 'required for data.kind="token_file" (or set data.corpus_dir)')
  if d.kind == "mqar":
    q = d.mqar
    if q.num_kv_pairs <= 0:
      _fail(
        "data.mqar.num_kv_pairs",
        f"must be positive (pairs to recall per row), got {q.num_kv_pairs}",
      )
    if q.eval_num_kv_pairs < 0:
      _fail(
        "data.mqar.eval_num_kv_pairs", f"must be >= 0 (0: as training), got {q.eval_num_kv_pairs}"
      )
    if not q.power_a > 0:
      _fail("data.mqar.power_a", f"must be positive, got {q.power_a}")
    if q.vocab_size > m.vocab_size:
      _fail("data.mqar.vocab_size", f"{q.vocab_size} exceeds model.vocab_size={m.vocab_size}")
    n = max(q.num_kv_pairs, q.eval_num_kv_pairs)
    if 4 * n > max(d.seq_len, d.eval_seq_len or d.seq_len):
      _fail("data.mqar.num_kv_pairs", f"{n} pairs need seq_len >= {4 * n}")
    cells = mqar_mixture_cells(config)
    if cells:
      longest = max(c[0] for c in cells)
      if longest > d.seq_len:
        _fail(
          "data.mqar.mixture",
          f"a cell of length {longest} is longer than data.seq_len={d.seq_len} "
          "(rows are padded to seq_len)",
        )
      n = max(n, max(c[1] for c in cells))
    if q.vocab_size < 2 * n + 2:
      _fail("data.mqar.vocab_size", f"too small for {n} key/value pairs")
  if d.kind == "copying":
    if d.copying.copy_len <= 0:
      _fail("data.copying.copy_len", f"must be positive, got {d.copying.copy_len}")
    if d.copying.eval_copy_len < 0:
      _fail("data.copying.eval_copy_len", "must be >= 0 (0: as training)")
    if not 0 <= d.copying.min_copy_len <= d.copying.copy_len:
      _fail(
        "data.copying.min_copy_len",
        f"must be in [0, copy_len={d.copying.copy_len}] (0: fixed), got {d.copying.min_copy_len}",
      )
    if d.copying.vocab_size < 4:
      _fail("data.copying.vocab_size", "needs at least one symbol besides pad/BOS/SEP (>= 4)")
    cl = d.copying.copy_len
    if 2 * cl + 1 > d.seq_len:
      _fail("data.copying.copy_len", f"{cl} needs data.seq_len >= {2 * cl + 1}, got {d.seq_len}")
    ecl, elen = d.copying.eval_copy_len or cl, d.eval_seq_len or d.seq_len
    if 2 * ecl + 1 > elen:
      _fail(
        "data.copying.eval_copy_len" if d.copying.eval_copy_len else "data.eval_seq_len",
        f"validation copy length {ecl} needs an evaluation length >= {2 * ecl + 1}, got {elen}",
      )
    if d.copying.vocab_size > m.vocab_size:
      _fail("data.copying.vocab_size", "exceeds model.vocab_size")
  if d.kind == "passkey" and d.passkey.vocab_size > m.vocab_size:
    _fail("data.passkey.vocab_size", "exceeds model.vocab_size")
  if d.kind == "topic":
    _check_topic(config)
  if d.kind == "passkey" and d.passkey.digits <= 0:
    _fail("data.passkey.digits", f"must be positive, got {d.passkey.digits}")
  if d.kind == "passkey" and d.passkey.tbtt_chunks < 1:
    _fail("data.passkey.tbtt_chunks", f"must be >= 1, got {d.passkey.tbtt_chunks}")

  t = config.train
  _one_of(config, "train.initial_state", INITIAL_STATES)
  _one_of(config, "train.nan_policy", NAN_POLICIES)
  if t.num_steps <= 0:
    _fail("train.num_steps", f"must be positive, got {t.num_steps}")
  if t.noise_std < 0:
    _fail("train.noise_std", "must be >= 0")
  if not 0.0 <= t.state_reset_prob <= 1.0:
    _fail("train.state_reset_prob", f"must be in [0, 1], got {t.state_reset_prob}")
  if not 0.0 <= t.fitted_noise_beta <= 1.0:
    _fail("train.fitted_noise_beta", "must be in [0, 1]")
  if t.log_every <= 0:
    _fail("train.log_every", "must be positive")
  if t.eval_every < 0:
    _fail("train.eval_every", f"must be >= 0 (0: only at the end), got {t.eval_every}")
  if t.eval_batches < 0:
    _fail("train.eval_batches", f"must be >= 0 (0: the whole validation set), got {t.eval_batches}")
  if t.z_loss < 0:
    _fail("train.z_loss", f"must be >= 0, got {t.z_loss}")
  if t.initial_state == "tbtt" and d.kind == "token_file" and d.eos_id < 0:
    _fail("data.eos_id", "tbtt over token files needs a document separator id (>= 0)")
  if d.kind == "token_file" and d.eos_id >= int(config.model.vocab_size):
    _fail(
      "data.eos_id",
      f"{d.eos_id} is outside the model vocabulary [0, model.vocab_size={config.model.vocab_size}); "
      "expected the id of the document separator token (-1: none)",
    )

  if t.loss_positions < 0:
    _fail("train.loss_positions", f"must be >= 0, got {t.loss_positions}")
  if t.loss_positions and d.kind == "mqar":
    most = max([d.mqar.num_kv_pairs] + [c[1] for c in mqar_mixture_cells(config)])
    if t.loss_positions < most:
      _fail(
        "train.loss_positions",
        f"{t.loss_positions} is below the {most} scored positions of an MQAR "
        "row (data.mqar.num_kv_pairs, or the largest of data.mqar.mixture)",
      )
  sweep = tuple(t.lr_sweep)
  if any(not isinstance(lr, (int, float)) or not lr > 0 for lr in sweep) or len(set(sweep)) != len(
    sweep
  ):
    _fail("train.lr_sweep", f"must be distinct positive learning rates, got {sweep}")
  parse_seeds(setting(config, "train.seeds"))

  o = config.optim
  if not o.learning_rate > 0:
    _fail("optim.learning_rate", f"must be positive, got {o.learning_rate}")
  if o.warmup_steps < 0:
    _fail("optim.warmup_steps", "must be >= 0")
  if not 0 <= o.min_lr_ratio <= 1:
    _fail("optim.min_lr_ratio", "must be in [0, 1]")
  if o.weight_decay < 0:
    _fail("optim.weight_decay", "must be >= 0")
  if not o.eps > 0:
    _fail("optim.eps", f"must be positive, got {o.eps}")
  for key in ("b1", "b2"):
    if not 0 <= o[key] < 1:
      _fail(f"optim.{key}", "must be in [0, 1)")

  from kdn_jax.layers.options import option  # pylint: disable=g-import-not-at-top

  if config.mesh.context != 1 and str(option(config.model, "impl")) == "reference":
    _fail(
      "model.impl",
      "'reference' has no context-parallel form; use 'auto', 'chunked' or 'pallas' "
      "with mesh.context > 1",
    )
  _check_mesh_values(config)
  for logical, axis in config.mesh.rules.items():
    if axis not in ("", "data", "fsdp", "tensor"):
      _fail(f"mesh.rules.{logical}", f"unknown mesh axis {axis!r}")
  if config.checkpoint.every_steps < 0 or config.checkpoint.keep <= 0:
    _fail("checkpoint", "every_steps must be >= 0 and keep > 0")
  parse_keep_steps(setting(config, "checkpoint.keep_steps"))


def _check_topic(config):
  d, tp = config.data, config.data.topic
  try:
    params = params_from_config(tp)
    params.check("config.data.topic")
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None
  if params.model_vocab > config.model.vocab_size:
    _fail(
      "model.vocab_size",
      f"{config.model.vocab_size} does not cover the topic vocabulary "
      f"and BOS (data.topic.vocab_size + 1 = {params.model_vocab})",
    )
  longest = max(d.seq_len, d.eval_seq_len)
  if longest > params.doc_len:
    _fail("data.topic.doc_len", f"{params.doc_len} is shorter than a window ({longest} tokens)")
  if tp.num_train_docs <= 0:
    _fail("data.topic.num_train_docs", f"must be positive, got {tp.num_train_docs}")
  if config.train.initial_state == "tbtt" and tp.num_train_docs < d.global_batch_size:
    _fail(
      "data.topic.num_train_docs",
      f"tbtt reads one document per batch row: needs >= "
      f"global_batch_size={d.global_batch_size}, got {tp.num_train_docs}",
    )


def sweep_member_dir(workdir: str, lr: float, seed: int | None = None) -> str:
  """The folder of one member of a sweep (experiments/runner/lr_sweep.py), a plain run's layout:
  ``lr<rate>``, or ``lr<rate>_seed<seed>`` in a sweep over seeds."""
  return os.path.join(workdir, f"lr{lr:g}" if seed is None else f"lr{lr:g}_seed{seed}")


def parse_keep_steps(text) -> tuple[int, ...]:
  """``checkpoint.keep_steps`` '1000,2500' -> (1000, 2500); '' -> ()."""
  parts = [p.strip() for p in str(text).split(",") if p.strip()]
  try:
    steps = tuple(sorted(int(p) for p in parts))
  except ValueError:
    steps = None
  if steps is None or any(s <= 0 for s in steps):
    _fail(
      "checkpoint.keep_steps",
      f"expected positive steps separated by commas, like '1000,2500,5000', got {text!r}",
    )
  return steps


def parse_seeds(text) -> tuple[int, ...]:
  """``train.seeds`` '0,1,2' -> (0, 1, 2); '' -> ()."""
  if isinstance(text, (tuple, list)):
    text = ",".join(str(x) for x in text)
  parts = [p.strip() for p in str(text).split(",") if p.strip()]
  try:
    seeds = tuple(int(p) for p in parts)
  except ValueError:
    seeds = None
  if seeds is None or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
    _fail(
      "train.seeds",
      f"expected distinct non-negative integers separated by commas, like '0,1,2', got {text!r}",
    )
  return seeds


def mqar_mixture_cells(config) -> tuple[tuple[int, int, float], ...]:
  """``data.mqar.mixture`` '64:4:5,128:8' -> ((64, 4, 5.0), (128, 8, 1.0)); '' -> ()."""
  text = str(setting(config, "data.mqar.mixture") or "")
  cells = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    bits = part.split(":")
    try:
      t, n, w = int(bits[0]), int(bits[1]), float(bits[2]) if len(bits) == 3 else 1.0
      ok = len(bits) in (2, 3) and t > 0 and n > 0 and w > 0
    except (ValueError, IndexError):
      ok = False
    if not ok:
      _fail(
        "data.mqar.mixture",
        f"cell {part!r}: expected '<seq_len>:<pairs>[:<weight>]' with positive "
        f"values, e.g. '64:4:5,256:64'",
      )
    if 4 * n > t:
      _fail("data.mqar.mixture", f"cell {part!r}: {n} pairs need a length >= {4 * n}")
    cells.append((t, n, w))
  return tuple(cells)


def import_object(path: str) -> Any:
  module, _, attr = path.partition(":")
  return getattr(importlib.import_module(module), attr)
