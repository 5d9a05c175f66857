"""grain pipelines: MapDataset -> shuffle -> repeat -> per-process shard -> batch -> prefetch."""

from __future__ import annotations

import functools

import grain
import numpy as np

from experiments import schema
from experiments.data import (
  mqar_mixture,
  passkey_tbtt,
  synthetic,
  token_files,
  topic_source,
  topic_windows,
)


def _example_fn(config, split: str):
  d = config.data
  train = split == "train"
  seq_len = d.seq_len if train or not d.eval_seq_len else d.eval_seq_len
  seed = d.shuffle_seed * 1000 + (1 if train else 2)
  if d.kind == "mqar":
    q = d.mqar
    n = q.num_kv_pairs if train or not q.eval_num_kv_pairs else q.eval_num_kv_pairs
    return functools.partial(
      synthetic.mqar_example,
      seed=seed,
      seq_len=seq_len,
      vocab_size=q.vocab_size,
      num_kv_pairs=n,
      power_a=q.power_a,
    )
  if d.kind == "copying":
    c = d.copying
    fixed_eval = not train and c.eval_copy_len
    n = c.eval_copy_len if fixed_eval else c.copy_len
    # min_copy_len > 0: lengths drawn from [min_copy_len, copy_len] (train, and eval unless eval_copy_len)
    return functools.partial(
      synthetic.copying_example,
      seed=seed,
      seq_len=seq_len,
      vocab_size=c.vocab_size,
      copy_len=n,
      min_copy_len=0 if fixed_eval else schema.setting(config, "data.copying.min_copy_len"),
    )
  if d.kind == "passkey":
    return functools.partial(
      synthetic.passkey_example,
      seed=seed,
      seq_len=seq_len,
      vocab_size=d.passkey.vocab_size,
      digits=d.passkey.digits,
    )
  raise ValueError(d.kind)


def _map_dataset(config, split: str) -> grain.MapDataset:
  d = config.data
  if d.kind == "token_file":
    path = d.train_path if split == "train" else (d.eval_path or d.train_path)
    seq_len = d.seq_len if split == "train" or not d.eval_seq_len else d.eval_seq_len
    tokens, offsets = token_files.open_token_file(
      path,
      min_tokens=seq_len + 1,
      vocab_size=int(config.model.vocab_size),
      eos_id=d.eos_id,
      pack_documents=d.pack_documents,
    )
    return grain.MapDataset.source(token_files.WindowSource(tokens, seq_len, offsets))
  if d.kind == "topic":
    seq_len = d.seq_len if split == "train" or not d.eval_seq_len else d.eval_seq_len
    src = topic_source.TopicSource(topic_source.params_from_config(d.topic))
    if split == "train":
      return grain.MapDataset.source(
        topic_windows.TopicWindows(src, topic_source.TRAIN, seq_len, d.topic.num_train_docs)
      )
    return grain.MapDataset.source(
      topic_windows.TopicWindows(src, topic_source.VALID, seq_len, d.num_eval_examples, spread=True)
    )
  n = d.num_train_examples if split == "train" else d.num_eval_examples
  return grain.MapDataset.range(n).map(_example_fn(config, split))


def _mixture_batch(
  config, split: str, index: int, rows: int, process_index: int, process_count: int
):
  """This process's rows of global batch ``index`` of the MQAR mixture stream of ``split``."""
  d = config.data
  seed = d.shuffle_seed * 1000 + (1 if split == "train" else 2)
  b = mqar_mixture.batch(
    seed,
    index,
    schema.mqar_mixture_cells(config),
    rows,
    d.seq_len,
    d.mqar.vocab_size,
    d.mqar.power_a,
  )
  local = rows // process_count
  return {
    k: v[process_index * local : (process_index + 1) * local] for k, v in b.items() if k != "cell"
  }


def make_train_iterator(config, process_index: int = 0, process_count: int = 1):
  """A checkpointable grain iterator of per-process numpy batches."""
  d = config.data
  local_batch = d.global_batch_size // process_count
  if d.kind == "mqar" and schema.mqar_mixture_cells(config):
    # whole batches, each generated at once (one example at a time is too slow for this stream)
    ds = grain.MapDataset.range(config.train.num_steps + 1).map(
      functools.partial(
        _mixture_batch,
        config,
        "train",
        rows=d.global_batch_size,
        process_index=process_index,
        process_count=process_count,
      )
    )
  elif config.train.initial_state == "tbtt":
    if d.kind == "topic":
      src = topic_windows.TopicTBTTSource(
        topic_source.TopicSource(topic_source.params_from_config(d.topic)),
        d.seq_len,
        d.global_batch_size,
        d.topic.num_train_docs,
        process_index,
        process_count,
      )
    elif d.kind == "token_file":
      tokens, _ = token_files.open_token_file(
        d.train_path,
        min_tokens=2,
        vocab_size=int(config.model.vocab_size),
        eos_id=d.eos_id,
        pack_documents=False,
      )
      src = token_files.TBTTSource(
        tokens,
        d.eos_id,
        d.seq_len,
        d.global_batch_size,
        d.shuffle_seed,
        process_index,
        process_count,
      )
    elif d.kind == "passkey":
      src = passkey_tbtt.PasskeyTBTTSource(
        seq_len=d.seq_len,
        global_batch=d.global_batch_size,
        steps=config.train.num_steps + 1,
        seed=d.shuffle_seed * 1000 + 1,
        vocab_size=d.passkey.vocab_size,
        digits=d.passkey.digits,
        max_chunks=d.passkey.tbtt_chunks,
        process_index=process_index,
        process_count=process_count,
      )
    else:
      raise ValueError(
        'config.train.initial_state="tbtt" needs long documents: data.kind="token_file", "topic" '
        'or "passkey"'
      )
    epochs = -(-config.train.num_steps // len(src)) + 1
    ds = grain.MapDataset.source(src).repeat(epochs)  # order matters: no shuffle
  elif d.kind == "topic":  # shuffled window indices, each batch generated in one vectorised pass
    src = topic_source.TopicSource(topic_source.params_from_config(d.topic))
    n = d.topic.num_train_docs * src.windows_per_doc(d.seq_len)
    epochs = -(-config.train.num_steps * d.global_batch_size // n) + 1
    ds = grain.MapDataset.range(n).shuffle(seed=d.shuffle_seed).repeat(epochs)
    ds = ds[process_index::process_count].batch(local_batch, drop_remainder=True)
    ds = ds.map(topic_windows.WindowBatch(src, topic_source.TRAIN, d.seq_len))
  else:
    ds = _map_dataset(config, "train")
    epochs = -(-config.train.num_steps * d.global_batch_size // len(ds)) + 1
    ds = ds.shuffle(seed=d.shuffle_seed).repeat(epochs)
    ds = ds[process_index::process_count]
    ds = ds.batch(local_batch, drop_remainder=True)
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=d.read_threads, prefetch_buffer_size=max(2 * d.read_threads, 1))
  )
  if d.prefetch:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=d.prefetch)
  return iter(it)


def make_eval_batches(config, process_index: int = 0, process_count: int = 1) -> list[dict]:
  """Fixed evaluation batches (per process), the same for every evaluation."""
  d = config.data
  if d.kind == "mqar" and schema.mqar_mixture_cells(config):
    num_batches = max(
      1,
      min(
        config.train.eval_batches or d.num_eval_examples, d.num_eval_examples // d.eval_batch_size
      ),
    )
    return [
      _mixture_batch(config, "eval", b, d.eval_batch_size, process_index, process_count)
      for b in range(num_batches)
    ]
  ds = _map_dataset(config, "eval")
  n = min(len(ds), d.num_eval_examples)
  local = d.eval_batch_size // process_count
  # every example once: the last batch is filled with masked-out copies (a set smaller than one
  # batch would otherwise be scored with some examples repeated more often than others)
  whole = -(-n // d.eval_batch_size)
  num_batches = min(config.train.eval_batches, whole) if config.train.eval_batches else whole
  out = []
  for b in range(num_batches):
    idx = np.arange(local) + b * d.eval_batch_size + process_index * local
    ex = [ds[int(i) % n] for i in idx]
    batch = {k: np.stack([e[k] for e in ex]) for k in ex[0]}
    batch["mask"] = np.where((idx < n)[:, None], batch["mask"], 0).astype(batch["mask"].dtype)
    out.append(batch)
  return out
