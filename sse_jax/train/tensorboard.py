"""TensorBoard scalar event files with no dependency (no TensorFlow, no tensorboardX).

An event file is a TFRecord stream; each record is

    uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

(little endian), where data is a serialised `tensorboard.Event` protobuf. We encode the
few fields we need by hand (field numbers from tensorboard's event.proto / summary.proto):

    Event       1 wall_time double, 2 step int64, 3 file_version string (first record),
                5 summary Summary, 7 session_log SessionLog
    Summary     1 value repeated Summary.Value
    Value       1 tag string, 2 simple_value float
    SessionLog  1 status enum (START = 1)

A SessionLog START at step s makes TensorBoard drop the events with step >= s that an
earlier (killed) run wrote: a resumed run writes one at its first new step.
`read_events` decodes files written here (checking both CRCs), for tests and scripts.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Iterator, Mapping

FILE_VERSION = "brain.Event:2"
SESSION_START = 1


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
    table.append(c)
  return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  c = 0xFFFFFFFF
  for byte in data:
    c = _TABLE[(c ^ byte) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's CRC: rotated and offset so that CRCs of CRCs do not look like data."""
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- protobuf wire format: (field << 3 | wire type) then the payload -------------------
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
  if n < 0:
    n += 1 << 64  # int64 two's complement, as protobuf does
  out = bytearray()
  while True:
    low, n = n & 0x7F, n >> 7
    out.append(low | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _key(field: int, wire: int) -> bytes:
  return _varint(field << 3 | wire)


def _bytes_field(field: int, payload: bytes) -> bytes:
  return _key(field, _BYTES) + _varint(len(payload)) + payload


def encode_event(step: int, wall_time: float, *, scalars: Mapping[str, float] | None = None,
                 file_version: str | None = None, session_start: bool = False) -> bytes:
  """One serialised Event: header fields and at most one of its payloads (the bytes
  protobuf itself writes for the same message)."""
  data = _key(1, _FIXED64) + struct.pack("<d", wall_time)
  if step:  # proto3 leaves default values out
    data += _key(2, _VARINT) + _varint(step)
  if file_version is not None:
    data += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, _FIXED32) +
                     struct.pack("<f", float(value)))
        for tag, value in scalars.items())
    data += _bytes_field(5, values)
  if session_start:
    data += _bytes_field(7, _key(1, _VARINT) + _varint(SESSION_START))
  return data


def frame(data: bytes) -> bytes:
  """One TFRecord record around `data`."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data +
          struct.pack("<I", masked_crc32c(data)))


class EventWriter:
  """Appends scalar summaries to a new events file in `logdir`.

      writer = EventWriter(workdir + "/tb")
      writer.scalars(step, {"train/loss": 2.1, "train/lr": 3e-3})
      writer.close()
  """

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
    self.path = os.path.join(logdir, name)
    self._file = open(self.path, "ab")
    self._write(encode_event(0, time.time(), file_version=FILE_VERSION))

  def _write(self, data: bytes) -> None:
    self._file.write(frame(data))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self._write(encode_event(step, time.time(), scalars=values))

  def session_start(self, step: int) -> None:
    """Tells TensorBoard to forget what earlier runs logged at steps >= `step`."""
    self._write(encode_event(step, time.time(), session_start=True))

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


# --- reading back --------------------------------------------------------------------


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  shift = result = 0
  while True:
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return result, pos


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
  """(field, wire type, value) of one protobuf message: ints for varints, bytes else."""
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wire = key >> 3, key & 7
    if wire == _VARINT:
      value, pos = _read_varint(buf, pos)
    elif wire == _FIXED64:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == _FIXED32:
      value, pos = buf[pos:pos + 4], pos + 4
    elif wire == _BYTES:
      size, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + size], pos + size
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    yield field, wire, value


def decode_event(data: bytes) -> dict:
  """An Event as dict(step, wall_time, file_version?, scalars {tag: float}, session_start)."""
  event = {"step": 0, "wall_time": 0.0, "scalars": {}, "session_start": False}
  for field, _, value in _fields(data):
    if field == 1:
      event["wall_time"] = struct.unpack("<d", value)[0]
    elif field == 2:
      event["step"] = value
    elif field == 3:
      event["file_version"] = value.decode()
    elif field == 5:
      for _, _, item in _fields(value):
        parts = {f: v for f, _, v in _fields(item)}
        event["scalars"][parts[1].decode()] = struct.unpack("<f", parts[2])[0]
    elif field == 7:
      event["session_start"] = dict((f, v) for f, _, v in _fields(value)).get(1) == SESSION_START
  return event


def read_events(path: str) -> list[dict]:
  """All events of one file (see `decode_event`); raises ValueError on a bad CRC."""
  with open(path, "rb") as f:
    buf = f.read()
  events, pos = [], 0
  while pos < len(buf):
    header = buf[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (header_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
    data = buf[pos + 12:pos + 12 + length]
    (data_crc,) = struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])
    if header_crc != masked_crc32c(header) or data_crc != masked_crc32c(data):
      raise ValueError(f"{path}: corrupt record at byte {pos} (CRC mismatch)")
    events.append(decode_event(data))
    pos += 16 + length
  return events
