"""grain pipelines: MapDataset -> shuffle -> repeat -> per-process shard -> batch -> prefetch."""
from __future__ import annotations

import functools

import grain
import numpy as np

from experiments.data import corpus, synthetic, token_files


def check_data_files(config):
  """Fills token-file paths from ``data.corpus_dir``, then opens every configured token file as the loader
  will (token_files.check_run_files): a missing or malformed file, or an id outside the model's vocabulary,
  is a ConfigError naming the key before training."""
  if config.data.kind != 'token_file':
    return
  corpus.resolve(config)
  token_files.check_run_files(config)


def _example_fn(config, split: str):
  d = config.data
  train = split == 'train'
  seq_len = d.seq_len if train or not d.eval_seq_len else d.eval_seq_len
  seed = d.shuffle_seed * 1000 + (1 if train else 2)
  if d.kind == 'mqar':
    q = d.mqar
    n = q.num_kv_pairs if train or not q.eval_num_kv_pairs else q.eval_num_kv_pairs
    return functools.partial(synthetic.mqar_example, seed=seed, seq_len=seq_len, vocab_size=q.vocab_size,
                             num_kv_pairs=n, power_a=q.power_a)
  if d.kind == 'copying':
    c = d.copying
    fixed_eval = not train and c.eval_copy_len
    n = c.eval_copy_len if fixed_eval else c.copy_len
    # min_copy_len > 0: lengths drawn from [min_copy_len, copy_len] (train, and eval unless eval_copy_len)
    return functools.partial(synthetic.copying_example, seed=seed, seq_len=seq_len,
                             vocab_size=c.vocab_size, copy_len=n,
                             min_copy_len=0 if fixed_eval else c.get('min_copy_len', 0))
  if d.kind == 'passkey':
    return functools.partial(synthetic.passkey_example, seed=seed, seq_len=seq_len,
                             vocab_size=d.passkey.vocab_size, digits=d.passkey.digits)
  raise ValueError(d.kind)


def _map_dataset(config, split: str) -> grain.MapDataset:
  d = config.data
  if d.kind == 'token_file':
    path = d.train_path if split == 'train' else (d.eval_path or d.train_path)
    seq_len = d.seq_len if split == 'train' or not d.eval_seq_len else d.eval_seq_len
    tokens, offsets = token_files.open_token_file(
        path, min_tokens=seq_len + 1, vocab_size=int(config.model.vocab_size), eos_id=d.eos_id,
        pack_documents=d.pack_documents)
    return grain.MapDataset.source(token_files.WindowSource(tokens, seq_len, offsets))
  n = d.num_train_examples if split == 'train' else d.num_eval_examples
  return grain.MapDataset.range(n).map(_example_fn(config, split))


def make_train_iterator(config, process_index: int = 0, process_count: int = 1):
  """A checkpointable grain iterator of per-process numpy batches."""
  d = config.data
  local_batch = d.global_batch_size // process_count
  if config.train.initial_state == 'tbtt':
    if d.kind != 'token_file':
      raise ValueError('config.train.initial_state="tbtt" needs data.kind="token_file" (long documents)')
    tokens, _ = token_files.open_token_file(d.train_path, min_tokens=2, vocab_size=int(config.model.vocab_size),
                                            eos_id=d.eos_id, pack_documents=False)
    src = token_files.TBTTSource(tokens, d.eos_id, d.seq_len,
                                 d.global_batch_size, d.shuffle_seed, process_index, process_count)
    epochs = -(-config.train.num_steps // len(src)) + 1
    ds = grain.MapDataset.source(src).repeat(epochs)  # order matters: no shuffle
  else:
    ds = _map_dataset(config, 'train')
    epochs = -(-config.train.num_steps * d.global_batch_size // len(ds)) + 1
    ds = ds.shuffle(seed=d.shuffle_seed).repeat(epochs)
    ds = ds[process_index::process_count]
    ds = ds.batch(local_batch, drop_remainder=True)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=d.read_threads, prefetch_buffer_size=max(
      2 * d.read_threads, 1)))
  if d.prefetch:
    it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=d.prefetch)
  return iter(it)


def make_eval_batches(config, process_index: int = 0, process_count: int = 1) -> list[dict]:
  """Fixed evaluation batches (per process), the same for every evaluation."""
  d = config.data
  ds = _map_dataset(config, 'eval')
  n = min(len(ds), d.num_eval_examples)
  local = d.eval_batch_size // process_count
  num_batches = min(config.train.eval_batches, n // d.eval_batch_size) if config.train.eval_batches else (
      n // d.eval_batch_size)
  num_batches = max(num_batches, 1)
  out = []
  for b in range(num_batches):
    idx = [b * d.eval_batch_size + process_index * local + i for i in range(local)]
    ex = [ds[i % len(ds)] for i in idx]
    out.append({k: np.stack([e[k] for e in ex]) for k in ex[0]})
  return out
