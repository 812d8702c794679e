"""The JAX manager's local tier (FORMAT.md 8.5): the peer exchange over JAX's transfer service, and
the tier hooks (host copies of the own boxes, the boxes a target needs, arrays built from verified boxes).

The exchange moves bytes with ``jax.experimental.transfer`` (the cross-host transfer server XLA
ships for moving arrays between slices): the sender offers its payload as one ``uint8`` array
(``await_pull``) and the receiver pulls it from the sender's server. That is not a collective and
launches no XLA program, so it may run in a background thread while the training loop runs its
own collectives (a ``ppermute`` could not: cross-process programs must start in one order on every
process). Sizes, crc32c and outcomes go through a coordinator of the exchange's own (metadata
only); the receiver checks the payload's crc32c against the sender's before anything uses it.
"""
from __future__ import annotations

import datetime
import itertools
import os
import socket
from typing import Any, Mapping

import jax
import msgpack
import numpy as np
from jax._src import distributed  # the coordinator address is not public API in jax 0.10
from jax.sharding import SingleDeviceSharding

from ckptfmt import Box
from ckptfmt.checksum import crc32c
from ckptfmt.errors import CheckpointError, KeyMismatchError, ShapeMismatchError
from ckptfmt.manager import as_bytes_view, check_payload

from bridges.jax._coord import JaxCoordinator
from bridges.jax._tree import flatten_with_keys, index_to_box, is_prng_key, physical_sharding, placement

__all__ = ["JaxPeerExchange", "requests", "build"]

_exchanges = itertools.count()  # every process constructs its managers (and so its exchanges) in one order

#: Parallel TCP streams per connection and the bytes each request moves: several streams of
#: small requests beat one stream of large ones (the figures: docs/performance.md).
STREAMS = 4
TRANSFER_BYTES = 8 << 20
#: The device of a leaf whose placement is JAX's default (``_jaxtree.placement``): built uncommitted.
_DEFAULT = "default"
#: Environment variable naming the address this process's transfer server listens on and
#: advertises (default: the local address that reaches the jax.distributed coordinator).
ADDRESS_ENV = "CKPTFMT_TIER_ADDRESS"


def _reachable_host() -> str:
    """The local address peers can reach: $CKPTFMT_TIER_ADDRESS, else the interface that routes to
    the jax.distributed coordinator (no packet is sent), else loopback."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    coordinator = getattr(distributed.global_state, "coordinator_address", None) or ""
    host = coordinator.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            mine = s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return f"[{mine}]" if ":" in mine else mine


class JaxPeerExchange:
    """:class:`ckptfmt.manager._tiers.PeerExchange` over ``jax.experimental.transfer``: one transfer
    server per process on its first local device, addresses shared once at construction."""

    #: Safe from a background thread: no XLA program and no collective (see the module docstring).
    background = True

    def __init__(self, timeout_s: float = 300.0) -> None:
        from jax.experimental import transfer  # experimental, and needed by a multi-process local tier only

        self.rank, self.world = int(jax.process_index()), int(jax.process_count())
        self.timeout_s = float(timeout_s)
        self.device = min(jax.local_devices(), key=lambda d: d.id)
        host = _reachable_host()
        self._server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"] * STREAMS,
                                                      transfer_size=TRANSFER_BYTES)
        self._coord = JaxCoordinator(prefix=f"tiers-exchange-{next(_exchanges)}", timeout_s=self.timeout_s)
        self._addresses = [a.decode() for a in self._coord.allgather("addresses", self._server.address().encode())]
        self._connections: dict[int, Any] = {}
        self._calls = 0

    def _connection(self, rank: int) -> Any:
        if rank not in self._connections:
            self._connections[rank] = self._server.connect(self._addresses[rank])
        return self._connections[rank]

    def shift(self, name: str, payload: Any, offset: int) -> np.ndarray:
        """Returns the received bytes as a uint8 array: a view of the pulled buffer, no copy
        (:meth:`shift_all` of one offset)."""
        return self.shift_all(name, {offset: payload})[offset]

    def shift_all(self, name: str, payloads: Mapping[int, Any]) -> dict[int, np.ndarray]:
        """Several shifts at once, one per offset (every rank passes the same offsets): every offer
        is made, the sizes gathered once, every pull started before any is waited on, and the
        outcomes gathered once, so the transfers overlap and the coordinator is asked twice, not
        twice per offset. Returns offset -> what rank ``rank - offset`` sent (a view of the pulled
        buffer, its crc32c checked). A failed pull or check on any rank raises the lowest failed
        rank's CheckpointError on every rank."""
        offsets = sorted(int(d) for d in payloads)
        bufs = [as_bytes_view(payloads[d]) for d in offsets]
        first = self._calls
        self._calls += len(offsets)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
        offered = []
        for j, buf in enumerate(bufs):
            offered.append(jax.device_put(buf if buf.size else np.zeros(1, dtype=np.uint8), self.device))
            self._server.await_pull((first + j) * self.world + self.rank, [offered[-1]], timeout=deadline)
        sizes = [msgpack.unpackb(m) for m in self._coord.allgather(
            f"{name}/offer", msgpack.packb([[int(b.size), crc32c(b)] for b in bufs]))]
        got: dict[int, np.ndarray] = {}
        error, src = None, None
        try:
            pulls = []
            for j, d in enumerate(offsets):
                src = (self.rank - d) % self.world
                size, crc = int(sizes[src][j][0]), int(sizes[src][j][1])
                spec = jax.ShapeDtypeStruct((max(size, 1),), np.uint8, sharding=SingleDeviceSharding(self.device))
                pulls.append((d, src, size, crc, self._connection(src).pull((first + j) * self.world + src, [spec],
                                                                           timeout=deadline)[0]))
            for d, src, size, crc, pulled in pulls:  # (an offer is at least one element: sliced to its size)
                got[d] = check_payload(np.asarray(pulled)[:size], crc, f"{name} from rank {src}")
        except CheckpointError as e:  # agreed on below, so every rank raises
            error = e.to_json()
        except Exception as e:  # noqa: BLE001 - the transfer service's own error type
            error = CheckpointError(f"pulling from rank {src} failed: {type(e).__name__}: {e}", object=name,
                                    expected="the peer's offer", found="an error").to_json()
        outcome = [msgpack.unpackb(m, raw=False) for m in self._coord.allgather(f"{name}/pulled",
                                                                                 msgpack.packb(error))]
        del offered  # every receiver has pulled (or failed): the offers may go
        failed = [(r, e) for r, e in enumerate(outcome) if e is not None]
        if failed:  # the lowest failed rank's error, on every rank (one typed error everywhere)
            r, doc = failed[0]
            raise CheckpointError.from_json(doc, prefix="" if r == self.rank else f"rank {r}: ")
        return got

    def close(self) -> None:
        """Forget the connections and the server (its sockets close when it is collected)."""
        self._connections.clear()
        self._server = None
        self._coord.close()


def _physical(leaf: Any) -> tuple[tuple[int, ...], Any, Any]:
    """(shape, dtype, sharding) of what is stored for a target leaf: a typed PRNG key is its uint32
    key data (trailing key dimensions never split), as the bridge saves it. The sharding is None
    where the leaf leaves its placement to JAX (``_jaxtree.placement``)."""
    placed = placement(leaf)
    if is_prng_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        physical = None if placed is None else physical_sharding(placed, tuple(leaf.shape), leaf.dtype)
        return tuple(data.shape), np.dtype(data.dtype), physical
    return tuple(leaf.shape), np.dtype(leaf.dtype), placed


def _leaf_boxes(key: str, leaf: Any) -> list[tuple[Any, Box]] | None:
    if isinstance(leaf, np.ndarray):
        return [(None, Box.full(tuple(leaf.shape)))]
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return None
    shape, _, sharding = _physical(leaf)
    if sharding is None:  # JAX's default placement: the whole array, built uncommitted as the restore does
        return [(_DEFAULT, Box.full(shape))]
    return [(d, index_to_box(idx, shape)) for d, idx in sharding.addressable_devices_indices_map(shape).items()]


def requests(target: Any) -> list[tuple[str, Box]] | None:
    """The boxes ``target`` (arrays or ``jax.ShapeDtypeStruct``; typed PRNG keys as their key data;
    a leaf without a placement of its own is one whole box) needs here, or None when the tiers
    cannot serve it (no target, a leaf that is no array)."""
    if target is None:
        return None
    try:
        flat, _ = flatten_with_keys(target)
    except (ValueError, TypeError):
        return None
    out: list[tuple[str, Box]] = []
    for key, leaf in flat:
        if not hasattr(leaf, "shape"):
            continue  # a scalar leaf comes from the global state
        boxes = _leaf_boxes(key, leaf)
        if boxes is None:
            return None
        out.extend(dict.fromkeys((key, b) for _, b in boxes))
    return out


def build(target: Any, values: Mapping[tuple[str, Box], np.ndarray], global_state: Any) -> tuple[Any, Any]:
    """The target's pytree rebuilt from verified boxes (a dtype or shape that differs raises:
    the ordinary restore then runs, which casts or reports as the bridge does)."""
    flat, treedef = flatten_with_keys(target)
    bridge = (global_state or {}).get("bridge") or {}
    scalars, impls = bridge.get("leaves", {}), bridge.get("prng_impls", {})
    leaves = []
    for key, leaf in flat:
        if not hasattr(leaf, "shape"):
            if key not in scalars:
                raise KeyMismatchError("a scalar leaf is not in the local step's state", key=key,
                                       expected="a saved leaf", found="missing")
            leaves.append(scalars[key])
            continue
        if isinstance(leaf, np.ndarray):
            shape, dtype, sharding = tuple(leaf.shape), leaf.dtype, None
        else:
            shape, dtype, sharding = _physical(leaf)
        parts = []
        for d, box in _leaf_boxes(key, leaf) or []:
            a = values[(key, box)]
            if a.dtype != dtype or tuple(a.shape) != box.shape:
                raise ShapeMismatchError("a local copy differs from the target", key=key, expected=f"{dtype} {box.shape}",
                                         found=f"{a.dtype} {tuple(a.shape)}")
            # d: None for a numpy leaf, _DEFAULT for JAX's default placement (uncommitted), else a device
            parts.append(a if d is None else jax.device_put(a, None if d is _DEFAULT else d))
        if isinstance(leaf, np.ndarray):
            leaves.append(np.array(parts[0]))
            continue
        arr = parts[0] if sharding is None else jax.make_array_from_single_device_arrays(shape, sharding, parts)
        if is_prng_key(leaf):
            if key not in impls:
                raise KeyMismatchError("a typed PRNG key has no implementation in the local step's state", key=key,
                                       expected="bridge.prng_impls entry", found="missing")
            arr = jax.random.wrap_key_data(arr, impl=impls[key])
        leaves.append(arr)
    return jax.tree_util.tree_unflatten(treedef, leaves), (global_state or {}).get("extra")
