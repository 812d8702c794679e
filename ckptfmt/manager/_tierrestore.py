"""Restoring through the tiers (FORMAT.md 8.5): for each box the fastest copy that verifies.

Call order (every rank; the collectives are the manager's coordinator for metadata and the
bridge's :class:`~ckptfmt.manager._tiers.PeerExchange` for tensor bytes):

1. ``allgather("tiers/restore/<n>/inventory")``: each rank lists the local steps its own tier
   holds (token, hosts, and the boxes of each owner; a step whose manifest or state does not
   verify is left out).
2. Each rank decides, from the gathered inventories, the persistent tier as it lists it, and its
   own requests (the boxes its target needs), which steps it could restore: every request held
   by its own tier, by its holder's (rank - 1) replica, or by the persistent tier, all with the
   step's token (the persistent manifest's token when it has one, else the lowest rank's). A
   local tier holds a request when one of its held boxes contains it or several of them tile it
   exactly (:func:`cover`; the read then assembles those parts). Then
   ``allgather("tiers/restore/<n>/feasible")``; the step is the newest one feasible on every rank
   (none, or an older one than the newest persistent step: the ordinary restore runs instead).
3. Own reads (verified by the core reader); a box that fails verification is logged and asked of
   the next tier. ``shift(-1)`` sends each rank's ask (step, token, the parts of its holder's
   local tensors that cover its requests, from the holder's inventory) to its holder, which reads
   the stored chunks and answers over ``shift(+1)`` with them, its manifest and its global state
   as stored (:func:`serve_replica`). The receiving rank checks everything itself
   (:func:`accept_replica`): the manifest is the one the holder listed (SHA-256) and records the
   asked step, token, host and host count, and every chunk passes the same checks against it as
   a chunk read from storage. An answer of another step or save raises StepMismatchError (the
   restore through the tiers then fails on every rank, and the ordinary restore runs); a chunk
   that fails is left to the next tier.
4. The persistent tier serves what is left (verified). ``allgather("tiers/restore/<n>/done")``
   of every rank's outcome: when any rank failed, every rank returns None and the manager runs
   its ordinary restore, so a damaged local tier never fails a restore.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.errors import CheckpointError, InvalidStateError, MissingShardError, StepMismatchError
from ckptfmt.manager._tiers import TIERS_KEY, HeldBox, TierWriter
from ckptfmt.manifest import parse_manifest
from ckptfmt.reader import Checkpoint, check_state_bytes
from ckptfmt.repository import Repository
from ckptfmt.state import decode_state

__all__ = ["inventory", "feasible_steps", "tiered_read", "cover", "by_key", "held_tensors", "serve_replica",
           "accept_replica", "answer_parts", "persistent_token", "step_token", "ask_limits"]

_log = logging.getLogger("ckptfmt.manager")
Request = tuple[str, Box]
#: Largest ask a holder decodes: a rank's requests as (local key, offset, shape) triples.
MAX_ASK_BYTES = 16 << 20


def inventory(repo: Repository) -> dict[int, dict[str, Any]]:
    """The local steps ``repo`` holds: step -> {token, hosts, boxes (wire)}; unreadable steps left out."""
    out: dict[int, dict[str, Any]] = {}
    try:
        steps = repo.steps()
    except CheckpointError as e:
        _log.warning("local tier %s does not list: %s", repo.url, e)
        return out
    for s in steps:
        try:
            ckpt = repo.open(s)
            t = ckpt.state()["tiers"]
            out[s] = {"token": str(t["token"]), "hosts": int(t["hosts"]), "boxes": list(t["boxes"]),
                      "digest": hashlib.sha256(ckpt.manifest_bytes).hexdigest(), "run": t.get("run")}
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            _log.warning("local tier %s: step %d is left out: %s: %s", repo.url, s, type(e).__name__, e)
    return out


def persistent_token(repo: Repository, step: int) -> str | None:
    """The tier token a persistent step recorded (metadata), or None."""
    try:
        meta = repo.manifest(step).metadata.get(TIERS_KEY)
    except CheckpointError:
        return None
    return str(meta["token"]) if isinstance(meta, Mapping) and "token" in meta else None


def step_token(step: int, invs: Sequence[Mapping[int, Any]], ptoken: str | None) -> str | None:
    """The token every copy of ``step`` used by a restore must carry."""
    if ptoken is not None:
        return ptoken
    for inv in invs:
        if step in inv:
            return str(inv[step]["token"])
    return None


def held_tensors(invs: Sequence[Mapping[int, Any]]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The global tensors the gathered inventories hold: key -> (global shape, dtype name), as the
    newest step listing the key records it (what a bridge that maps its target plans against)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for s in sorted({s for inv in invs for s in inv}, reverse=True):
        for inv in invs:
            for w in (inv.get(s) or {}).get("boxes", ()):
                try:
                    h = HeldBox.from_wire(w)
                except (CheckpointError, TypeError, ValueError):
                    continue
                out.setdefault(h.key, (h.shape, h.dtype))
    return out


def held(inv: Mapping[int, Any], step: int, token: str | None, owner: int, world: int) -> list[HeldBox]:
    e = inv.get(step)
    if e is None or token is None or e["token"] != token or int(e["hosts"]) != world:
        return []
    return [h for h in (HeldBox.from_wire(w) for w in e["boxes"]) if h.owner == owner]


#: How one tier serves one request: held boxes and the part of the request (global coordinates) each serves.
Cover = list[tuple[HeldBox, Box]]


def by_key(boxes: Sequence[HeldBox]) -> dict[str, list[HeldBox]]:
    """Held boxes grouped by global key path (what :func:`cover` takes)."""
    out: dict[str, list[HeldBox]] = {}
    for h in boxes:
        out.setdefault(h.key, []).append(h)
    return out


def cover(index: Mapping[str, Sequence[HeldBox]], key: str, box: Box) -> Cover | None:
    """How the held boxes of ONE tier (``index``: :func:`by_key`) serve ``(key, box)``: one held box
    that contains it, else disjoint parts of several whose sizes add up to the box's (they tile it
    exactly); None when they do not. Pure: the feasibility check and the read both ask it, so a
    restore plans exactly what the read then does (FORMAT.md 8.5)."""
    boxes = index.get(key, ())
    one = next((h for h in boxes if h.contains(key, box)), None)
    if one is not None:
        return [(one, box)]
    if box.is_empty():
        return None
    parts: Cover = []
    for h in boxes:
        part = h.box.intersect(box) if h.box.ndim == box.ndim else None
        if part is not None and not any(p.intersect(part) is not None for _, p in parts):
            parts.append((h, part))
    return parts if sum(p.size for _, p in parts) == box.size else None


def _assemble(box: Box, parts: Cover, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The request ``box`` from its parts' verified arrays: the array itself for one part, else one
    fresh array. Parts whose dtypes or shapes differ raise InvalidStateError (the tier then fails)."""
    if len(parts) == 1:
        return arrays[0]
    out = np.empty(box.shape, dtype=arrays[0].dtype)
    for (h, part), a in zip(parts, arrays):
        if a.dtype != out.dtype or tuple(a.shape) != part.shape:
            raise InvalidStateError("the held boxes of one request differ", key=h.key, object=h.local,
                                    expected=f"{out.dtype} {part.shape}", found=f"{a.dtype} {tuple(a.shape)}")
        out[part.slices(box.offset)] = a
    return out


def feasible_steps(rank: int, world: int, invs: Sequence[Mapping[int, Any]], requests: Sequence[Request],
                   persistent: Mapping[int, str | None]) -> list[int]:
    """The local steps this rank can restore (newest first), ``persistent``: step -> its token."""
    out = []
    for s in sorted({s for inv in invs for s in inv}, reverse=True):
        token = step_token(s, invs, persistent.get(s))
        mix = s in persistent and persistent[s] == token
        own = by_key(held(invs[rank], s, token, rank, world))
        peer = by_key(held(invs[(rank - 1) % world], s, token, rank, world) if world > 1 else [])
        if not own and not peer:
            continue
        if all(mix or cover(own, k, b) is not None or cover(peer, k, b) is not None for k, b in requests):
            out.append(s)
    return out


def _read_own(repo: Repository, step: int, boxes: Sequence[HeldBox], reqs: Sequence[Request],
              values: dict[Request, np.ndarray]) -> list[Request]:
    """Read ``reqs`` from this rank's own tier into ``values`` (each from the held boxes that
    :func:`cover` it); return those it could not serve."""
    index = by_key(boxes)
    plan = [(r, cover(index, *r)) for r in reqs]
    left = [r for r, c in plan if c is None]
    todo = [(r, c) for r, c in plan if c is not None]
    if not todo:
        return left
    try:
        ckpt = repo.open(step)
    except CheckpointError as e:
        _log.warning("local tier: step %d does not open on %s: %s", step, repo.url, e)
        return left + [r for r, _ in todo]
    try:
        arrays = iter(ckpt.read_boxes([(h.local, h.within(part)) for _, c in todo for h, part in c]))
        for r, c in todo:
            values[r] = _assemble(r[1], c, [next(arrays) for _ in c])
        return left
    except CheckpointError:
        pass  # find the requests that fail, one at a time; the others are still served here
    for r, c in todo:
        try:
            values[r] = _assemble(r[1], c, ckpt.read_boxes([(h.local, h.within(part)) for h, part in c]))
        except CheckpointError as e:
            values.pop(r, None)
            _log.warning("local tier: box %s %s of step %d rejected on %s (%s: %s); the next tier serves it",
                         r[0], list(r[1].offset), step, repo.url, type(e).__name__, e)
            left.append(r)
    return left


def ask_limits(n: int) -> dict[str, int]:
    """msgpack decoding limits for a peer's ask or answer of ``n`` bytes: containers and strings no
    longer than the bytes could describe, so a hostile document costs about its own size (the
    decoder's defaults scale each limit with the buffer; a list of empty lists cost 75x its bytes)."""
    return {"max_array_len": max(16, n // 8), "max_map_len": 16, "max_str_len": 1 << 16, "max_bin_len": n,
            "max_ext_len": 0}


def _peer_ask(step: int, token: str, plan: Sequence[tuple[Request, Cover]]) -> bytes:
    """What a rank asks its holder for: the step and token, and the parts of the holder's local
    tensors (local key path, box within it) that cover its requests."""
    return msgpack.packb({"step": int(step), "token": str(token),
                          "reqs": [[h.local, list(h.within(p).offset), list(p.shape)] for _, c in plan for h, p in c]})


def serve_replica(repo: Repository, asker: int, payload: Any) -> bytes:
    """The holder's answer to its peer's ask (:func:`_peer_ask`): the asked step's manifest as
    stored, the stored chunks of the asked parts (each read and checked against that manifest:
    ``Checkpoint.read_chunks``) and the stored bytes of its global state. Only tensors of owner
    ``asker`` (local key ``h<asker>/...``) are served. Never raises: a holder that fails answers
    with nothing, so both ranks finish the exchange; the peer checks everything it receives
    (:func:`accept_replica`) and asks the persistent tier for the rest."""
    empty = msgpack.packb({"manifest": None, "refs": [], "chunks": [], "state": None}, use_bin_type=True)
    try:
        size = len(memoryview(payload).cast("B"))
        if size > MAX_ASK_BYTES:  # msgpack's own limits scale with the buffer
            raise InvalidStateError("a peer's ask is larger than the cap", object="tiers ask",
                                    expected=f"<= {MAX_ASK_BYTES} bytes", found=size)
        ask = msgpack.unpackb(payload, raw=False, **ask_limits(size))
        reqs = [(str(k), Box(tuple(o), tuple(n))) for k, o, n in ask["reqs"]]
        if not reqs:
            return empty
        # Not the asker's boxes: never served on this (same host count) path.
        return answer_parts(repo, int(ask["step"]), [r for r in reqs if r[0].startswith(f"h{int(asker)}/")])
    except Exception as e:  # noqa: BLE001 - the peer then asks the persistent tier
        _log.warning("local tier: %s cannot serve its peer: %s: %s", repo.url, type(e).__name__, e)
        return empty


def answer_parts(repo: Repository, step: int, reqs: Sequence[tuple[str, Box]]) -> bytes:
    """A holder's answer for the parts ``reqs`` (local key path, box within it) of its local step
    ``step``: the manifest as stored, the stored chunks the parts touch (each read and checked
    against that manifest) and the stored bytes of the global state. A part that does not read is
    left out (logged): the asker's own checks then send it to the next tier. Raises the
    CheckpointError of opening the step."""
    ckpt = repo.open(step)  # one read of the manifest: the bytes sent are the ones its chunks are checked against
    refs: dict[tuple[str, int], None] = {}
    chunks: list[Any] = []
    for req in reqs:
        try:
            mine = [r for r in ckpt.chunk_refs([req]) if r not in refs]
            chunks += [memoryview(c) for c in ckpt.read_chunks(mine)]
            refs.update(dict.fromkeys(mine))
        except CheckpointError as e:
            _log.warning("local tier: %s does not serve %s of step %d to its peer: %s: %s", repo.url, req[0], step,
                         type(e).__name__, e)
    return msgpack.packb({"manifest": ckpt.manifest_bytes, "refs": [[k, c] for k, c in refs], "chunks": chunks,
                          "state": ckpt.state_bytes("global")}, use_bin_type=True)


def accept_replica(answer: Any, *, step: int, token: str, holder: int, world: int, digest: str | None,
                   plan: Sequence[tuple[Request, Cover]], sender: str | None = None,
                   out: Mapping[Request, np.ndarray] | None = None) -> tuple[dict[Request, np.ndarray], Any]:
    """The requests a holder's answer serves, each checked by this process (FORMAT.md 8.5, the
    receiver verifies): the answer's manifest must be the one the holder listed in its inventory
    (``digest``: its SHA-256) and must record ``step``, ``token``, host ``holder`` of ``world``
    hosts; every chunk is checked against that manifest's crc32c, exactly as a chunk read from
    storage (``Checkpoint.read_boxes(supplied=...)``); the global state against its crc32c.
    Raises StepMismatchError when the answer is of another step, save, token or host (nothing of
    it is used); a request whose chunks are missing or fail their checks is left out (logged):
    the next tier serves it. Returns the served values and the holder's global state (or None).
    ``sender``: who sent it, for the errors (default: rank ``holder``). ``out``: arrays (views
    included) to read requests into, each checked chunk copied once into place; a request that
    fails may leave its array partly written (it is not among the values returned)."""
    what = f"the replica host {holder} holds of step {step}"
    try:  # a dict: one answer of several that one message carried, decoded with it (same limits)
        doc = answer if isinstance(answer, dict) else \
            msgpack.unpackb(answer, raw=False, **ask_limits(len(memoryview(answer).cast("B"))))
        if not isinstance(doc, dict):
            raise TypeError(f"a {type(doc).__name__}")
    except Exception as e:  # noqa: BLE001 - another process's bytes: untrusted input
        raise InvalidStateError(f"a holder's answer does not decode: {type(e).__name__}: {e}", object=what,
                                expected="the answer serve_replica packs", found=f"{len(answer)} bytes") from None
    if not plan or doc.get("manifest") is None:
        return {}, None
    data = bytes(doc["manifest"])
    found = hashlib.sha256(data).hexdigest()
    if digest is None or found != digest:
        raise StepMismatchError("the holder answered with another local step than it listed", object=what,
                                expected=f"manifest sha256 {digest}", found=f"manifest sha256 {found}")
    manifest = parse_manifest(data)
    meta = manifest.metadata.get(TIERS_KEY) if isinstance(manifest.metadata, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    want = {"step": int(step), "token": str(token), "host": int(holder), "hosts": int(world)}
    got = {"step": manifest.step, "token": meta.get("token"), "host": meta.get("host"), "hosts": meta.get("hosts")}
    if got != want:
        raise StepMismatchError("the holder answered for another step, save or host", object=what,
                                expected=str(want), found=str(got))
    ckpt = Checkpoint(None, manifest)  # type: ignore[arg-type]  # every chunk comes from the answer
    sender = sender or f"rank {holder} (its local tier)"
    supplied = {(str(k), int(c)): (np.frombuffer(b, dtype=np.uint8), sender)
                for (k, c), b in zip(doc.get("refs") or [], doc.get("chunks") or [])}
    values: dict[Request, np.ndarray] = {}
    for req, parts in plan:
        if not parts:
            continue  # nothing asked of this request (an ask for the global state only)
        local = [(h.local, h.within(p)) for h, p in parts]
        try:
            if any(r not in supplied for r in ckpt.chunk_refs(local)):
                continue
            dst = out.get(req) if out is not None else None
            if dst is None:
                values[req] = _assemble(req[1], parts, ckpt.read_boxes(local, supplied=supplied))
            else:
                ckpt.read_boxes(local, supplied=supplied, out=[dst[(*p.slices(req[1].offset), ...)] for _, p in parts])
                values[req] = dst
        except CheckpointError as e:
            _log.warning("local tier: box %s %s of step %d from %s rejected (%s: %s); the next tier serves it",
                         req[0], list(req[1].offset), step, sender, type(e).__name__, e)
    gstate = None
    if doc.get("state") is not None and "global" in manifest.state:
        try:
            state = bytes(doc["state"])
            check_state_bytes(manifest, "global", state, sender)
            gstate = decode_state(state).get("global")
        except (CheckpointError, AttributeError) as e:
            _log.warning("local tier: the global state of step %d from %s rejected: %s", step, sender, e)
    return values, gstate


def tiered_read(tiers: TierWriter, gather: Callable[[str, Any], list[Any]], url: str, n: int, step: int, token: str,
                requests: Sequence[Request], invs: Sequence[Mapping[int, Any]], mix: bool,
                stats: dict[str, int]) -> tuple[dict[Request, np.ndarray], Any]:
    """Read ``requests`` of ``step``: own tier (``tiers``: this process's local tier), then the
    holder's replica, then the persistent tier at ``url`` (when ``mix``: it recorded ``token``).
    ``gather``: the all-gather of every rank's metadata, under names numbered by ``n`` (this
    restore's number). Returns the values and the global state. Every rank calls it (two
    exchanges); raises MissingShardError for a box no tier could serve."""
    rank, world = tiers.rank, tiers.world
    values: dict[Request, np.ndarray] = {}
    peer_state: Any = None
    try:  # nothing before the exchanges may raise: every rank must reach both
        own = held(invs[rank], step, token, rank, world)
        left = _read_own(tiers.repository, step, own, list(requests), values)
    except Exception as e:  # noqa: BLE001 - the own tier is then not used
        _log.warning("local tier: %s unusable for step %d: %s: %s", tiers.repository.url, step, type(e).__name__, e)
        own, left = [], list(requests)
        values.clear()
    stats["local"] = sum(int(a.nbytes) for a in values.values())
    # The exchanges only when some rank asks its holder for something (metadata through the coordinator).
    wants = world > 1 and tiers.exchange is not None and any(
        g["left"] for g in gather(f"tiers/restore/{n}/wants", {"left": len(left)}))
    if wants:
        holder = (rank - 1) % world
        index = by_key(held(invs[holder], step, token, rank, world))
        plan = [(r, c) for r, c in ((r, cover(index, *r)) for r in left) if c is not None]
        asked = tiers.exchange.shift(f"tiers/restore/{step}/ask", _peer_ask(step, token, plan), -1)
        answer = tiers.exchange.shift(f"tiers/restore/{step}/serve", serve_replica(
            tiers.repository, (rank + 1) % world, asked), +1)
        served, peer_global = accept_replica(answer, step=step, token=token, holder=holder, world=world,
                                             digest=(invs[holder].get(step) or {}).get("digest"), plan=plan)
        peer_state = None if peer_global is None else {"global": peer_global}
        values.update(served)
        stats["peer"] = sum(int(a.nbytes) for a in served.values())
        left = [r for r in left if r not in served]
    gstate = _global_state(tiers.repository, step, own)
    if gstate is None and world > 1 and tiers.exchange is not None and isinstance(peer_state, dict):
        gs = peer_state["global"]
        gstate = {k: v for k, v in gs.items() if k != "rank"} if isinstance(gs, dict) else gs  # the holder's own per-rank state
    if left or gstate is None:
        if not mix:
            k, b = left[0] if left else ("<global state>", Box((), ()))
            raise MissingShardError(f"no tier holds a verified copy of this box of step {step}", key=k,
                                    object=f"step {step}, token {token}", expected="own tier, peer replica or "
                                    "the persistent tier with the same token", found=f"box at {list(b.offset)}")
        ckpt = Repository(url).open(step)
        for r, a in zip(left, ckpt.read_boxes(left)):
            values[r] = a
        stats["persistent"] = sum(int(values[r].nbytes) for r in left)
        if gstate is None:
            gstate = ckpt.state()
    return values, gstate


def _global_state(repo: Repository, step: int, own: Sequence[HeldBox]) -> Any:
    if not own:
        return None
    try:
        return repo.open(step).state()["global"]
    except (CheckpointError, KeyError, TypeError) as e:
        _log.warning("local tier: the state of step %d does not read on %s: %s", step, repo.url, e)
        return None
