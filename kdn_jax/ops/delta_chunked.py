"""Chunkwise (compact WY) form of the asymmetric delta rule in plain XLA.

Within a chunk of C tokens, with in-chunk log-decay cumsums g_r (restarted at
segment starts), Kbar_r = exp(g_r) k_r and Wbar_j = exp(-g_j) w_j, the
innovations delta solve the unit-lower-triangular system

    (I + L) Delta = V - Kbar S_start,   L = tril(Kbar Wbar^T, -1),

and the chunk's final state and outputs follow by matrix products:

    S_end = exp(g_C) S_start + sum_j exp(g_C - g_j) w_j delta_j^T
    o_r   = (exp(g_r) q_r)^T S_start + sum_{j<=r} (q_r . exp(g_r - g_j) w_j) delta_j

(the j = r term is the query-write diagonal: o_t reads S_t after the write).
The decayed Gram matrices are built from log-decay DIFFERENCES only: pairs in
one sub-block of `sub` tokens use the exact pairwise factor, pairs in earlier
sub-blocks go through the cumsum at the end of the previous sub-block, so
every exponent is <= 0 and strong decay underflows to 0 instead of
overflowing. Chunks are processed in parallel; only the K x V state pass is a
`lax.scan` over chunks. Everything runs in the compute dtype (fp32/fp64).
"""

import functools

import jax
import jax.numpy as jnp

from kdn_jax.ops.variance import segment_starts
from kdn_jax.ops.varying import like_varying


def _to_chunks(x, chunk):
  """[B, T, H, ...] (T a multiple of chunk) -> [B, H, N, C, ...]."""
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(x.shape[:2] + (x.shape[2] // chunk, chunk) + x.shape[3:])


def _masked_exp(mask, x):
  # exp only where mask holds; the inner where keeps masked exponents from
  # overflowing (and their gradients from turning into NaN).
  return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _gram_channel_decay(x, y, cum, mask, sub):
  """G[r, j] = sum_i x_ri y_ji exp(cum_ri - cum_ji) where mask (mask => j <= r).

  x, y, cum: [..., C, K]; mask broadcastable to [..., C, C].
  """
  *lead, c, kdim = x.shape
  nb = c // sub
  xb, yb, cb = (t.reshape(*lead, nb, sub, kdim) for t in (x, y, cum))
  tri = jnp.tril(jnp.ones((sub, sub), bool))[..., None]
  e = _masked_exp(tri, cb[..., :, None, :] - cb[..., None, :, :])
  g_diag = jnp.einsum("...nrk,...njk,...nrjk->...nrj", xb, yb, e)
  g = jnp.einsum("...nrj,nm->...nrmj", g_diag, jnp.eye(nb, dtype=x.dtype)).reshape(*lead, c, c)
  if nb > 1:
    ref = cb[..., :-1, -1, :]  # cumsum at the end of sub-blocks 0..nb-2
    x_ref = xb[..., 1:, :, :] * jnp.exp(cb[..., 1:, :, :] - ref[..., None, :])
    before = (jnp.arange(c)[None, :] < (jnp.arange(1, nb) * sub)[:, None])[
      ..., None
    ]  # [nb-1, C, 1]
    y_ref = y[..., None, :, :] * _masked_exp(before, ref[..., None, :] - cum[..., None, :, :])
    g_off = jnp.einsum("...brk,...bjk->...brj", x_ref, y_ref)
    g_off = jnp.concatenate([jnp.zeros((*lead, 1, sub, c), x.dtype), g_off], axis=-3)
    g = g + g_off.reshape(*lead, c, c)
  return jnp.where(mask, g, 0.0)


def _gram_scalar_decay(x, y, cum, mask):
  """Same with a scalar decay per token: cum [..., C]."""
  e = _masked_exp(mask, cum[..., :, None] - cum[..., None, :])
  return jnp.einsum("...rk,...jk->...rj", x, y) * e


def unit_lower_inverse(l_mat, block=16):
  """(I + L)^{-1} for strictly lower-triangular L [..., C, C], by matmuls only.

  Diagonal blocks of `block` rows use the finite Neumann product
  (I - N)^{-1} = (I + N)(I + N^2)(I + N^4)... with N = -L (N^block = 0);
  off-diagonal blocks follow by block forward substitution. No triangular
  solve: XLA's CPU solve is slow inside big graphs and matmuls map onto
  GPU/TPU matrix units.
  """
  c = l_mat.shape[-1]
  block = min(block, c)
  nb = c // block
  eye = jnp.eye(block, dtype=l_mat.dtype)
  # Full-precision products: the inverse feeds every output (no TF32 on GPU).
  mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  blk = lambda i, j: l_mat[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
  inv_diag = []
  for i in range(nb):
    n = -blk(i, i)
    acc, power = eye + n, n
    for _ in range(max(block - 1, 1).bit_length() - 1):
      power = mm(power, power)
      acc = mm(acc, eye + power)
    inv_diag.append(acc)
  rows = []
  for i in range(nb):
    row = [None] * nb
    row[i] = inv_diag[i]
    for j in range(i - 1, -1, -1):
      acc = sum(mm(blk(i, m), rows[m][j]) for m in range(j, i))
      row[j] = -mm(inv_diag[i], acc)
    zeros = jnp.zeros_like(inv_diag[i])
    rows.append([zeros if x is None else x for x in row])
  return jnp.concatenate([jnp.concatenate(r, axis=-1) for r in rows], axis=-2)


@functools.partial(jax.jit, static_argnames=("chunk_size", "sub_block", "output_chunk_states"))
def delta_rule_chunked(
  q,
  k,
  v,
  log_alpha,
  write,
  memory0,
  segment_ids=None,
  *,
  chunk_size=64,
  sub_block=None,
  output_chunk_states=False,
):
  """Chunked delta rule. Inputs [B,T,H,*] in the compute dtype, q pre-scaled.

  log_alpha: [B,T,H,K] (per-channel) or [B,T,H] (scalar); memory0 [B,H,K,V];
  segment_ids: [B,T] ints or None. Returns (o [B,T,H,V], final memory), and
  with output_chunk_states also the state entering each chunk [B,H,N,K,V]
  (before any reset at the chunk's first token).
  """
  batch, t_len, _, _ = q.shape
  memory0 = like_varying(memory0, q)
  c = chunk_size
  if sub_block is None:
    # Sub-blocks of 8 are fastest on CPU for short chunks; long (GPU) chunks
    # use 16 so the unrolled block inverse stays a handful of matmuls.
    sub_block = 8 if c <= 32 else 16
  sub = min(sub_block, c)
  if c % sub:
    raise ValueError(f"chunk_size={c} must be a multiple of {sub}")
  scalar_decay = log_alpha.ndim == 3
  n_chunks = -(-t_len // c)
  pad = n_chunks * c - t_len
  if pad:
    # Padded tokens neither decay nor write nor erase: the state passes through.
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, log_alpha, write = map(pad_t, (q, k, v, log_alpha, write))
    if segment_ids is not None:
      segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
  q, k, v, la, w = (_to_chunks(x, c) for x in (q, k, v, log_alpha, write))
  cum = jnp.cumsum(la, axis=3)
  idx = jnp.arange(c)
  strict = idx[:, None] > idx[None, :]
  incl = idx[:, None] >= idx[None, :]
  segmented = segment_ids is not None
  if segmented:
    starts = segment_starts(segment_ids).reshape(batch, 1, n_chunks, c)
    seg = jnp.cumsum(starts, axis=-1)  # segment index inside the chunk
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, N, C, C]
    strict, incl = strict & same, incl & same
    # New: a segment began in this chunk at or before the token, so the
    # token's segment starts from memory0 rather than the incoming state.
    new = jax.lax.cummax(starts.astype(jnp.int32), axis=3).astype(bool)
    start_pos = jax.lax.cummax(jnp.where(starts, idx, 0), axis=3)
    if not scalar_decay:
      start_pos = start_pos[..., None]
    start_pos = jnp.broadcast_to(start_pos, la.shape)
    g = cum - jnp.take_along_axis(cum - la, start_pos, axis=3)
    last_same = same[..., -1, :]  # [B, 1, N, C]
  else:
    g = cum
  if scalar_decay:
    gram = lambda x, y, m: _gram_scalar_decay(x, y, cum, m)
    eg = jnp.exp(g)[..., None]
  else:
    gram = lambda x, y, m: _gram_channel_decay(x, y, cum, m, sub)
    eg = jnp.exp(g)
  l_mat = gram(k, w, strict)
  qw_mat = gram(q, w, incl)
  k_bar, q_bar = k * eg, q * eg
  v_eff = v
  if segmented:
    newf = new[..., None].astype(q.dtype)
    k_new, q_new = k_bar * newf, q_bar * newf
    k_bar, q_bar = k_bar - k_new, q_bar - q_new
    v_eff = v - jnp.einsum("bhnck,bhkv->bhncv", k_new, memory0)
  vdim = v.shape[-1]
  a_inv = unit_lower_inverse(l_mat, sub)
  u_mat = a_inv @ v_eff
  w_mat = a_inv @ k_bar
  # Decay from each token (and from the chunk start) to the chunk's end.
  last_diff = cum[..., -1:, :] - cum if not scalar_decay else (cum[..., -1:] - cum)
  if segmented:
    mask_last = last_same if scalar_decay else last_same[..., None]
    dec_to_end = _masked_exp(mask_last, last_diff)
  else:
    dec_to_end = jnp.exp(last_diff)
  w_dec = w * (dec_to_end[..., None] if scalar_decay else dec_to_end)
  if scalar_decay:
    decay_last = jnp.exp(g[..., -1])[..., None, None]
  else:
    decay_last = jnp.exp(g[..., -1, :])[..., None]
  xs = [u_mat, w_mat, w_dec, jnp.broadcast_to(decay_last, w_dec.shape[:3] + decay_last.shape[3:])]
  if segmented:
    xs.append(jnp.broadcast_to(new[..., -1], w_dec.shape[:3]))
  xs = [jnp.moveaxis(x, 2, 0) for x in xs]

  def body(state, x):
    u_n, w_n, wdec_n, decay_n = x[:4]
    delta = u_n - jnp.einsum("bhck,bhkv->bhcv", w_n, state)
    start = state
    if segmented:
      start = jnp.where(x[4][..., None, None], memory0, state)
    new_state = decay_n * start + jnp.einsum("bhck,bhcv->bhkv", wdec_n, delta)
    return new_state, state

  final, state_in = jax.lax.scan(body, memory0, xs)
  state_in = jnp.moveaxis(state_in, 0, 2)  # [B, H, N, K, V]
  delta = u_mat - jnp.einsum("bhnck,bhnkv->bhncv", w_mat, state_in)
  o = jnp.einsum("bhnck,bhnkv->bhncv", q_bar, state_in) + jnp.einsum(
    "bhnrj,bhnjv->bhnrv", qw_mat, delta
  )
  if segmented:
    o = o + jnp.einsum("bhnck,bhkv->bhncv", q_new, memory0)
  o = o.reshape(o.shape[:2] + (n_chunks * c, vdim))
  o = jnp.moveaxis(o, 1, 2)[:, :t_len]
  return (o, final, state_in) if output_chunk_states else (o, final)
