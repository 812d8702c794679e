"""The elastic restore through the tiers (FORMAT.md 8.5, "Elastic restore"): a job whose process
count differs from the save's reads each box it needs from whichever surviving tier copy holds
it, and from the persistent tier only what no survivor holds.

Call order (every rank, after :meth:`LocalTiers.restore` gathered the inventories of the host
repositories each process finds under its tier path, and the processes agreed on the step with
:func:`elastic_sources` and :func:`~ckptfmt.manager._tierplan.plan_tier_reads`):

0. Every request gets one output (64-byte aligned, so XLA on CPU adopts it), allocated once;
   every piece, whichever tier serves it, is read and checked straight into its place there
   (a view), so no piece is copied again to assemble its box.
1. Every process plans every process's reads (the requests were gathered with the step vote),
   so the planned round needs no asks: each holder packs, for every offset ``d`` some process
   reads over, what its asker ``rank - d`` planned to read from it (:func:`serve_hosts`, one
   message per asker: per host repository the manifest as stored, the stored chunks of the parts
   and the global state as stored) and the messages move at once (the exchange's ``shift_all``
   where it has one: one offer round for every offset; else ``shift(-d)`` per offset). With an
   exchange that may run in the background (JAX's transfer service, torch's own process group)
   this round runs in a thread while the caller's thread reads the own pieces (step 2). The
   receiving process checks each answer itself (:func:`~ckptfmt.manager._tierrestore.accept_replica`:
   the manifest is the one listed, it records the asked step, token, host and host count, every
   chunk passes the reader's checks against it, then is copied once into its place). An answer of
   another step, save or host is refused whole (StepMismatchError, counted in ``refused``) and its
   pieces, like any piece that fails, go to the persistent tier when it holds the step with the
   same token; otherwise the restore through the tiers fails on every process and the ordinary
   restore runs.
2. Own reads: every piece this process's own host repositories serve, read by the core reader
   into its place, verified against the local step whose manifest digest the inventory listed; a
   piece that fails is planned again against the peers' copies, asked for in a second round
   (``allgather("tiers/restore/<n>/again")``, then ``shift(+d)`` asks and ``shift(-d)`` answers)
   only when some process has such a piece.
3. The persistent tier reads the rest, into the same places (a request no copy holds any of is
   read whole into an array of its own).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import CheckpointError, InvalidStateError, MissingShardError, StepMismatchError
from ckptfmt.manager._tierplan import TierPlan, TierRead, TierSource, plan_tier_reads
from ckptfmt.manager._tieranswer import pack_answers, serve_hosts, unpack_answers
from ckptfmt.manager._tierrestore import accept_replica, inventory, step_token
from ckptfmt.manager._tiers import HeldBox, PeerExchange
from ckptfmt.reader._alloc import aligned_empty
from ckptfmt.repository import Repository

__all__ = ["host_dirs", "host_inventories", "elastic_sources", "elastic_feasible", "elastic_read"]

_log = logging.getLogger("ckptfmt.manager")
Request = tuple[str, Box]
_HOST = re.compile(r"host-(0|[1-9][0-9]{0,8})")


def host_dirs(path: str) -> list[int]:
    """The host repositories (``host-<h>``) under a local tier path, by host number; none when the
    path does not list."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_HOST.fullmatch, names) if m is not None
                  and os.path.isdir(os.path.join(path, m.group(0))))


def host_inventories(repos: Mapping[int, Repository]) -> dict[int, dict[int, Any]]:
    """host -> that repository's :func:`~ckptfmt.manager._tierrestore.inventory`."""
    return {h: inventory(r) for h, r in repos.items()}


def elastic_sources(step: int, token: str | None, held_by: Mapping[int, tuple[int, Mapping[int, Any]]]
                    ) -> tuple[list[TierSource], int | None]:
    """The sources of ``step``: every host repository (``held_by``: host -> (holding process, its
    inventory)) listing ``step`` with ``token``, and the save's host count. Copies that disagree on
    the host count are not candidates (none is used), nor is a host's step that records another
    host number than its repository's."""
    out: list[TierSource] = []
    counts: set[int] = set()
    for h in sorted(held_by):
        rank, inv = held_by[h]
        e = inv.get(step)
        if e is None or token is None or e.get("token") != token:
            continue
        try:
            boxes = tuple(HeldBox.from_wire(w) for w in e["boxes"])
        except (CheckpointError, TypeError, ValueError, KeyError):
            continue
        counts.add(int(e["hosts"]))
        out.append(TierSource(int(rank), int(h), boxes))
    if len(counts) != 1:
        return [], None
    return out, counts.pop()


def elastic_feasible(rank: int, requests: Sequence[Request], held_by: Mapping[int, tuple[int, Mapping[int, Any]]],
                     persistent: Mapping[int, str | None]) -> list[int]:
    """The steps this process can restore elastically, newest first: some surviving copy of the
    step exists, and every piece no survivor holds is on the persistent tier with the step's token."""
    steps = sorted({s for _, inv in held_by.values() for s in inv}, reverse=True)
    out = []
    for s in steps:
        token = step_token(s, [inv for _, inv in (held_by[h] for h in sorted(held_by))], persistent.get(s))
        sources, _ = elastic_sources(s, token, held_by)
        if not sources:
            continue
        mix = s in persistent and persistent[s] == token
        if mix or not plan_tier_reads(rank, requests, sources).persistent:
            out.append(s)
    return out


def _pack_ask(step: int, token: str, reads: Sequence[TierRead], state: bool) -> bytes:
    hosts: dict[int, list[Any]] = {}
    for r in reads:
        local, within = r.local
        hosts.setdefault(int(r.host), []).append([local, list(within.offset), list(within.shape)])  # type: ignore[arg-type]
    return msgpack.packb({"step": int(step), "token": str(token), "hosts": [[h, p] for h, p in sorted(hosts.items())],
                          "state": bool(state)})


def _read_own(repos: Mapping[int, Repository], step: int, digests: Mapping[int, str | None],
              reads: Sequence[TierRead], into: Sequence[np.ndarray]) -> list[int]:
    """Read the own pieces ``reads`` verified, each into its place ``into[i]`` (the core reader,
    against the local step whose manifest digest the inventory listed); return the positions
    that failed (their places may be partly written: the next copy overwrites them)."""
    failed: list[int] = []
    by_host: dict[int, list[int]] = {}
    for i, r in enumerate(reads):
        by_host.setdefault(int(r.host), []).append(i)  # type: ignore[arg-type]
    for h, idx in sorted(by_host.items()):
        try:
            ckpt = repos[h].open(step)
            found = hashlib.sha256(ckpt.manifest_bytes).hexdigest()
            if found != digests.get(h):
                raise StepMismatchError("a local step changed after its inventory", object=repos[h].url,
                                        expected=f"manifest sha256 {digests.get(h)}", found=f"manifest sha256 {found}")
        except CheckpointError as e:
            _log.warning("local tier: step %d of %s is not used: %s: %s", step, repos[h].url, type(e).__name__, e)
            failed += idx
            continue
        try:
            ckpt.read_boxes([reads[i].local for i in idx], out=[into[i] for i in idx])
            continue
        except CheckpointError:
            pass  # one at a time: the others are still served here
        for i in idx:
            try:
                ckpt.read_boxes([reads[i].local], out=[into[i]])
            except CheckpointError as e:
                _log.warning("local tier: box %s %s of step %d rejected on %s (%s: %s); the next copy serves it",
                             reads[i].key, list(reads[i].part.offset), step, repos[h].url, type(e).__name__, e)
                failed.append(i)
    return failed


def _state_holder(asker: int, sources: Sequence[TierSource]) -> int | None:
    """The process that sends ``asker`` the global state in the planned round: None when ``asker``
    holds a copy itself, else the first other holder (every process computes the same)."""
    if any(s.rank == asker for s in sources):
        return None
    return next((s.rank for s in sources if s.rank != asker), None)


class _Places:
    """Where each piece of this process's requests goes: one output per request, allocated once,
    each piece read straight into its place (a view); a request no source holds any of is read
    whole from the persistent tier into an array of its own."""

    def __init__(self, requests: Sequence[Request], reads: Sequence[TierRead]) -> None:
        self.requests = requests
        dts: dict[int, np.dtype] = {}
        for r in reads:
            if r.source is not None and r.request not in dts:
                dts[r.request] = numpy_dtype(r.source.dtype)
        # Aligned, as the core reader's: XLA on CPU adopts the restored arrays without a copy.
        self.outputs: dict[int, np.ndarray] = {q: aligned_empty(requests[q][1].shape, dts[q]) for q in sorted(dts)}

    def of(self, r: TierRead) -> np.ndarray | None:
        """The place of piece ``r``, or None (its request has no output: read it whole)."""
        out = self.outputs.get(r.request)
        return None if out is None else out[(*r.part.slices(self.requests[r.request][1].offset), ...)]  # a view, 0-d too


def elastic_read(*, rank: int, world: int, exchange: PeerExchange | None, gather: Callable[[str, Any], list[Any]],
                 url: str, n: int, step: int, token: str, hosts: int, mix: bool,
                 requests: Sequence[Sequence[Request]], sources: Sequence[TierSource],
                 repos: Mapping[int, Repository], digests: Mapping[int, str | None],
                 stats: dict[str, Any]) -> tuple[dict[Request, np.ndarray], Any]:
    """Read this process's requests (``requests[rank]``; ``requests`` holds every process's) of
    ``step`` (token ``token``, saved by ``hosts`` hosts) through the tiers: own host repositories
    (``repos``), peers' (``sources`` held by other processes, over ``exchange``), then the
    persistent tier at ``url`` (only when ``mix``: it recorded ``token``).

    Every process plans every process's reads (the planner is pure), so the planned round needs no
    asks: for each offset ``d`` some process reads over, each holder sends what its asker
    ``rank - d`` planned to read from it (``shift(-d)``), every piece for that asker in one
    message. With a background exchange that round runs in a thread while this one reads the own
    pieces; every piece, own, peer's or persistent, is read straight into its place in the
    request's one output (checked there by the core reader). Then pieces whose own copy failed are
    asked of the other copies in a second round (one gather, then asks and answers per offset)
    only when some process has any. Every rank calls it (the same collectives in the same order);
    ``stats`` gets the bytes each tier served (``local``, ``peer``, ``persistent``,
    ``persistent_held``: persistent bytes of pieces some survivor held but whose copy was refused)
    and ``refused`` answers. Raises MissingShardError when a piece no tier serves remains."""
    plans = [plan_tier_reads(r, requests[r], sources) for r in range(world)]
    plan: TierPlan = plans[rank]
    mine_reqs = requests[rank]
    reads = list(plan.reads)
    places = _Places(mine_reqs, reads)
    got: dict[int, np.ndarray] = {}
    fallback: list[int] = []
    stats.setdefault("refused", [])
    peer_of = {i: r.rank for i, r in enumerate(reads) if r.rank is not None and r.rank != rank}
    peer_state: list[Any] = []

    def accept(answer: Any, peer: int, mine: Sequence[int]) -> None:
        served, state = _accept(answer, peer, step=step, token=token, hosts=hosts, digests=digests, reads=reads,
                                mine=mine, stats=stats, places=places)
        got.update(served)
        fallback.extend(i for i in mine if i not in served)
        if state is not None:
            peer_state.append(state)

    def planned_round() -> None:
        """Round 1, planned: what each process reads from its peers, without asks."""
        offsets = {(int(x.rank) - r) % world for r, p in enumerate(plans) for x in p.reads
                   if x.rank is not None and x.rank != r}
        offsets |= {(h - r) % world for r in range(world) if (h := _state_holder(r, sources)) is not None}
        payloads = {}
        for d in sorted(offsets - {0}):
            asker = (rank - d) % world
            theirs = [x for x in plans[asker].reads if x.rank == rank]
            state = _state_holder(asker, sources) == rank
            payloads[d] = serve_hosts(repos, _pack_ask(step, token, theirs, state)) if theirs or state \
                else pack_answers([])
        name = f"tiers/restore/{n}/serve"
        if not payloads:
            return
        if callable(getattr(exchange, "shift_all", None)):  # the transfers at once (JAX: one offer round)
            answers = exchange.shift_all(name, {-d: p for d, p in payloads.items()})  # type: ignore[union-attr]
            answers = {-d: a for d, a in answers.items()}
        else:
            answers = {d: exchange.shift(f"{name}/{d}", p, -d) for d, p in payloads.items()}  # type: ignore[union-attr]
        del payloads
        for d, answer in sorted(answers.items()):
            holder = (rank + d) % world
            mine = [i for i, p in peer_of.items() if p == holder]
            if mine or _state_holder(rank, sources) == holder:
                accept(answer, holder, mine)

    background: threading.Thread | None = None
    failure: list[BaseException] = []
    if world > 1 and exchange is not None:
        if getattr(exchange, "background", False):
            def run() -> None:
                try:
                    planned_round()
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread after the join
                    failure.append(e)
            background = threading.Thread(target=run, name="ckptfmt-tiers-restore", daemon=True)
            background.start()
        else:
            planned_round()
    else:
        fallback += list(peer_of)
    # The own copies (meanwhile the planned round runs); a piece one fails is planned again
    # against the peers' copies.
    own = [i for i, r in enumerate(reads) if r.rank == rank]
    failed: list[int] = []
    try:
        bad = _read_own(repos, step, digests, [reads[i] for i in own], [_place(places, reads[i]) for i in own])
        failed = [own[j] for j in bad]
        bad_set = set(failed)
        own_got = {i: _place(places, reads[i]) for i in own if i not in bad_set}
    except Exception as e:  # noqa: BLE001 - the own tier is then not used; every rank still reaches the gather below
        _log.warning("local tier: own copies unusable for step %d: %s: %s", step, type(e).__name__, e)
        failed, own_got = list(own), {}
    if background is not None:
        background.join()
    if failure:
        raise failure[0]
    got.update(own_got)
    stats["local"] = sum(int(got[i].nbytes) for i in own if i in got)
    gstate = _own_state(repos, step, [s.host for s in sources if s.rank == rank])
    gstate_peer = peer_state[0] if peer_state else None
    if gstate is None and isinstance(gstate_peer, dict):
        gstate = {k: v for k, v in gstate_peer.items() if k != "rank"}  # another process's per-rank state
    elif gstate is None:
        gstate = gstate_peer
    again: list[int] = []
    if failed:
        replan = plan_tier_reads(rank, [(reads[i].key, reads[i].part) for i in failed],
                                 [s for s in sources if s.rank != rank])
        for r in replan.reads:
            base = reads[failed[r.request]]
            again.append(len(reads))
            reads.append(TierRead(base.request, r.key, r.part, r.rank, r.host, r.source, True, r.nbytes))
        for i in failed:
            reads[i] = TierRead(reads[i].request, reads[i].key, reads[i].part, -1)  # replaced by the pieces above
    asks: dict[int, list[int]] = {}
    for i in again:
        if reads[i].rank is not None:
            asks.setdefault(int(reads[i].rank), []).append(i)  # type: ignore[arg-type]
    if gstate is None and not asks:
        holder = next((s.rank for s in sources if s.rank != rank), None)
        if holder is not None:
            asks[holder] = []
    # Round 2, asked: only when some process has pieces its own copy failed (or lacks the state).
    if world > 1 and exchange is not None:
        wants = gather(f"tiers/restore/{n}/again", {"to": sorted(asks)})
        for d in sorted({(int(p) - r) % world for r, g in enumerate(wants) for p in g["to"]} - {0}):
            to = (rank + d) % world
            mine = asks.get(to)
            ask = _pack_ask(step, token, [reads[i] for i in mine or []], gstate is None) if mine is not None else \
                msgpack.packb({"step": int(step), "token": str(token), "hosts": [], "state": False})
            asked = exchange.shift(f"tiers/restore/{n}/ask/{d}", ask, +d)
            answer = exchange.shift(f"tiers/restore/{n}/reserve/{d}", serve_hosts(repos, asked), -d)
            if mine is None:
                continue
            peer_state.clear()
            accept(answer, to, mine)
            if gstate is None and peer_state:
                g = peer_state[0]
                gstate = {k: v for k, v in g.items() if k != "rank"} if isinstance(g, dict) else g
    else:
        fallback += [i for i in again if reads[i].rank is not None]
    stats["peer"] = sum(int(got[i].nbytes) for i, r in enumerate(reads)
                        if r.rank is not None and r.rank >= 0 and r.rank != rank and i in got)
    left = [i for i, r in enumerate(reads) if r.rank is None] + sorted(set(fallback))
    if left or gstate is None:
        if not mix:
            i = left[0] if left else None
            raise MissingShardError(f"no tier holds a verified copy of this box of step {step}",
                                    key=reads[i].key if i is not None else "<global state>",
                                    object=f"step {step}, token {token}",
                                    expected="a surviving local copy or the persistent tier with the same token",
                                    found=f"box at {list(reads[i].part.offset)}" if i is not None else "none")
        ckpt = Repository(url).open(step)
        into = [i for i in left if places.of(reads[i]) is not None]
        whole = [i for i in left if i not in set(into)]
        if into:
            ckpt.read_boxes([(reads[i].key, reads[i].part) for i in into], out=[_place(places, reads[i]) for i in into])
            got.update((i, _place(places, reads[i])) for i in into)
        if whole:
            got.update(zip(whole, ckpt.read_boxes([(reads[i].key, reads[i].part) for i in whole])))
        stats["persistent"] = sum(int(got[i].nbytes) for i in left)
        stats["persistent_held"] = sum(int(got[i].nbytes) for i in left if i in fallback or reads[i].held)
        if gstate is None:
            gstate = ckpt.state()
    values: dict[Request, np.ndarray] = {}
    filled: dict[int, int] = {}
    for i, r in enumerate(reads):
        if r.rank == -1:
            continue  # replaced
        if i not in got:
            raise MissingShardError("a planned piece was not read", key=r.key, object=f"step {step}",
                                    expected=f"box at {list(r.part.offset)} read", found="none")
        filled[r.request] = filled.get(r.request, 0) + r.part.size
        if r.request not in places.outputs:
            values[mine_reqs[r.request]] = got[i]  # a request read whole from the persistent tier
    for q, out in places.outputs.items():
        key, box = mine_reqs[q]
        if filled.get(q) != box.size:  # the planner's cells tile the box; nothing is left unwritten
            raise InvalidStateError("the pieces of a box do not cover it", key=key, object=f"box at {list(box.offset)}",
                                    expected=f"{box.size} elements", found=f"{filled.get(q, 0)} elements")
        values[(key, box)] = out
    for q, dt in plan.empty:
        values[mine_reqs[q]] = np.empty(mine_reqs[q][1].shape, dtype=numpy_dtype(dt))
    return values, gstate


def _place(places: _Places, r: TierRead) -> np.ndarray:
    out = places.of(r)
    assert out is not None  # a piece some source holds: its request has an output
    return out


def _accept(answer: Any, peer: int, *, step: int, token: str, hosts: int, digests: Mapping[int, str | None],
            reads: Sequence[TierRead], mine: Sequence[int], stats: dict[str, Any], places: _Places | None = None
            ) -> tuple[dict[int, np.ndarray], Any]:
    """The pieces ``mine`` (positions in ``reads``) that process ``peer``'s answer serves, each checked
    here and copied once into its place (``places``; else fresh arrays). An answer of another step,
    save or host is refused whole (StepMismatchError, logged and listed in ``stats["refused"]``);
    its pieces are then left to the persistent tier."""
    try:
        answers = unpack_answers(answer)
    except Exception as e:  # noqa: BLE001 - another process's bytes: untrusted input
        stats["refused"].append({"rank": peer, "error": f"InvalidStateError: the answer does not decode: {e}"})
        return {}, None
    by_host: dict[int, list[int]] = {}
    for i in mine:
        by_host.setdefault(int(reads[i].host), []).append(i)  # type: ignore[arg-type]
    out: dict[int, np.ndarray] = {}
    gstate = None
    for h in sorted(set(by_host) | ({min(answers)} if not by_host and answers else set())):
        if h not in answers:
            continue
        idx = by_host.get(h, [])
        plan = [((reads[i].key, reads[i].part), [(reads[i].source, reads[i].part)]) for i in idx]
        into = {(reads[i].key, reads[i].part): p for i in idx if (p := places.of(reads[i]) if places else None)
                is not None}
        try:
            values, g = accept_replica(answers[h], step=step, token=token, holder=h, world=hosts,
                                       digest=digests.get(h), plan=plan or [(("", Box((), ())), [])],
                                       sender=f"rank {peer} (host {h}'s local tier)", out=into)
        except CheckpointError as e:
            _log.warning("local tier: the answer of rank %d for host %d of step %d is refused: %s: %s", peer, h, step,
                         type(e).__name__, e)
            stats["refused"].append({"rank": peer, "host": h, "error": f"{type(e).__name__}: {e}"})
            continue
        for i in idx:
            a = values.get((reads[i].key, reads[i].part))
            if a is not None:
                out[i] = a
        gstate = g if gstate is None else gstate
    return out, gstate


def _own_state(repos: Mapping[int, Repository], step: int, hosts: Sequence[int]) -> Any:
    """The global state of ``step`` from an own host repository (its per-rank part dropped: it was
    another process's), or None."""
    for h in sorted(set(hosts)):
        try:
            g = repos[h].open(step).state()["global"]
        except (CheckpointError, KeyError, TypeError) as e:
            _log.warning("local tier: the state of step %d does not read on %s: %s", step, repos[h].url, e)
            continue
        return {k: v for k, v in g.items() if k != "rank"} if isinstance(g, dict) else g
    return None
