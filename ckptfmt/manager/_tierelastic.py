"""The elastic restore through the tiers (FORMAT.md 8.5, "Elastic restore"): a job whose process
count differs from the save's reads each box it needs from whichever surviving tier copy holds
it, and from the persistent tier only what no survivor holds.

Call order (every rank, after :meth:`LocalTiers.restore` gathered the inventories of the host
repositories each process finds under its tier path, and the processes agreed on the step with
:func:`elastic_sources` and :func:`~ckptfmt.manager._tierplan.plan_tier_reads`):

1. Every process plans every process's reads (the requests were gathered with the step vote),
   so the planned round needs no asks: for each offset ``d`` some process reads over,
   ``shift(-d)`` carries each holder's answer to its asker ``rank - d``: per host repository the
   manifest as stored, the stored chunks of the parts and the global state as stored
   (:func:`~ckptfmt.manager._tierrestore.answer_doc`). The receiving process checks each
   answer itself (:func:`~ckptfmt.manager._tierrestore.accept_replica`: the manifest is the one
   listed, it records the asked step, token, host and host count, every chunk passes the reader's
   checks against it). An answer of another step, save or host is refused whole
   (StepMismatchError, counted in ``refused``) and its pieces, like any piece that fails, go to the
   persistent tier when it holds the step with the same token; otherwise the restore through the
   tiers fails on every process and the ordinary restore runs.
2. Own reads: every piece this process's own host repositories serve, verified by the core
   reader against the local step whose manifest digest the inventory listed; a piece that fails
   is planned again against the peers' copies, asked for in a second round
   (``allgather("tiers/restore/<n>/again")``, then ``shift(+d)`` asks and ``shift(-d)`` answers)
   only when some process has such a piece.
3. The persistent tier reads the rest; each request is assembled from its pieces.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from ckptfmt._types import Box
from ckptfmt.dtypes import numpy_dtype
from ckptfmt.errors import CheckpointError, InvalidStateError, MissingShardError, StepMismatchError
from ckptfmt.manager._tierplan import TierPlan, TierRead, TierSource, assemble, plan_tier_reads
from ckptfmt.manager._tierrestore import (MAX_ASK_BYTES, accept_replica, answer_doc, ask_limits, inventory,
                                         step_token)
from ckptfmt.manager._tiers import HeldBox, PeerExchange
from ckptfmt.repository import Repository

__all__ = ["host_dirs", "host_inventories", "elastic_sources", "elastic_feasible", "elastic_read", "serve_hosts"]

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


def serve_hosts(repos: Mapping[int, Repository], payload: Any) -> bytes:
    """This process's answer to one peer's ask: one answer per asked host repository it holds
    (:func:`~ckptfmt.manager._tierrestore.answer_doc`, all packed in one message), a repository it does not hold left
    out. Never raises: a holder that fails answers with what it has (the asker checks everything
    and asks the next tier for the rest)."""
    out: list[Any] = []
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
            reqs = [(str(k), Box(tuple(o), tuple(n))) for k, o, n in parts]
            try:
                out.append([int(h), answer_doc(repo, step, reqs)])  # packed once, with the others
            except Exception as e:  # noqa: BLE001 - the asker then reads the persistent tier
                _log.warning("local tier: %s cannot serve step %d to a peer: %s: %s", repo.url, step,
                             type(e).__name__, e)
        if want_state and not out:  # only the global state was asked: any held repository's
            for h in sorted(repos):
                try:
                    out.append([int(h), answer_doc(repos[h], step, [])])
                    break
                except Exception:  # noqa: BLE001 - try the next
                    continue
    except Exception as e:  # noqa: BLE001 - an ask that does not decode: answer with nothing
        _log.warning("local tier: a peer's ask is refused: %s: %s", type(e).__name__, e)
    return msgpack.packb({"answers": out}, use_bin_type=True)


def _read_own(repos: Mapping[int, Repository], step: int, digests: Mapping[int, str | None],
              reads: Sequence[TierRead], got: dict[int, np.ndarray]) -> list[int]:
    """Read the own pieces ``reads`` (indices into ``got``'s key space are positions in ``reads``)
    verified; return the positions that failed."""
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
            for i, a in zip(idx, ckpt.read_boxes([reads[i].local for i in idx])):
                got[i] = a
            continue
        except CheckpointError:
            pass  # one at a time: the others are still served here
        for i in idx:
            try:
                got[i] = ckpt.read_boxes([reads[i].local])[0]
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
    ``rank - d`` planned to read from it (``shift(-d)``). Then the own reads; pieces whose own copy
    failed are asked of the other copies in a second round (one gather, then asks and answers per
    offset) only when some process has any. Every rank calls it (the same collectives in the same
    order); ``stats`` gets the bytes each tier served (``local``, ``peer``, ``persistent``,
    ``persistent_held``: persistent bytes of pieces some survivor held but whose copy was refused)
    and ``refused`` answers. Raises MissingShardError when a piece no tier serves remains."""
    plans = [plan_tier_reads(r, requests[r], sources) for r in range(world)]
    plan: TierPlan = plans[rank]
    mine_reqs = requests[rank]
    reads = list(plan.reads)
    got: dict[int, np.ndarray] = {}
    fallback: list[int] = []
    stats.setdefault("refused", [])
    peer_of = {i: r.rank for i, r in enumerate(reads) if r.rank is not None and r.rank != rank}
    gstate: Any = None
    gstate_peer: Any = None
    # Round 1, planned: what each process reads from its peers, without asks.
    if world > 1 and exchange is not None:
        offsets = {(int(x.rank) - r) % world for r, p in enumerate(plans) for x in p.reads
                   if x.rank is not None and x.rank != r}
        offsets |= {(h - r) % world for r in range(world) if (h := _state_holder(r, sources)) is not None}
        for d in sorted(offsets - {0}):
            asker, holder = (rank - d) % world, (rank + d) % world
            theirs = [x for x in plans[asker].reads if x.rank == rank]
            payload = serve_hosts(repos, _pack_ask(step, token, theirs, _state_holder(asker, sources) == rank)) \
                if theirs or _state_holder(asker, sources) == rank else msgpack.packb({"answers": []})
            answer = exchange.shift(f"tiers/restore/{n}/serve/{d}", payload, -d)
            mine = [i for i, p in peer_of.items() if p == holder]
            if not mine and _state_holder(rank, sources) != holder:
                continue
            served, peer_state = _accept(answer, holder, step=step, token=token, hosts=hosts, digests=digests,
                                         reads=reads, mine=mine, stats=stats)
            got.update(served)
            fallback += [i for i in mine if i not in served]
            gstate_peer = peer_state if gstate_peer is None else gstate_peer
    else:
        fallback += list(peer_of)
    # The own copies; a piece one fails is planned again against the peers' copies.
    own = [i for i, r in enumerate(reads) if r.rank == rank]
    failed: list[int] = []
    try:
        local: dict[int, np.ndarray] = {}
        bad = _read_own(repos, step, digests, [reads[i] for i in own], local)
        for j, i in enumerate(own):
            if j in local:
                got[i] = local[j]
        failed = [own[j] for j in bad]
    except Exception as e:  # noqa: BLE001 - the own tier is then not used; every rank still reaches the gather below
        _log.warning("local tier: own copies unusable for step %d: %s: %s", step, type(e).__name__, e)
        failed = [i for i in own if i not in got]
    stats["local"] = sum(int(got[i].nbytes) for i in own if i in got)
    gstate = _own_state(repos, step, [s.host for s in sources if s.rank == rank])
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
            served, peer_state = _accept(answer, to, step=step, token=token, hosts=hosts, digests=digests,
                                         reads=reads, mine=mine, stats=stats)
            got.update(served)
            fallback += [i for i in mine if i not in served]
            if gstate is None and isinstance(peer_state, dict):
                gstate = {k: v for k, v in peer_state.items() if k != "rank"}
            elif gstate is None and peer_state is not None:
                gstate = peer_state
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
        for i, a in zip(left, ckpt.read_boxes([(reads[i].key, reads[i].part) for i in left])):
            got[i] = a
        stats["persistent"] = sum(int(got[i].nbytes) for i in left)
        stats["persistent_held"] = sum(int(got[i].nbytes) for i in left if i in fallback or reads[i].held)
        if gstate is None:
            gstate = ckpt.state()
    values: dict[Request, np.ndarray] = {}
    pieces: dict[int, list[tuple[Box, np.ndarray]]] = {}
    for i, r in enumerate(reads):
        if r.rank == -1:
            continue  # replaced
        pieces.setdefault(r.request, []).append((r.part, got[i]))
    for q, (key, box) in enumerate(mine_reqs):
        if q in pieces:
            ps = pieces[q]
            values[(key, box)] = assemble(box, ps[0][1].dtype, ps, key)
    for q, dt in plan.empty:
        values[mine_reqs[q]] = np.empty(mine_reqs[q][1].shape, dtype=numpy_dtype(dt))
    return values, gstate


def _accept(answer: Any, peer: int, *, step: int, token: str, hosts: int, digests: Mapping[int, str | None],
            reads: Sequence[TierRead], mine: Sequence[int], stats: dict[str, Any]) -> tuple[dict[int, np.ndarray], Any]:
    """The pieces ``mine`` (positions in ``reads``) that process ``peer``'s answer serves, each checked
    here. An answer of another step, save or host is refused whole (StepMismatchError, logged and
    listed in ``stats["refused"]``); its pieces are then left to the persistent tier."""
    try:
        doc = msgpack.unpackb(answer, raw=False, **ask_limits(len(memoryview(answer).cast("B"))))
        answers = {int(h): a for h, a in doc["answers"]}
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
        try:
            values, g = accept_replica(answers[h], step=step, token=token, holder=h, world=hosts,
                                       digest=digests.get(h), plan=plan or [(("", Box((), ())), [])],
                                       sender=f"rank {peer} (host {h}'s local tier)")
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
