"""sse_jax.train pieces in process (no training runs, see test_train_runs.py): the
TensorBoard writer, the config, the optimizer, the metrics and the logs."""

from __future__ import annotations

import json
import logging as std_logging
import math
import os
import re
import struct

from absl import logging as absl_logging
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sse_jax.model import ModelOutput
from sse_jax.train import config as config_lib
from sse_jax.train import CheckpointError, default_config, load_state
from sse_jax.train import logs, metrics, optim, tensorboard


# --- TensorBoard -----------------------------------------------------------------------


def test_crc32c_known_answers():
  assert tensorboard.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
  assert tensorboard.crc32c(b"") == 0


# Expected bytes below were captured once from tensorboard 2.x (protobuf 7):
# event_pb2.Event(...).SerializeToString() and record_writer.RecordWriter framing.
SCALAR_EVENT = "09000000000000f83f10072a0c0a0a0a03612f62150000803e"


def test_events_encode_like_protobuf():
  assert tensorboard.encode_event(7, 1.5, scalars={"a/b": 0.25}).hex() == SCALAR_EVENT
  assert tensorboard.encode_event(3, 2.0, session_start=True).hex() == (
      "09000000000000004010033a020801")
  assert tensorboard.encode_event(0, 2.0, file_version="brain.Event:2").hex() == (
      "0900000000000000401a0d627261696e2e4576656e743a32")


def test_record_framing_like_tensorboard():
  framed = tensorboard.frame(bytes.fromhex(SCALAR_EVENT)).hex()
  assert framed == "19000000000000008bf10828" + SCALAR_EVENT + "6b4dbd8e"
  assert struct.unpack("<I", bytes.fromhex(framed[16:24]))[0] == tensorboard.masked_crc32c(
      struct.pack("<Q", 0x19))


def test_event_file_round_trip(tmp_path):
  writer = tensorboard.EventWriter(str(tmp_path))
  values = [{"train/loss": 1.0 / s, "train/lr": 3e-3 * s} for s in range(1, 4)]
  for step, v in enumerate(values, 1):
    writer.scalars(step, v)
  writer.session_start(2)
  writer.scalars(300_000, {"big/step": -2.5})
  writer.close()
  (name,) = os.listdir(tmp_path)
  assert name.startswith("events.out.tfevents.")
  events = tensorboard.read_events(writer.path)
  assert events[0]["file_version"] == "brain.Event:2"
  assert [e["step"] for e in events[1:]] == [1, 2, 3, 2, 300_000]
  for event, v in zip(events[1:4], values):
    assert event["scalars"] == {k: float(np.float32(x)) for k, x in v.items()}
  assert events[4]["session_start"] and not events[4]["scalars"]
  assert events[5]["scalars"] == {"big/step": -2.5}
  assert all(e["wall_time"] > 1e9 for e in events)

  data = bytearray(open(writer.path, "rb").read())
  data[-6] ^= 0xFF  # flip a byte inside the last record's payload
  open(writer.path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="CRC mismatch"):
    tensorboard.read_events(writer.path)


# --- config ----------------------------------------------------------------------------


def test_default_config_is_valid_and_documented():
  config = default_config()
  config_lib.validate(config)
  doc = default_config.__doc__
  names = list(config.keys()) + list(config.model.keys()) + list(config.mesh.keys())
  for field in names:
    assert re.search(rf"\n +(\w+, )*{field}[ ,]", doc), f"field {field} is not documented"
  model = config_lib.model_config(config)
  assert model.vocab_size == config.data.vocab_size == 128  # inferred from the MQAR data
  assert model.pattern == "SS" and model.sse.top_k == 1


@pytest.mark.parametrize("field,value,message", [
    ("batch_size", 0, "batch_size=0 must be an integer >= 1"),
    ("data_workers", -1, "data_workers=-1 must be an integer >= 0"),
    ("lr", 0.0, "lr=0.0 must be > 0"),
    ("compute_dtype", "float16", "compute_dtype='float16' must be one of"),
    ("min_lr_ratio", 2.0, "min_lr_ratio=2.0 must lie in"),
    ("mesh", {"data": 0, "model": 1}, "needs data >= 1 or -1"),
    ("num_steps", 100, r"warmup_steps=100 must be < num_steps \(100\)"),
])
def test_bad_values_are_named(field, value, message):
  config = default_config()
  config[field] = value
  with pytest.raises(ValueError, match=message):
    config_lib.validate(config)


def test_unknown_fields_and_small_vocab_are_errors():
  config = default_config()
  config.learning_rate = 1e-3
  with pytest.raises(ValueError, match=r"\['learning_rate'\] are unknown"):
    config_lib.validate(config)
  config = default_config()
  config.model.vocab_size = 64
  with pytest.raises(ValueError, match="smaller than the data's vocabulary"):
    config_lib.model_config(config)
  config.data = {"kind": "shakespeare"}
  config.model.vocab_size = None
  assert config_lib.model_config(config).vocab_size == 256


def test_eval_data_defaults_to_a_held_out_stream():
  config = default_config()
  assert config_lib.eval_data_config(config) == {**config.data.to_dict(),
                                                 "split": "validation"}
  config.data = {"kind": "retrieval", "split": "validation", "seed": 3}
  assert config_lib.eval_data_config(config)["seed"] == 4  # already validation: new seed
  config.data = {"kind": "retrieval"}  # its default split is validation: new seed too
  assert config_lib.eval_data_config(config) == {"kind": "retrieval", "seed": 1}
  # A missing split is the kind's default (train): evaluation reads validation.
  for kind in ("mqar", "shakespeare", "tfds"):
    config.data = {"kind": kind, "seq_len": 32}
    assert config_lib.eval_data_config(config) == {"kind": kind, "seq_len": 32,
                                                   "split": "validation"}
  config.data = {"kind": "shakespeare", "split": "validation"}  # nothing held out
  with pytest.raises(ValueError, match="eval_data"):
    config_lib.eval_data_config(config)
  config.eval_data = {"kind": "mqar", "split": "test"}
  assert config_lib.eval_data_config(config) == {"kind": "mqar", "split": "test"}


def test_fingerprint_ignores_run_control_and_diff_names_fields():
  a, b = default_config(), default_config()
  b.eval_every, b.progress, b.mesh.data, b.tags.note = 7, False, 2, "x"
  assert config_lib.fingerprint(a) == config_lib.fingerprint(b)
  b.model.vocab_size = 128  # the value None resolves to: same model
  assert config_lib.fingerprint(a) == config_lib.fingerprint(b)
  b.model.hidden, b.lr = 32, 1.0
  assert config_lib.diff(config_lib.fingerprint(a), config_lib.fingerprint(b)) == [
      "lr: 0.003 in the checkpoint, 1.0 now",
      "model.hidden: 64 in the checkpoint, 32 now"]


# --- optimizer -------------------------------------------------------------------------


def test_schedule_warmup_cosine_floor():
  config = default_config()
  config.lr, config.warmup_steps, config.num_steps, config.min_lr_ratio = 1.0, 10, 110, 0.1
  lr = optim.schedule(config)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(5)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(lr(10)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(lr(60)), 0.1 + 0.9 * 0.5, rtol=1e-6)  # half-way
  np.testing.assert_allclose(float(lr(110)), 0.1, rtol=1e-6)


def test_weight_decay_skips_norm_scales_and_biases():
  config = default_config()
  config.lr, config.warmup_steps, config.num_steps = 0.5, 0, 10
  config.weight_decay, config.grad_clip = 0.1, 0.0
  params = {"embed": jnp.ones((3, 2)), "norm": {"scale": jnp.ones((2,))},
            "gate": {"bias": jnp.ones((2, 2)), "kernel": jnp.ones((2, 2))}}
  assert optim.decay_mask(params) == {"embed": True, "norm": {"scale": False},
                                      "gate": {"bias": False, "kernel": True}}
  tx = optim.optimizer(config)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  # Zero gradients: Adam's step is 0, so only the decoupled decay lr * wd * p moves p.
  np.testing.assert_allclose(new["embed"], 1 - 0.5 * 0.1, rtol=1e-6)
  np.testing.assert_allclose(new["gate"]["kernel"], 0.95, rtol=1e-6)
  np.testing.assert_array_equal(new["norm"]["scale"], 1.0)
  np.testing.assert_array_equal(new["gate"]["bias"], 1.0)


def test_gradient_clipping_scales_the_gradient():
  # b1 = 0 and a huge eps make Adam's step ~ lr * g / eps: linear in the clipped g.
  config = default_config()
  config.lr, config.warmup_steps, config.num_steps = 1.0, 0, 10
  config.b1, config.eps, config.weight_decay = 0.0, 1e6, 0.0
  params = {"kernel": jnp.zeros((4,))}
  grads = {"kernel": jnp.array([30.0, 40.0, 0.0, 0.0])}  # norm 50
  steps = {}
  for clip in (0.0, 1.0):
    config.grad_clip = clip
    tx = optim.optimizer(config)
    steps[clip], _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(steps[0.0]["kernel"], -np.array([30, 40, 0, 0]) / 1e6,
                             rtol=1e-3)
  np.testing.assert_allclose(steps[1.0]["kernel"], -np.array([0.6, 0.8, 0, 0]) / 1e6,
                             rtol=1e-3)


# --- metrics ---------------------------------------------------------------------------


def fake_output(logits, usage=(), aux=0.0):
  return ModelOutput(jnp.asarray(logits, jnp.float32), jnp.float32(aux),
                     tuple(jnp.asarray(u, jnp.float32) for u in usage), ())


def test_train_metrics_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
  targets[0, 1] = logits[0, 1].argmax()  # at least one correct weighted position
  weights = np.zeros((2, 5), np.float32)
  weights[0, [1, 3]] = 1
  weights[1, 4] = 1
  batch = {"targets": jnp.asarray(targets), "weights": jnp.asarray(weights)}
  m = metrics.train_metrics(fake_output(logits, aux=0.25), batch)

  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  want_ce = (ce * weights).sum() / weights.sum()
  correct = logits.argmax(-1) == targets
  np.testing.assert_allclose(float(m["ce"]), want_ce, rtol=1e-5)
  np.testing.assert_allclose(float(m["loss"]), want_ce + 0.25, rtol=1e-5)
  np.testing.assert_allclose(float(m["accuracy"]),
                             (correct * weights).sum() / weights.sum(), rtol=1e-6)
  exact = [all(correct[b][weights[b] > 0]) for b in range(2)]
  np.testing.assert_allclose(float(m["exact_match"]), np.mean(exact), rtol=1e-6)


def test_router_stats_balanced_and_collapsed():
  balanced = metrics.router_stats([0.5, 0.5, 0.5, 0.5])  # top-2 of 4, even
  assert balanced == {"usage": [0.5] * 4, "entropy": 1.0, "max": 0.5}
  collapsed = metrics.router_stats([1.0, 0.0, 0.0, 0.0])
  assert collapsed["entropy"] == 0.0 and collapsed["max"] == 1.0
  mixed = metrics.router_stats([0.5, 0.25, 0.25, 0.0])
  p = np.array([0.5, 0.25, 0.25])
  assert math.isclose(mixed["entropy"], -(p * np.log(p)).sum() / math.log(4))


def test_finish_eval_weights_batches_by_tokens():
  # Batch 1: 2 scored tokens, CE sum 2.0, 1 correct; batch 2: 6 tokens, CE sum 3.0, 6 correct.
  b1 = dict(ce_sum=2.0, correct_sum=1.0, weight_sum=2.0, exact_sum=0, scored_sum=1,
            aux_loss=0.1, router_usage=(np.array([1.0, 0.0]),))
  b2 = dict(ce_sum=3.0, correct_sum=6.0, weight_sum=6.0, exact_sum=2, scored_sum=2,
            aux_loss=0.3, router_usage=(np.array([0.5, 0.5]),))
  out = metrics.finish_eval([b1, b2], routed_layers=(3,), byte_level=True)
  assert math.isclose(out["ce"], 5.0 / 8.0)
  assert math.isclose(out["loss"], 5.0 / 8.0 + 0.2)
  assert math.isclose(out["accuracy"], 7.0 / 8.0)
  assert math.isclose(out["exact_match"], 2.0 / 3.0)
  assert math.isclose(out["bpb"], 5.0 / 8.0 / math.log(2))
  assert out["router"] == [{"layer": 3, "usage": [0.75, 0.25],
                            "entropy": pytest.approx(0.8112781244591328), "max": 0.75}]
  assert metrics.flat_scalars("eval", out)["eval/router_L3/max"] == 0.75


# --- logs ------------------------------------------------------------------------------


def test_metrics_log_resume_drops_later_records(tmp_path):
  log = logs.MetricsLog(str(tmp_path), active=True, resume_step=None)
  for step in (1, 2, 3, 4):
    log.write({"kind": "train", "step": step, "loss": 1.0 / step})
  log.write({"kind": "eval", "step": 4, "train_loss": 0.5, "loss": 0.4, "accuracy": 0.9,
             "router": [{"layer": 0, "usage": [1.0], "entropy": 1.0, "max": 1.0}]})
  log.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"kind": "train", "st')  # torn line of a killed run
  resumed = logs.MetricsLog(str(tmp_path), active=True, resume_step=2)
  resumed.close()
  records = logs.read_records(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2]

  again = logs.MetricsLog(str(tmp_path), active=False, resume_step=None)
  again.write({"kind": "eval", "step": 4, "train_loss": 0.5, "loss": 0.4, "accuracy": 0.9,
               "router": []})
  assert again.history() == [{"step": 4, "train_loss": 0.5, "eval_loss": 0.4,
                              "eval_accuracy": 0.9, "router": []}]
  tb_files = os.listdir(tmp_path / "tb")
  assert len(tb_files) == 2  # one per active writer; the inactive one wrote nothing
  starts = [e for f in tb_files for e in tensorboard.read_events(str(tmp_path / "tb" / f))
            if e["session_start"]]
  assert sorted(e["step"] for e in starts) == [1, 3]  # fresh start, resumed after 2


def test_progress_line(caplog):
  progress = logs.Progress(1000, active=True)
  assert progress.line(250, 2.34567, 5.0, 12_345.6) == (
      "[train] step 250/1000 (25%) | 5.00 steps/s | 12,346 tok/s | loss 2.3457 | ETA 2m30s")
  # A window of the first (compiling) step alone has no rate.
  assert progress.line(1, 2.5, None, None, 6.25) == (
      "[train] step 1/1000 (0%) | first step in 6.2s (compiling) | loss 2.5000")
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.WARNING)  # as the ablation runner sets it
  try:
    with caplog.at_level(std_logging.INFO, logger="absl"):
      progress.update(250, 2.34567, 5.0, 12_345.6)
      logs.Progress(10, active=False).update(1, 1.0, 1.0, 1.0)
  finally:
    absl_logging.set_verbosity(verbosity)
  # Written through absl's logger whatever its verbosity; config.progress switches it.
  assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
      ("absl", std_logging.INFO, progress.line(250, 2.34567, 5.0, 12_345.6))]


def test_load_state_without_checkpoints(tmp_path):
  with pytest.raises(CheckpointError, match=r"no checkpoints in workdir .*checkpoints is missing"):
    load_state(default_config(), str(tmp_path / "nothing"))
  assert not (tmp_path / "nothing").exists()


def test_config_json_round_trip(tmp_path):
  config = default_config()
  config.model.pattern, config.lr, config.eval_data = "SGA", 0.5, {"kind": "mqar"}
  config.model.attention = {}
  path = tmp_path / "config.json"
  path.write_text(config.to_json())
  loaded = config_lib.from_json(str(path))
  assert json.loads(loaded.to_json()) == json.loads(config.to_json())
  assert config_lib.fingerprint(loaded) == config_lib.fingerprint(config)
  for text, words in (("[1, 2]", "holds a list"), ("{", "is not JSON")):
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{path} {words}")):
      config_lib.from_json(str(path))
  with pytest.raises(ValueError, match="cannot read .*nothing.json: No such file"):
    config_lib.from_json(str(tmp_path / "nothing.json"))


def test_bf16_compute_keeps_fp32_master_weights():
  """compute_dtype="bfloat16": parameters and optimizer state stay float32 (the
  master weights), while the step's matmuls run on bf16 operands."""
  from sse_jax import train  # pylint: disable=g-import-not-at-top
  config = default_config()
  config.model.hidden, config.model.mlp_dim, config.batch_size = 32, 64, 4
  config.compute_dtype = "bfloat16"
  program = train.build(config)
  target = program.restore_target()
  floats = [x.dtype for x in jax.tree.leaves(target) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and set(floats) == {jnp.dtype("float32")}, set(floats)

  def dot_dtypes(compute_dtype):
    config.compute_dtype = compute_dtype
    program = train.build(config)
    with jax.set_mesh(program.mesh):
      text = program.train_step.lower(
          program.restore_target(), program.abstract_batch(64, config.batch_size)).as_text()
    return re.findall(r"stablehlo.dot_general .*-> tensor<[\dx]*x(\w+)>", text)

  bf16, fp32 = dot_dtypes("bfloat16"), dot_dtypes("float32")
  assert bf16.count("bf16") > len(bf16) // 2, bf16
  assert fp32 and "bf16" not in fp32, fp32
