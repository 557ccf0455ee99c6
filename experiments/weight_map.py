"""Transformer -> hybrid weights: a hybrid's replaced layers start from the attention
layers' projections (docs/design.md, section 9: conversion).

    params, carried = convert_params(source_params, source_cfg, target_cfg)

source_cfg: a model of attention ("A") layers (any pattern); target_cfg: the same model
(vocab, width, MLP, pattern length) with some "A" letters replaced by "S" (SSE) or "G"
(GLA). Every parameter of an unchanged layer, the embedding, the final norm, and the
block norms and MLP of the replaced layers are copied. In a replaced layer (x [B, T, D],
H heads, attention head dim Dh):

    SSE / GLA W_q [D, H, Dk]  <- attention W_q [D, H, Dh]        (Dk = Dh)
              W_k [D, H, Dk]  <- attention W_k [D, Hkv, Dh], each kv head repeated over
                                 its H / Hkv query heads (GQA)
              W_v [D, H, Dv]  <- attention W_v likewise             (Dv = Dh)
              W_o [H, Dv, D]  <- attention W_o [H, Dh, D] (the output head's projection)
              q / k / v short-conv kernels [w, H, D*] <- the attention's, where both
                                 have a short conv of the same width w (kv kernels
                                 repeated like W_k / W_v)

With per-partition projections (SSE share_partition_params=False) every partition's
copy [D, P, H, D*] gets the same attention weights. What cannot be carried over keeps the
target's own fresh initialisation (the same draw a from-scratch run of that seed gets):
  - the decay gate (W_g1, W_g2, b): attention does not forget; its softmax over the
    whole prefix has no counterpart in a decayed state,
  - the SSE router W_e (attention has no partitions) and the shared partition's LoRA
    (its B is zero at init, so the shared partition starts with the copied W_q / W_k),
  - the output head's per-head RMSNorm and its SiLU gate W_gate (attention's output is
    o W_o, ungated),
  - a short conv the attention layer lacks (or of another width);
and what the copied weights mean changes: the linear layers apply no RoPE (q, k
enter unrotated) and the SSE keys go through its feature map (softmax over Dk by
default) instead of the attention softmax over positions.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from sse_jax.model import ModelConfig

LINEAR = ("S", "G")  # the letters an attention layer may become
# (linear-mixer parameter, attention parameter, kv?) of a replaced layer
MAPPED = (("qkv/q_proj/kernel", "q/kernel", False),
          ("qkv/k_proj/kernel", "k/kernel", True),
          ("qkv/v_proj/kernel", "v/kernel", True),
          ("out/proj/kernel", "o/kernel", False))
CONVS = (("qkv/q_conv/kernel", "q_conv/kernel", False),
         ("qkv/k_conv/kernel", "k_conv/kernel", True),
         ("qkv/v_conv/kernel", "v_conv/kernel", True))


def replaced_layers(source: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
  """The layers whose letter changes, after checking that `target` is `source` with some
  attention layers replaced by SSE / GLA ones (ValueError naming what differs)."""
  if len(source.pattern) != len(target.pattern):
    raise ValueError(f"target pattern {target.pattern!r} has {len(target.pattern)} layers,"
                     f" the source {source.pattern!r} {len(source.pattern)}")
  for field in ("vocab_size", "hidden", "mlp", "tie_embeddings"):
    if getattr(source, field) != getattr(target, field):
      raise ValueError(f"target {field}={getattr(target, field)!r} differs from the "
                       f"source's {getattr(source, field)!r}: only mixers can be replaced")
  out = []
  for i, (a, b) in enumerate(zip(source.pattern, target.pattern)):
    if a == b:
      if a == "A" and source.attention != target.attention:
        raise ValueError(f"layer {i} stays attention but its config changes: "
                         f"{target.attention} vs the source's {source.attention}")
      continue
    if a != "A" or b not in LINEAR:
      raise ValueError(f"layer {i}: {a!r} -> {b!r} cannot be converted; only attention "
                       f"('A') layers become {' / '.join(map(repr, LINEAR))} layers")
    out.append(i)
  if not out:
    raise ValueError(f"target pattern {target.pattern!r} replaces no attention layer of "
                     f"{source.pattern!r}")
  return tuple(out)


def _check_shapes(i: int, attention, mixer, letter: str) -> None:
  """The replaced layer must have the attention layer's heads and head dims."""
  if mixer.num_heads != attention.num_heads:
    raise ValueError(f"layer {i} ({letter}): num_heads={mixer.num_heads} differs from the "
                     f"attention's {attention.num_heads}")
  for field, dim in (("key_dim", mixer.head_k), ("value_dim", mixer.head_v)):
    if dim != attention.head:
      raise ValueError(f"layer {i} ({letter}): {field}={dim} must equal the attention head "
                       f"dim {attention.head} for W_q / W_k / W_v / W_o to carry over "
                       "(None: hidden / num_heads)")


def _key(tree: Mapping, key: str):
  """The dict key a path component names: the blocks' keys are ints in a pure dict."""
  return int(key) if key not in tree and key.isdigit() else key


def _get(tree: Mapping[str, Any], path: str):
  for key in path.split("/"):
    tree = tree[_key(tree, key)]
  return tree


def _put(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split("/")
  for key in parents:
    tree = tree[_key(tree, key)]
  tree[_key(tree, leaf)] = value


def _fit(src: np.ndarray, dst: np.ndarray, kv_axis: int | None, groups: int) -> np.ndarray:
  """src laid out as dst: kv heads repeated `groups` times on kv_axis, then broadcast
  over a per-partition axis of dst (the one src lacks, after D)."""
  if kv_axis is not None and groups > 1:
    src = np.repeat(src, groups, axis=kv_axis)
  if src.ndim + 1 == dst.ndim:  # per-partition projections [D, P, H, D*]
    src = np.broadcast_to(src[:, None], dst.shape)
  if src.shape != dst.shape:
    raise ValueError(f"cannot lay out {src.shape} as {dst.shape}")
  return np.asarray(src, dtype=dst.dtype)


def convert_params(source_params: Mapping[str, Any], source: ModelConfig,
                   target_params: Mapping[str, Any], target: ModelConfig
                   ) -> tuple[dict, list[str]]:
  """(target params with the source's weights where they carry over, the carried paths
  as "blocks/0/mixer/qkv/q_proj/kernel"). Both param trees are pure dicts of arrays
  (`TrainState.params`); target_params is the target's fresh init, kept where nothing
  carries over. Raises ValueError (one line) on a target that is not a conversion of
  the source."""
  layers = replaced_layers(source, target)
  out = _to_numpy(target_params)
  src = _to_numpy(source_params)
  carried = []

  def copy(path: str, value) -> None:
    dst = _get(out, path)
    if np.shape(value) != dst.shape:
      raise ValueError(f"{path}: the source's {np.shape(value)} does not fit {dst.shape}")
    _put(out, path, np.asarray(value, dtype=dst.dtype))
    carried.append(path)

  for name in ("embed", "final_norm", "lm_head"):
    if name in src and src[name] is not None:
      for path in _paths(src[name], name):
        copy(path, _get(src, path))
  attention = source.attention
  for i, letter in enumerate(target.pattern):
    block = f"blocks/{i}"
    for part in ("mixer_norm", "mlp", "mlp_norm"):
      for path in _paths(_get(src, f"{block}/{part}"), f"{block}/{part}"):
        copy(path, _get(src, path))
    if i not in layers:
      for path in _paths(_get(src, f"{block}/mixer"), f"{block}/mixer"):
        copy(path, _get(src, path))
      continue
    mixer = target.mixer_config(letter)
    _check_shapes(i, attention, mixer, letter)
    groups = attention.num_heads // attention.kv_heads
    pairs = list(MAPPED)
    if attention.short_conv and attention.short_conv == mixer.short_conv:
      pairs += CONVS
    for mine, theirs, kv in pairs:
      value = _get(src, f"{block}/mixer/{theirs}")
      dst = _get(out, f"{block}/mixer/{mine}")
      # the heads axis: W_k / W_v [D, Hkv, Dh] and conv kernels [w, Hkv, Dh]: axis 1
      _put(out, f"{block}/mixer/{mine}", _fit(value, dst, 1 if kv else None, groups))
      carried.append(f"{block}/mixer/{mine}")
  return out, carried


def _paths(tree, prefix: str) -> list[str]:
  """"prefix/a/b" of every array leaf under a nested dict."""
  if not isinstance(tree, Mapping):
    return [prefix]
  return [p for key, sub in tree.items() for p in _paths(sub, f"{prefix}/{key}")]


def _to_numpy(tree):
  """A copy of a nested dict with host arrays at its leaves (keys as they are)."""
  if isinstance(tree, Mapping):
    return {k: _to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree)
