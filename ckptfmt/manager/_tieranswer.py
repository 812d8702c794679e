"""The holder's side of an elastic restore through the tiers (FORMAT.md 8.5, "Elastic restore"):
what a process answers for the pieces a peer reads from the host repositories it holds, and the
one message that carries the answers.

Message layout (little-endian; it is not stored and never leaves one restore of one ckptfmt
version)::

    b"ckptans1"  header length (u64)  header (msgpack)  every chunk's stored bytes, back to back

The header lists, per host repository, the asked step's manifest as stored, the chunk refs
(key path, chunk row), each chunk's byte count and the global state as stored. The holder reads
each chunk from storage straight into its place in the message (checked there against its own
manifest) and the message is 64-byte aligned, so JAX's exchange offers it without a copy; the
receiver takes each chunk as a view of the message after checking that the counts cover the
body exactly, and checks every chunk itself (:func:`~ckptfmt.manager._tierrestore.accept_replica`).
"""
from __future__ import annotations

import logging
import struct
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import CheckpointError, InvalidStateError
from ckptfmt.manager._tierrestore import MAX_ASK_BYTES, ask_limits
from ckptfmt.reader._alloc import aligned_empty
from ckptfmt.repository import Repository

__all__ = ["serve_hosts", "pack_answers", "unpack_answers"]

_log = logging.getLogger("ckptfmt.manager")

_ANSWER_MAGIC = b"ckptans1"
_ANSWER_HEAD = len(_ANSWER_MAGIC) + 8


def _message(heads: Sequence[tuple[int, Mapping[str, Any], Sequence[int]]]) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """An answer message with room for the chunks of each ``(host, answer, chunk sizes)`` (the
    answer's manifest, refs and state go in the header), and the place of each chunk (a view)."""
    header = msgpack.packb({"answers": [[int(h), {"manifest": doc.get("manifest"), "refs": doc.get("refs") or [],
                                                  "sizes": [int(x) for x in sizes], "state": doc.get("state")}]
                                        for h, doc, sizes in heads]}, use_bin_type=True)
    at = _ANSWER_HEAD + len(header)
    # 64-byte aligned: XLA on CPU adopts the buffer (JAX's exchange offers it without a copy).
    buf = aligned_empty((at + sum(int(x) for _, _, sizes in heads for x in sizes),), np.dtype(np.uint8))
    buf[:len(_ANSWER_MAGIC)] = np.frombuffer(_ANSWER_MAGIC, dtype=np.uint8)
    buf[len(_ANSWER_MAGIC):_ANSWER_HEAD] = np.frombuffer(struct.pack("<Q", len(header)), dtype=np.uint8)
    buf[_ANSWER_HEAD:at] = np.frombuffer(header, dtype=np.uint8)
    places: list[list[np.ndarray]] = []
    for _, _, sizes in heads:
        places.append([])
        for x in sizes:
            places[-1].append(buf[at:at + int(x)])
            at += int(x)
    return buf, places


def pack_answers(answers: Sequence[tuple[int, Mapping[str, Any]]]) -> np.ndarray:
    """One message of answers ``(host, answer)`` (``manifest``, ``refs``, ``chunks``, ``state``), each chunk copied once into its place
    (``numpy.copyto`` releases the GIL)."""
    chunks = [[np.frombuffer(c, dtype=np.uint8) for c in doc.get("chunks") or []] for _, doc in answers]
    buf, places = _message([(h, doc, [c.size for c in cs]) for (h, doc), cs in zip(answers, chunks)])
    for cs, ps in zip(chunks, places):
        for c, p in zip(cs, ps):
            np.copyto(p, c)
    return buf


def unpack_answers(message: Any) -> dict[int, dict[str, Any]]:
    """host -> its answer (``chunks``: views of ``message``) of a :func:`pack_answers` message,
    every count checked against the message first. Raises InvalidStateError when it does not
    decode (another process's bytes: untrusted)."""
    buf = np.frombuffer(memoryview(message).cast("B"), dtype=np.uint8)
    size = int(buf.size)
    n = int(struct.unpack("<Q", buf[len(_ANSWER_MAGIC):_ANSWER_HEAD].tobytes())[0]) if size >= _ANSWER_HEAD else -1
    if size < _ANSWER_HEAD or buf[:len(_ANSWER_MAGIC)].tobytes() != _ANSWER_MAGIC or not 0 < n <= min(
            size - _ANSWER_HEAD, MAX_ASK_BYTES):
        raise InvalidStateError("a peer's answer is not a tier answer", object="tiers answer",
                                expected=f"{_ANSWER_MAGIC!r}, a header of at most {MAX_ASK_BYTES} bytes",
                                found=f"{size} bytes")
    head = memoryview(buf[_ANSWER_HEAD:_ANSWER_HEAD + n])
    doc = msgpack.unpackb(head, raw=False, **ask_limits(n))
    out: dict[int, dict[str, Any]] = {}
    at = _ANSWER_HEAD + n
    for h, a in doc["answers"]:
        sizes = [int(x) for x in a["sizes"]]
        if any(x < 0 for x in sizes) or len(sizes) != len(a["refs"]) or at + sum(sizes) > size:
            raise InvalidStateError("a peer's answer lists chunks its body does not hold", object="tiers answer",
                                    expected=f"{size - at} bytes of chunks", found=f"{sum(sizes)} bytes in {len(sizes)}")
        chunks = []
        for x in sizes:
            chunks.append(buf[at:at + x])
            at += x
        out[int(h)] = {"manifest": a["manifest"], "refs": a["refs"], "chunks": chunks, "state": a["state"]}
    if at != size:
        raise InvalidStateError("a peer's answer holds bytes no chunk lists", object="tiers answer",
                                expected=f"{at} bytes", found=f"{size} bytes")
    return out


#: One held repository's part of an answer: host, its open step, per asked part the stored
#: chunks it touches (each chunk once), and the answer's header fields.
_Held = tuple[int, Any, list[tuple[tuple[str, Box], list[tuple[str, int]]]], dict[str, Any]]


def _held(repo: Repository, step: int, reqs: Sequence[tuple[str, Box]], host: int) -> _Held:
    """What ``repo`` answers for the parts ``reqs`` of its step ``step``; a part whose chunks do
    not plan is left out (logged). Raises the CheckpointError of opening the step."""
    ckpt = repo.open(step)  # one read of the manifest: the bytes sent are the ones its chunks are checked against
    seen: dict[tuple[str, int], None] = {}
    groups = []
    for req in reqs:
        try:
            mine = [r for r in ckpt.chunk_refs([req]) if r not in seen]
        except CheckpointError as e:
            _log.warning("local tier: %s does not serve %s of step %d to its peer: %s: %s", repo.url, req[0], step,
                         type(e).__name__, e)
            continue
        seen.update(dict.fromkeys(mine))
        groups.append((req, mine))
    return host, ckpt, groups, {"manifest": ckpt.manifest_bytes, "state": ckpt.state_bytes("global")}


def _answer(held: Sequence[_Held]) -> np.ndarray:
    """The message answering for ``held``: each chunk read from storage straight into its place
    and checked there (``Checkpoint.read_chunks(into=...)``); a part that does not read is left
    out (logged; the message is then packed again without it)."""
    heads = []
    for h, ckpt, groups, doc in held:
        refs = [r for _, rs in groups for r in rs]
        heads.append((h, {**doc, "refs": [[k, c] for k, c in refs]}, [ckpt.chunk_nbytes(r) for r in refs]))
    buf, places = _message(heads)
    kept, failed = [], False
    for (h, ckpt, groups, doc), ps in zip(held, places):
        at, refs, chunks = 0, [], []
        for req, rs in groups:
            views = ps[at:at + len(rs)]
            at += len(rs)
            try:
                ckpt.read_chunks(rs, into=views)
            except CheckpointError as e:
                _log.warning("local tier: host %d does not serve %s of step %d to its peer: %s: %s", h, req[0],
                             ckpt.step, type(e).__name__, e)
                failed = True
                continue
            refs += rs
            chunks += views
        kept.append((h, {**doc, "refs": [[k, c] for k, c in refs], "chunks": chunks}))
    return pack_answers(kept) if failed else buf


def serve_hosts(repos: Mapping[int, Repository], payload: Any) -> np.ndarray:
    """This process's answer to one peer's ask: per asked host repository it holds, the asked
    step's manifest as stored, the stored chunks of the asked parts (each read straight into its
    place in the message and checked there against that manifest) and the global state as stored,
    all in one :func:`pack_answers` message; a repository it does not hold, or a part that does
    not read, is left out (logged). Never raises: a holder that fails answers with what it has
    (the asker checks everything and asks the next tier for the rest)."""
    held: list[_Held] = []
    try:
        size = len(memoryview(payload).cast("B"))
        if size > MAX_ASK_BYTES:
            raise InvalidStateError("a peer's ask is larger than the cap", object="tiers ask",
                                    expected=f"<= {MAX_ASK_BYTES} bytes", found=size)
        ask = msgpack.unpackb(payload, raw=False, **ask_limits(size))
        step, want_state = int(ask["step"]), bool(ask.get("state"))
        for h, parts in ask["hosts"]:
            repo = repos.get(int(h))
            if repo is None:
                continue
            try:
                held.append(_held(repo, step, [(str(k), Box(tuple(o), tuple(n))) for k, o, n in parts], int(h)))
            except Exception as e:  # noqa: BLE001 - the asker then reads the persistent tier
                _log.warning("local tier: %s cannot serve step %d to a peer: %s: %s", repo.url, step,
                             type(e).__name__, e)
        if want_state and not held:  # only the global state was asked: any held repository's
            for h in sorted(repos):
                try:
                    held.append(_held(repos[h], step, [], int(h)))
                    break
                except Exception:  # noqa: BLE001 - try the next
                    continue
    except Exception as e:  # noqa: BLE001 - an ask that does not decode: answer with nothing
        _log.warning("local tier: a peer's ask is refused: %s: %s", type(e).__name__, e)
        held = []
    return _answer(held)
